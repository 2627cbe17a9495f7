"""FP16 training with dynamic loss scaling (issue 24 item 4; tasks/train/loss_scale.py), on 2 gloo ranks under CPU
autocast: the curve follows FP32 on ZeRO-1 and ZeRO-3; an overflow on one rank only makes every rank skip the step,
the scale halves, the skip is counted, and the scaler's state is in the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.parallel.checkpoint import read_meta
from tests.helpers.train_fixture import configure, losses, metrics, shards, torchrun, write_spec  # noqa: F401

DP2 = {"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1, "hardware.nproc_per_node": 2}


@pytest.mark.slow
def test_fp16_follows_fp32_on_zero1_and_zero3(cfg, tmp_path, shards):
    runs = {
        "fp32": configure(cfg, **DP2, **{"parallel.zero": 1}),
        "fp16-zero1": configure(cfg, **DP2, **{"parallel.zero": 1, "train.precision": "fp16"}),
        "fp16-zero3": configure(cfg, **DP2, **{"parallel.zero": 3, "train.precision": "fp16"}),
    }
    specs = [write_spec(c, tmp_path / name, shards) for name, c in runs.items()]
    rc, out = torchrun(runs["fp32"], 2, specs, tmp_path / "torchrun.log")
    assert rc == 0, out[-3000:]
    want = losses(tmp_path / "fp32")
    for name in ("fp16-zero1", "fp16-zero3"):
        got, rows = losses(tmp_path / name), metrics(tmp_path / name)
        assert sorted(got) == sorted(want)
        for step in want:  # FP16 keeps 11 significant bits: the curves agree to well under 1 %
            assert got[step] == pytest.approx(want[step], rel=5e-3), (name, step, got[step], want[step])
        assert all(r["loss_scale"] == 2.0**16 and r["skipped_steps"] == 0 for r in rows.values()), rows
    assert "loss_scale" not in metrics(tmp_path / "fp32")[1]


@pytest.mark.slow
def test_an_overflow_on_one_rank_is_skipped_by_all_counted_and_checkpointed(cfg, tmp_path, shards):
    c = configure(cfg, **DP2, **{"parallel.zero": 1, "train.precision": "fp16", "train.timeout_s": 120})
    spec = write_spec(c, tmp_path, shards)
    spec = spec.rename(spec.with_name("launch-5.json"))  # the next spec of the same run dir writes launch.json
    # In the same launch, after the 5 steps: a resume from their last checkpoint to step 6 (the fault is at step 3).
    more = configure(cfg, **DP2, **{"parallel.zero": 1, "train.precision": "fp16", "train.steps": 6})
    resume = write_spec(more, tmp_path, shards, resume_from=str(tmp_path / "checkpoints" / "step-5"))
    rc, out = torchrun(c, 2, [spec, resume], tmp_path / "torchrun.log", {"LLM_PIPELINE_FAULT": "1:3:overflow"})
    assert rc == 0, out[-3000:]
    rows = metrics(tmp_path)  # rank 0's record: its own gradients were finite at step 3
    assert [rows[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert [rows[s]["loss_scale"] for s in range(1, 6)] == [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15]
    assert rows[3]["overflow"] is True and rows[3]["grad_norm"] is None and rows[4]["overflow"] is False
    # rank 0 skipped and counted it although its own gradients were finite; the checkpoint carries the scaler's state
    meta = read_meta(tmp_path / "checkpoints" / "step-5")
    assert meta["loss_scaler"]["scale"] == 2.0**15 and meta["loss_scaler"]["skipped_steps"] == 1
    # a resume takes the scale up where the checkpoint left it (a fresh scaler would start at 2^16 again)
    assert (metrics(tmp_path)[6]["loss_scale"], metrics(tmp_path)[6]["skipped_steps"]) == (2.0**15, 1)
    assert json.loads((tmp_path / "train" / "summary.json").read_text())["start_step"] == 5


@pytest.mark.slow
def test_fp16_under_pp_and_tp_follows_fp32_and_skips_an_overflow_on_every_rank(cfg, tmp_path, shards):
    """pp2 (1F1B: the last stage's loss function returns the scaled loss) and tp2 (each rank unscales its own
    shards), on 2 gloo ranks: rank 1 alone overflows at step 4 (`1:4:overflow`). Up to it the FP16 curve follows the
    single-process FP32 reference (which every fp32 layout reproduces, tests/test_parallel.py); rank 0's record
    shows the skip, the halved scale and the count; no rank's parameters moved at step 4 (checkpoints step-3 and
    step-4 hold the same tensors: both ranks' shards or stages), and step 5 updates again."""
    from tests.helpers.train_fixture import checkpoint_params, reference_losses

    fp16 = {"train.precision": "fp16", "train.checkpoint_every": 1, "train.keep_checkpoints": 5}
    layouts = {"pp2": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}, "tp2": {"parallel.tp": 2}}
    runs = {name: configure(cfg, **{**DP2, "parallel.dp": 1, **fp16, **extra}) for name, extra in layouts.items()}
    specs = [write_spec(c, tmp_path / name, shards) for name, c in runs.items()]
    rc, out = torchrun(runs["pp2"], 2, specs, tmp_path / "torchrun.log", {"LLM_PIPELINE_FAULT": "1:4:overflow"})
    assert rc == 0, out[-3000:]
    want = reference_losses(runs["pp2"], shards, 4)
    for name in runs:
        rows = metrics(tmp_path / name)
        for step in range(1, 5):  # step 4's loss is computed before its gradients overflow
            assert rows[step]["loss"] == pytest.approx(want[step], rel=5e-3), (name, step, rows[step], want[step])
        assert [rows[s]["loss_scale"] for s in range(1, 6)] == [2.0**16] * 3 + [2.0**15] * 2, (name, rows)
        assert [rows[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 0, 1, 1], (name, rows)
        assert [rows[s]["overflow"] for s in range(1, 6)] == [False, False, False, True, False], (name, rows)
        ckpts = {s: checkpoint_params(tmp_path / name / "checkpoints" / f"step-{s}") for s in (2, 3, 4, 5)}

        def moved(a: int, b: int) -> set:
            return {k for k in ckpts[a] if not torch.equal(ckpts[a][k], ckpts[b][k])}

        assert moved(3, 4) == set(), (name, sorted(moved(3, 4)))  # every rank skipped step 4
        assert moved(4, 5) == moved(2, 3) and len(moved(2, 3)) > 4, name  # and every rank updated at step 5
        assert read_meta(tmp_path / name / "checkpoints" / "step-5")["loss_scaler"]["skipped_steps"] == 1
