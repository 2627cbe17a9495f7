"""Mixture-of-experts leftovers: a model trained with a capacity factor is exported (HF Qwen2-MoE has no capacity) as
the dropless model, said in one line at launch and at export and recorded in the export's llm-pipeline.json; the
shared expert's size is a config key (model.shared_ffn_dim) that reaches the model and the exported config.json."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from tasks.errors import ConfigError  # noqa: E402
from tests.helpers.train_fixture import shards  # noqa: E402,F401

TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
NOTE = "model.capacity_factor 0.25: training drops the expert assignments above ceil(0.25 · tokens · top_k / experts)"


def _moe(capacity_factor: float):
    from tasks.model import build_model, get_preset, materialize

    tcfg = get_preset("moe-demo").override(n_layers=2, vocab_size=256, capacity_factor=capacity_factor)
    return materialize(build_model(tcfg), "cpu", seed=0).eval()


def _export(model, root, capfd):
    import torch.distributed.checkpoint as dcp

    from tasks.model.hf_export import export_from_checkpoint

    dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "step-1"), no_dist=True)
    capfd.readouterr()
    out = export_from_checkpoint(root / "step-1", model.config, root / "hf")
    return out, [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]


def test_a_capacity_trained_export_says_it_routes_every_token_and_records_it(tmp_path, capfd):
    """The capacity-limited model drops assignments on this batch (its logits differ from the dropless model's); its
    export is what the evaluate stage loads (full_precision) and computes the dropless model — said in one warning
    line and recorded in llm-pipeline.json; a dropless run's export says and records nothing."""
    from tasks.harness.models import full_precision

    tight, dropless = _moe(0.25), _moe(0.0)
    with torch.no_grad():
        trained, free = tight(TOKENS), dropless(TOKENS)
    assert (trained - free).abs().max() > 1e-3  # the batch overflows the capacity: a different function
    (tmp_path / "tight").mkdir()
    out, said = _export(tight, tmp_path / "tight", capfd)
    assert len(said) == 1 and said[0].startswith(f"warning: {NOTE}"), said
    assert "Qwen2MoeForCausalLM has no capacity" in said[0] and "route every token" in said[0]
    manifest = json.loads((out / "llm-pipeline.json").read_text())
    assert manifest["moe_capacity"] == {"trained_capacity_factor": 0.25, "exported_routes": "every token"}
    with torch.no_grad():
        evaluated = full_precision(out, "fp32", "cpu")(TOKENS)
    torch.testing.assert_close(evaluated, free, atol=1e-5, rtol=1e-5)  # what evaluate scores: the dropless model
    (tmp_path / "free").mkdir()
    out, said = _export(dropless, tmp_path / "free", capfd)
    assert said == [] and "moe_capacity" not in json.loads((out / "llm-pipeline.json").read_text())


def test_training_with_a_capacity_factor_says_so_before_launch(tmp_path, shards):  # noqa: F811
    """The train stage's launch warnings (stderr, the stage result) carry the same line; dropless: nothing."""
    from tasks.config import load_config
    from tasks.stages import train
    from tests.helpers.train_fixture import configure, context

    cfg = load_config("demo-cpu")  # tracking off (configure): no MLflow store needed
    cfg.data.out_dir = str(tmp_path / "data")

    one = {"hardware.nproc_per_node": 1, "parallel.dp": 1, "model.preset": "moe-demo"}
    spec = train.prepare(configure(cfg, **one, **{"model.capacity_factor": 0.25}), context(tmp_path / "cf", shards))
    [note] = [w for w in spec["warnings"] if "capacity_factor" in w]
    assert note.startswith(NOTE) and "route every token" in note, note
    spec = train.prepare(configure(cfg, **one), context(tmp_path / "free", shards))
    assert not any("capacity_factor" in w for w in spec["warnings"])


def test_shared_ffn_dim_is_a_model_key_that_reaches_the_weights_and_the_export(tmp_path):
    """model.shared_ffn_dim: the preset's value replaced → the shared expert's weights → config.json's
    shared_expert_intermediate_size, which transformers' Qwen2MoeConfig reads and our reader reads back; 0 and a
    dense model are refused in one line."""
    import transformers

    from tasks.config import load_config
    from tasks.model import build_model
    from tasks.model.hf_config import read_hf_config
    from tasks.model.hf_io import write_config
    from tasks.model.resolve import from_pipeline

    tcfg = from_pipeline(load_config("ci-tiny", sets=["model.preset=moe-demo", "model.shared_ffn_dim=96"]), 512)
    assert tcfg.shared_ffn_dim == 96  # moe-demo's own is 256
    shared = build_model(tcfg).layers["0"].moe.shared
    assert (shared.w1.weight.shape, shared.w2.weight.shape) == ((96, tcfg.dim), (tcfg.dim, 96))
    write_config(tmp_path, tcfg, torch.float32, None)
    assert json.loads((tmp_path / "config.json").read_text())["shared_expert_intermediate_size"] == 96
    assert transformers.Qwen2MoeConfig.from_pretrained(tmp_path).shared_expert_intermediate_size == 96
    assert read_hf_config(tmp_path).shared_ffn_dim == 96
    with pytest.raises(ConfigError, match=r"^model\.shared_ffn_dim: 0 must be"):
        load_config("ci-tiny", sets=["model.preset=moe-demo", "model.shared_ffn_dim=0"])
    with pytest.raises(ConfigError, match=r"^model\.shared_ffn_dim: mixture-of-experts settings, but model.preset"):
        from_pipeline(load_config("ci-tiny", sets=["model.shared_ffn_dim=96"]), 512)
