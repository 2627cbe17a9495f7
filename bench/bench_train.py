"""Training throughput on CPU: the stage's own torchrun launch with 1 rank (dp1, the baseline) vs 2 ranks (dp2,
FSDP) on the demo model, same global batch and steps; tokens/s from metrics.jsonl (median, warm-up excluded).
One OpenMP thread per rank in both runs (torchrun's default), so the ratio is the data-parallel scaling from one
core to two; informative only (a busy shared host distorts it; with more threads than free cores, OpenMP's
spin-waiting makes a single rank many times slower)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEPS, WARMUP = 10, 3
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


def _tokens_per_s(tmp: Path, shards: Path, dp: int) -> float:
    from tasks.stages import train
    from tasks.config import apply_overrides, load_config
    from tasks.parallel.metrics import read_metrics
    from tasks.runner import StageContext

    cfg = load_config("demo-cpu")
    cfg.tracking.enabled = False
    apply_overrides(cfg, {**SETS, "parallel.dp": dp, "hardware.nproc_per_node": dp})
    run_dir = tmp / f"dp{dp}"
    train.run(
        cfg,
        StageContext(
            run_dir=run_dir, stage="train", args=argparse.Namespace(shard_dir=str(shards), fresh=True, no_export=True)
        ),
    )
    records = read_metrics(run_dir / "metrics.jsonl")[WARMUP:]
    return statistics.median(r["tokens_per_s"] for r in records)


def run() -> dict:
    from data_prep.testing import tiny_shard_set

    os.environ["OMP_NUM_THREADS"] = "1"  # explicit: the same for both launches whatever the caller's setting
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tiny_shard_set(tmp / "data", seq_len=128, vocab_size=2048, n_docs=60)
        dp1 = _tokens_per_s(tmp, shards, 1)
        dp2 = _tokens_per_s(tmp, shards, 2)
    return {
        "train.tokens_per_s_dp1": round(dp1, 1),
        "train.tokens_per_s_dp2": round(dp2, 1),
        "train.dp2_speedup_ratio": round(dp2 / dp1, 3),
    }


if __name__ == "__main__":
    print(run())
