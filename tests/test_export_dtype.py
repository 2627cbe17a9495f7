"""The training export keeps the dtype of the checkpoint training started from (model.hf_path): a published BF16
checkpoint fine-tuned here came back in FP32, twice the size and labelled float32. Training holds fp32 master
weights; the export rounds them to bf16 (as transformers' save_pretrained writes a bf16 model), and every reader of
the export in this repo (load_hf: quantize, smoke, QAT; evaluate's harness) reads back the values it holds."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"


def _trained_checkpoint(root, dtype):
    """A tiny Qwen2 saved by transformers in `dtype` (the published checkpoint), loaded as training loads it (fp32),
    nudged off the bf16 grid (a training step's worth) and saved as a DCP checkpoint: (hf dir, step dir, model)."""
    import torch.distributed.checkpoint as dcp

    from tasks.model.hf_io import load_hf
    from tests.helpers.models import tiny_qwen2

    tiny_qwen2(root / "hf", vocab=256).to(dtype).save_pretrained(root / "hf")
    model = load_hf(root / "hf")
    assert next(model.parameters()).dtype == torch.float32  # training's master weights
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "step-1"), no_dist=True)
    return root / "hf", root / "step-1", model


def _stored(out) -> set:
    from tasks.model.safetensors_io import read_header

    return {e.dtype for e in read_header(out / "model.safetensors").values()}


def _labels(out) -> tuple:
    cfg = json.loads((out / "config.json").read_text())
    return cfg["dtype"], cfg["torch_dtype"]


def _assert_holds(model, trained, dtype):
    """`model` (fp32, as the readers compute) holds the trained weights rounded to `dtype`, exactly."""
    got, want = model.state_dict(), trained.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], t.to(dtype).float()), name


def test_a_bf16_checkpoint_fine_tuned_here_is_exported_in_bf16_and_read_back_as_it_holds(tmp_path):
    from tasks.harness.models import full_precision
    from tasks.model.hf_export import export_from_checkpoint
    from tasks.model.hf_io import load_hf

    hf, step, trained = _trained_checkpoint(tmp_path, torch.bfloat16)
    out = export_from_checkpoint(step, trained.config, tmp_path / "export", hf_path=hf)
    assert _stored(out) == {torch.bfloat16}
    assert _labels(out) == ("bfloat16", "bfloat16")
    # From scratch (no model.hf_path) the same checkpoint exports as today: as saved, fp32.
    scratch = export_from_checkpoint(step, trained.config, tmp_path / "scratch")
    assert _stored(scratch) == {torch.float32} and _labels(scratch) == ("float32", "float32")
    ratio = (out / "model.safetensors").stat().st_size / (scratch / "model.safetensors").stat().st_size
    assert 0.49 < ratio < 0.51, ratio
    # The readers: load_hf (quantize, smoke, QAT) and evaluate's harness cast the bf16 values up to fp32 unchanged.
    _assert_holds(load_hf(out), trained, torch.bfloat16)
    _assert_holds(full_precision(out, "fp32", "cpu"), trained, torch.bfloat16)
    _assert_holds(load_hf(scratch), trained, torch.float32)


@pytest.mark.parametrize("mixed", [False, True])
def test_an_fp32_checkpoint_fine_tuned_here_stays_fp32(tmp_path, mixed):
    """fp32 in, fp32 out as before; a checkpoint storing only some weights in bf16 keeps fp32 (nothing rounded)."""
    from safetensors.torch import load_file, save_file

    from tasks.model.hf_export import export_from_checkpoint
    from tasks.model.hf_io import load_hf

    hf, step, trained = _trained_checkpoint(tmp_path, torch.float32)
    if mixed:
        weights = load_file(hf / "model.safetensors")
        weights = {k: v.bfloat16() if "mlp" in k else v for k, v in weights.items()}
        save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    out = export_from_checkpoint(step, trained.config, tmp_path / "export", hf_path=hf)
    assert _stored(out) == {torch.float32} and _labels(out) == ("float32", "float32")
    _assert_holds(load_hf(out), trained, torch.float32)
