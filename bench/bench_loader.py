"""Data-wait share of a training-like loop, before and after sizing the loader from the rank's cores.

Each step takes the next batch from ShardLoader (the wait is measured) and then does a fixed amount of compute on it
(matmuls standing in for forward/backward). Figures, measured side by side in this run:
- loader.data_wait_share.{before,after,after_prefetch4}: wait / step time with num_workers=0 (loading inline:
  what a rank gets with no worker processes), with `data.loader_workers=-1` (workers = the rank's cores − 1,
  tasks/parallel/affinity.py) and prefetch_factor 2, and with prefetch_factor 4.
- loader.after_over_before: the after share over the before share (< 1 = less time waiting for data).
On a host with one core per rank the sized loader has 0 workers and the figures coincide: that is the finding.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

STEPS, BATCH, SEQ = 40, 16, 256


def _loop(shard_dir: Path, workers: int, prefetch: int | None) -> float:
    import torch

    from data_prep.loader import ShardLoader

    torch.manual_seed(0)
    w = torch.randn(256, 256)
    loader = ShardLoader(shard_dir, batch_size=BATCH, num_workers=workers, seed=0, prefetch_factor=prefetch)
    it = loader.batches()
    next(it)  # worker start-up is not part of the steady state
    wait = total = 0.0
    for _ in range(STEPS):
        t0 = time.perf_counter()
        x, _ = next(it)
        t1 = time.perf_counter()
        h = x[:, :256].float() @ w
        for _ in range(6):
            h = torch.tanh(h @ w)
        t2 = time.perf_counter()
        wait, total = wait + (t1 - t0), total + (t2 - t0)
    return wait / total


def run() -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from data_prep.testing import tiny_shard_set
    from tasks.config import load_config
    from tasks.parallel.affinity import loader_workers

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    auto = loader_workers(load_config("ci-tiny", sets=["data.loader_workers=-1"]), cores)
    with tempfile.TemporaryDirectory() as tmp:
        shards = tiny_shard_set(Path(tmp) / "s", seq_len=SEQ, vocab_size=1024, n_docs=200, shard_multiple=4)
        before = _loop(shards, 0, None)
        after = _loop(shards, auto, 2 if auto else None)
        after4 = _loop(shards, auto, 4 if auto else None)
    return {
        "loader.data_wait_share": {
            "before": round(before, 4),
            "after": round(after, 4),
            "after_prefetch4": round(after4, 4),
            "cores_per_rank": cores,
            "workers_after": auto,
        },
        "loader.after_over_before": round(after / before, 3) if before else None,
    }
