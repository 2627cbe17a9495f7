"""FP16 training with dynamic loss scaling (issue 24 item 4; tasks/train/loss_scale.py), on 2 gloo ranks under CPU
autocast: the curve follows FP32 on ZeRO-1 and ZeRO-3; an overflow on one rank only makes every rank skip the step,
the scale halves, the skip is counted, and the scaler's state is in the checkpoint."""

from __future__ import annotations

import json

import pytest

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
    c = configure(
        cfg,
        **DP2,
        **{"parallel.zero": 1, "train.precision": "fp16", "train.checkpoint_every": 1, "train.timeout_s": 120},
    )
    spec = write_spec(c, tmp_path, shards)
    rc, out = torchrun(c, 2, [spec], tmp_path / "torchrun.log", {"LLM_PIPELINE_FAULT": "1:3:overflow"})
    assert rc == 0, out[-3000:]
    rows = metrics(tmp_path)  # rank 0's record: its own gradients were finite at step 3
    assert [rows[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert [rows[s]["loss_scale"] for s in range(1, 6)] == [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15]
    assert rows[3]["overflow"] is True and rows[3]["grad_norm"] is None and rows[4]["overflow"] is False
    # rank 0 skipped and counted it although its own gradients were finite; the checkpoint carries the scaler's state
    meta = read_meta(tmp_path / "checkpoints" / "step-5")
    assert meta["loss_scaler"]["scale"] == 2.0**15 and meta["loss_scaler"]["skipped_steps"] == 1
    # a resume takes the scale up where the checkpoint left it (a fresh scaler would start at 2^16 again)
    more = configure(cfg, **DP2, **{"parallel.zero": 1, "train.precision": "fp16", "train.steps": 6})
    rc, out = torchrun(more, 2, [write_spec(more, tmp_path, shards)], tmp_path / "torchrun2.log")
    assert rc == 0, out[-3000:]
    assert (metrics(tmp_path)[6]["loss_scale"], metrics(tmp_path)[6]["skipped_steps"]) == (2.0**15, 1)
    assert json.loads((tmp_path / "train" / "summary.json").read_text())["start_step"] == 5
