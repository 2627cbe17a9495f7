"""Collective probe figures: all_reduce bus bandwidth of 2 gloo ranks (the env stage's torchrun probe), as a ratio
to the baseline of a single-process copy of the same buffer (what memory bandwidth allows on this host)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

SIZES_MB = [4.0, 64.0]


def _copy_gbps(size_mb: float, iters: int = 15) -> float:
    """One thread, like each torchrun rank (OMP_NUM_THREADS=1); the median, as a busy host distorts a mean."""
    import statistics

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(int(size_mb * 2**20) // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up: page faults
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return src.numel() * 4 / statistics.median(times) / 1e9


def run() -> dict:
    from tasks.envcheck import probe

    with tempfile.TemporaryDirectory() as tmp:
        result = probe.run("cpu", 2, SIZES_MB, Path(tmp) / "probe.json")
    if "error" in result:
        raise RuntimeError(result["error"])
    figures = {"env.allreduce_ok": result["allreduce_ok"]}
    for s in result["sizes"]:
        key = f"{s['size_mb']:g}mb"
        copy = _copy_gbps(s["size_mb"])
        figures[f"env.allreduce_busbw_gbps.{key}"] = round(s["busbw_gbps"], 3)
        figures[f"env.copy_gbps.{key}"] = round(copy, 3)
        figures[f"env.allreduce_busbw_ratio_vs_copy.{key}"] = round(s["busbw_gbps"] / copy, 4)
    return figures
