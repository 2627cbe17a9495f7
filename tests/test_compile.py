"""train.compile: each transformer block compiled (inductor on CPU; tasks/parallel/compile.py) trains the same curve
as one eager process — per step the loss and the pre-clip gradient norm — under FSDP (ZeRO 3), replicated data
parallelism with overlapped gradient buckets (ZeRO 1), activation checkpointing, a pipeline and expert parallelism;
parameter names (checkpoints) are those of the eager model; tensor parallelism is refused before launch."""

from __future__ import annotations

import pytest

from tasks.errors import ConfigError
from tests.helpers.train_fixture import assert_same_run, configure, context, reference_run, shards, torchrun, write_spec  # noqa: F401

COMPILED = {"train.compile": True, "hardware.nproc_per_node": 2}
MOE = {"model.preset": "moe-demo", "model.n_layers": 2}
LAYOUTS = {  # name: config
    "dp2": {"parallel.dp": 2, "train.checkpoint_every": 5},
    "dp2_zero1": {"parallel.dp": 2, "parallel.zero": 1},
    "dp2_zero2_selective": {"parallel.dp": 2, "parallel.zero": 2, "parallel.recompute": "selective"},
    "pp2_1f1b": {"parallel.dp": 1, "parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
    "moe_dp2_ep2": {**MOE, "parallel.dp": 2, "parallel.ep": 2},
}


@pytest.mark.slow
def test_compiled_blocks_train_the_eager_curve_on_every_layout(cfg, tmp_path, shards):
    from tasks.config import load_config
    from tasks.parallel.checkpoint import read_meta
    from tests.helpers.train_fixture import checkpoint_params

    specs = [write_spec(configure(cfg, **COMPILED, **sets), tmp_path / name, shards) for name, sets in LAYOUTS.items()]
    # Inductor's caches in this test's own directory: cold on every run (never warm from an earlier run or another
    # checkout), shared by both ranks (a kernel one rank builds, the other waits for and loads: codecache's file
    # locks) and by the layouts (a graph already compiled in this launch is loaded, not compiled again).
    inductor = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
    rc, out = torchrun(configure(cfg, **COMPILED), 2, specs, tmp_path / "torchrun.log", inductor)
    assert rc == 0, out[-3000:]
    dense = reference_run(configure(load_config("demo-cpu")), shards, 5)
    moe = reference_run(configure(load_config("demo-cpu"), **MOE), shards, 5)
    for name in LAYOUTS:
        # inductor's fused kernels round differently from eager's: equal within 1e-4 (measured: ~1e-7)
        assert_same_run(tmp_path / name, moe if name.startswith("moe") else dense, f"compiled {name}", norm_rel=1e-4)
    ckpt = tmp_path / "dp2" / "checkpoints" / "step-5"
    assert read_meta(ckpt)["step"] == 5
    assert not any("_orig_mod" in k for k in checkpoint_params(ckpt))  # the eager model's names


def test_compile_with_tensor_parallelism_is_refused_before_launch(cfg, tmp_path, shards):
    from tasks.stages import train

    c = configure(cfg, **COMPILED, **{"parallel.dp": 1, "parallel.tp": 2})
    with pytest.raises(ConfigError, match=r"train.compile: not with tensor parallelism \(parallel.tp 2\)"):
        train.prepare(c, context(tmp_path, shards))


@pytest.mark.parametrize("seq", [128, 320])  # the math backend, and SDPA's own choice above MATH_ATTENTION_MAX_SEQ
def test_compiled_blocks_attention_is_causal_sdpa(seq):
    import torch
    import torch.nn.functional as F

    from tasks.model import build_model, get_preset
    from tasks.model.transformer import Attention
    from tasks.parallel.compile import MATH_ATTENTION_MAX_SEQ, apply_compile, math_attention

    assert (seq <= MATH_ATTENTION_MAX_SEQ) == (seq == 128)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, seq, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    got, want = math_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    prefix = math_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8])  # causal: the first 8 see only the first 8
    torch.testing.assert_close(got[:, :, :8], prefix, atol=2e-2, rtol=2e-2)

    model = build_model(get_preset("debug"), "cpu")
    apply_compile(model, "cpu")  # the blocks' attention, not converters' (their own `attend` stays)
    assert all(b.attention.attend is math_attention for b in model.layers.values())
    assert Attention.attend is not math_attention
