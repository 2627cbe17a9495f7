"""Checkpoint stall: how long a checkpoint holds training up, synchronous save vs asynchronous (train.async_checkpoint).

The train stage's own torchrun launch (demo model, dp2 FSDP, bf16, the demo preset's layout), a checkpoint every 2 of
10 steps, run with synchronous and asynchronous saves alternately (REPEATS each, interleaved). The trainer records
what each checkpoint cost the training loop (summary.json `checkpoint_stall_s`, rank 0: the whole save when
synchronous; the staging copy plus any wait for the previous save when asynchronous).

- `checkpoint.sync_save_s`, `checkpoint.async_stall_s`: medians per checkpoint;
- `checkpoint.async_stall_ratio`: async stall / sync save, the median over the pairs of runs (goal ≤ 0.2);
- `checkpoint.async_step_slowdown`: in the asynchronous runs, the median time of the steps right after a checkpoint
  (when the background thread writes and hashes) over that of the other steps — what the background work costs the
  steps it overlaps on a host whose cores the ranks already use;
- `checkpoint.size_mb`: one checkpoint's files.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEPS, EVERY, REPEATS = 10, 2, 2
SETS = {
    "model.preset": "demo",
    "data.seq_len": 128,
    "data.loader_workers": 0,
    "train.steps": STEPS,
    "train.global_batch": 8,
    "train.micro_batch": 4,
    "train.checkpoint_every": EVERY,
    "train.keep_checkpoints": 2,
    "parallel.dp": 2,
    "parallel.tp": 1,
    "parallel.pp": 1,
    "hardware.device": "cpu",
    "hardware.nproc_per_node": 2,
}


def _run(tmp: Path, shards: Path, name: str, async_: bool) -> dict:
    from tasks.config import apply_overrides, load_config
    from tasks.parallel.metrics import read_metrics
    from tasks.runner import StageContext
    from tasks.stages import train

    cfg = load_config("demo-cpu")
    cfg.tracking.enabled = False
    apply_overrides(cfg, {**SETS, "train.async_checkpoint": async_})
    run_dir = tmp / name
    ns = argparse.Namespace(shard_dir=str(shards), fresh=True, no_export=True)
    train.run(cfg, StageContext(run_dir=run_dir, stage="train", args=ns))
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    steps = {r["step"]: r["step_time_s"] for r in read_metrics(run_dir / "metrics.jsonl")}
    last = Path(summary["checkpoint"])
    return {
        "stalls": summary["checkpoint_stall_s"],
        "after": [steps[s + 1] for s in range(EVERY, STEPS, EVERY) if s + 1 in steps],
        "other": [t for s, t in steps.items() if s > 2 and (s - 1) % EVERY],
        "bytes": sum(p.stat().st_size for p in last.rglob("*") if p.is_file()),
    }


def run() -> dict:
    from data_prep.testing import tiny_shard_set

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tiny_shard_set(tmp / "data", seq_len=128, vocab_size=2048, n_docs=60)
        runs = []
        for r in range(REPEATS):  # sync, async, async, sync, …: neither always first
            order = (False, True) if r % 2 == 0 else (True, False)
            pair = {a: _run(tmp, shards, f"r{r}-{'async' if a else 'sync'}", a) for a in order}
            runs.append(pair)
    sync = [s for p in runs for s in p[False]["stalls"]]
    async_ = [s for p in runs for s in p[True]["stalls"]]
    ratios = [statistics.median(p[True]["stalls"]) / statistics.median(p[False]["stalls"]) for p in runs]
    after = [t for p in runs for t in p[True]["after"]]
    other = [t for p in runs for t in p[True]["other"]]
    return {
        "checkpoint.sync_save_s": round(statistics.median(sync), 4),
        "checkpoint.async_stall_s": round(statistics.median(async_), 4),
        "checkpoint.async_stall_ratio": round(statistics.median(ratios), 3),
        "checkpoint.async_step_slowdown": round(statistics.median(after) / statistics.median(other), 3),
        "checkpoint.size_mb": round(runs[0][False]["bytes"] / 1e6, 1),
    }


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key} = {value}")
