"""Training throughput on CPU: the stage's own torchrun launch with 1 rank (dp1, the baseline) vs 2 ranks (dp2) on the
demo model, same global batch and steps; tokens/s from metrics.jsonl (median, warm-up excluded). One OpenMP thread per
rank in both runs (torchrun's default) and the loader in the rank (no loader workers), so the ratio is the
data-parallel scaling from one core to two. dp1 and dp2 launches alternate (REPEATS pairs, order swapped every
pair); the ratio is the median of the pairs' ratios.

- `train.dp2_speedup_ratio`: ZeRO-1 (replicated parameters, sharded AdamW state; gradient buckets all-reduced from
  backward hooks, the owners' parameters broadcast in buckets: tasks/parallel/dp.py). Goal ≥ 1.5.
- `train.dp2_zero3_speedup_ratio`: the same with FSDP2 (ZeRO-3, the demo preset's default): per-layer all-gathers and
  reduce-scatters of a small model over gloo.
- `train.planner_step_s_dp2` / `train.measured_step_s_dp2` / `train.planner_over_measured_dp2`: the planner's step
  time for the dp2 ZeRO-1 run (tasks.planner.search.step_time with plan.efficiency) against the measured median
  step, the planner given this host's peak as measured in the same run, right before and after each dp2 launch
  (`train.cpu_matmul_peak_gflops`: a 1024² fp32 matmul on one thread, what a rank has; a loaded host slows both
  alike). Goal within 25 %. `train.planner_preset_over_measured_dp2`: the same with the cpu-laptop preset's peak.
Informative only on a busy shared host (its load is in the provenance)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEPS, WARMUP, REPEATS = 12, 3, 2
SETS = {
    "model.preset": "demo",
    "data.seq_len": 128,
    "data.loader_workers": 0,
    "train.steps": STEPS,
    "train.global_batch": 8,
    "train.micro_batch": 4,
    "train.precision": "fp32",
    "train.checkpoint_every": 0,
    "parallel.tp": 1,
    "parallel.pp": 1,
    "hardware.device": "cpu",
}


def _step_s(tmp: Path, shards: Path, dp: int, zero: int, name: str) -> float:
    """Median seconds per step (warm-up excluded) of one launch."""
    from tasks.config import apply_overrides, load_config
    from tasks.parallel.metrics import read_metrics
    from tasks.runner import StageContext
    from tasks.stages import train

    cfg = load_config("demo-cpu")
    cfg.tracking.enabled = False
    apply_overrides(cfg, {**SETS, "parallel.dp": dp, "parallel.zero": zero, "hardware.nproc_per_node": dp})
    run_dir = tmp / name
    train.run(
        cfg,
        StageContext(
            run_dir=run_dir, stage="train", args=argparse.Namespace(shard_dir=str(shards), fresh=True, no_export=True)
        ),
    )
    records = read_metrics(run_dir / "metrics.jsonl")[WARMUP:]
    return statistics.median(r["step_time_s"] for r in records)


def matmul_peak_flops(n: int = 1024, reps: int = 4) -> float:
    """Best wall-clock FLOP/s of an n×n fp32 matmul on one thread (a training rank's)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / best


def _speedup(tmp: Path, shards: Path, zero: int, repeats: int, peaks: list) -> tuple[float, float]:
    """(median of dp1/dp2 step-time ratios over alternating pairs, median dp2 step seconds); the matmul peak measured
    before and after each dp2 launch goes to `peaks`."""
    ratios, dp2s = [], []
    for r in range(repeats):
        order = (1, 2) if r % 2 == 0 else (2, 1)
        step = {}
        for dp in order:
            if dp == 2:
                peaks.append(matmul_peak_flops())
            step[dp] = _step_s(tmp, shards, dp, zero, f"z{zero}-r{r}-dp{dp}")
            if dp == 2:
                peaks.append(matmul_peak_flops())
        ratios.append(step[1] / step[2])
        dp2s.append(step[2])
    return statistics.median(ratios), statistics.median(dp2s)


def planner_step_s(zero: int, peak_flops: float = 0.0) -> float:
    """The planner's step for the dp2 run; `peak_flops` (> 0) replaces the cluster preset's peak."""
    from tasks.config import apply_overrides, load_config
    from tasks.model import get_preset
    from tasks.layout import Layout
    from tasks.planner.cluster import get_cluster
    from tasks.planner.search import Problem, step_time

    cfg = load_config("demo-cpu")
    apply_overrides(cfg, SETS)
    tcfg = get_preset("demo")
    pb = Problem(
        get_cluster(cfg.hardware.cluster, peak_tflops=peak_flops / 1e12),
        tcfg,
        cfg.data.seq_len,
        cfg.train.global_batch,
        precision=cfg.train.precision,
        efficiency=cfg.plan.efficiency,
    )
    lay = Layout(dp=2, zero=zero, micro_batch=cfg.train.micro_batch, global_batch=cfg.train.global_batch)
    return step_time(pb, lay)["step_s"]


def run() -> dict:
    from data_prep.testing import tiny_shard_set

    os.environ["OMP_NUM_THREADS"] = "1"  # explicit: the same for every launch whatever the caller's setting
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tiny_shard_set(tmp / "data", seq_len=128, vocab_size=2048, n_docs=60)
        peaks: list[float] = []
        zero1, dp2_step = _speedup(tmp, shards, 1, REPEATS, peaks)
        zero3, _ = _speedup(tmp, shards, 3, 1, [])
    peak = statistics.median(peaks)
    planned = planner_step_s(1, peak)
    return {
        "train.dp2_speedup_ratio": round(zero1, 3),
        "train.dp2_zero3_speedup_ratio": round(zero3, 3),
        "train.cpu_matmul_peak_gflops": round(peak / 1e9, 1),
        "train.planner_step_s_dp2": round(planned, 4),
        "train.measured_step_s_dp2": round(dp2_step, 4),
        "train.planner_over_measured_dp2": round(planned / dp2_step, 3),
        "train.planner_preset_over_measured_dp2": round(planner_step_s(1) / dp2_step, 3),
    }


if __name__ == "__main__":
    print(run())
