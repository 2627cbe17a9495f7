"""Tensor parallelism with tied embeddings (Qwen2-0.5B/1.5B tie lm_head to the embedding): the embedding and the
output projection share one hidden-sharded DTensor parameter, so tp2 and dp2×tp2 (ZeRO 3 and 0) reproduce the
single-process curve, and the export is a tied HF model that transformers loads with the trained logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from tests.helpers.models import logits_of_checkpoint, tiny_qwen2  # noqa: E402
from tests.helpers.train_fixture import (
    assert_same_curve,
    configure,
    losses,
    reference_losses,
    shards,  # noqa: F401
    torchrun,  # noqa: E402,F401
    write_spec,
)

LAYOUTS = {  # name: (ranks, dp, tp, zero)
    "dp2_tp2": (4, 2, 2, 3),
    "dp2_tp2_zero0": (4, 2, 2, 0),
    "tp2": (2, 1, 2, 3),
}
# 3 steps (2 of warm-up, 1 at the cosine's peak), each the reference's; tp2 (dp1) takes micro-batches of 4 (2 per step,
# accumulated like dp2's): 8 sequences per step in every layout, one reference.
STEPS = 3


@pytest.mark.slow
def test_tied_embeddings_train_under_tp_like_one_process_and_export_tied(cfg, tmp_path, shards):  # noqa: F811
    import transformers

    from tasks.model import TransformerConfig

    vocab = json.loads((shards / "manifest.json").read_text())["vocab_size"]
    tiny_qwen2(tmp_path / "ckpt", vocab, tie_word_embeddings=True)
    tied = {"model.hf_path": str(tmp_path / "ckpt"), "model.preset": "demo", "train.steps": STEPS}
    export = {"tokenizer_dir": str(shards)}
    specs: dict[int, list] = {}
    for name, (ranks, dp, tp, zero) in LAYOUTS.items():
        c = configure(
            cfg,
            **tied,
            **{
                "parallel.dp": dp,
                "parallel.tp": tp,
                "parallel.pp": 1,
                "parallel.zero": zero,
                "hardware.nproc_per_node": ranks,
                "train.micro_batch": 8 // (2 * dp),
            },
        )
        specs.setdefault(ranks, []).append(write_spec(c, tmp_path / name, shards, export=export))
    for ranks, paths in specs.items():
        c = configure(cfg, **tied, **{"hardware.nproc_per_node": ranks})
        rc, out = torchrun(c, ranks, paths, tmp_path / f"torchrun{ranks}.log")
        assert rc == 0, out[-3000:]

    want = reference_losses(configure(cfg, **tied), shards, STEPS)
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    for name in LAYOUTS:
        assert_same_curve(losses(tmp_path / name), want, name, steps=range(1, STEPS + 1))
        hf_dir = tmp_path / name / "hf"
        assert json.loads((hf_dir / "config.json").read_text())["tie_word_embeddings"] is True
        back = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()  # tied on load
        trained = TransformerConfig(**json.loads((tmp_path / name / "train" / "launch.json").read_text())["model"])
        ours = logits_of_checkpoint(tmp_path / name / "checkpoints" / f"step-{STEPS}", trained, tokens)
        with torch.no_grad():
            torch.testing.assert_close(back(tokens).logits, ours, atol=1e-4, rtol=1e-4)


def test_pipeline_split_of_tied_embeddings_is_refused_with_the_fix():
    from tasks.model import get_preset
    from tasks.layout import Layout, check

    tcfg = get_preset("qwen2-0.5b")
    assert not check(Layout(dp=2, tp=2, global_batch=4), tcfg, 128, 4, "test")
    [problem] = check(Layout(dp=1, tp=2, pp=2, global_batch=4, micro_batch=2, microbatches=2), tcfg, 128, 4, "test")
    assert problem.startswith("parallel.pp: 2 splits the model's tied embeddings") and "set parallel.pp 1" in problem


def test_tp_keeps_one_shared_weight_for_fsdp_to_manage(tmp_path):
    """parallelize_module swaps each end of the tie for its own DTensor parameter; apply_tp re-ties them at once, so
    FSDP2 (which wraps right after, before materialize's own re-tie) manages one embedding, not a stale second copy.
    One real gloo rank: the same DTensor parameters any tp degree makes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from tasks.model import Transformer, TransformerConfig
    from tasks.parallel.tp import apply_tp

    shape = dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, n_layers=1)
    with torch.device("meta"):
        untied = sum(1 for _ in Transformer(TransformerConfig(**shape)).parameters())
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = Transformer(TransformerConfig(**shape, tie_embeddings=True))
        apply_tp(model, mesh["tp"], sequence_parallel=True)
        assert isinstance(model.tok_embeddings.weight, DTensor)
        assert model.output.weight is model.tok_embeddings.weight
        fully_shard(model, mesh=mesh["dp"])
        assert sum(1 for _ in model.parameters()) == untied - 1  # FSDP2's parameters: one embedding, shared
        assert model.output.weight is model.tok_embeddings.weight
    finally:
        dist.destroy_process_group()
