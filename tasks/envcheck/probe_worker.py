"""torchrun worker of the collective probe: all_reduce correctness, then bus bandwidth per message size.

Run by tasks.envcheck.probe (one rank per device, 2 on CPU); rank 0 writes the result JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

from tasks import collectives
from tasks import device as devlayer
from tasks.fsutil import atomic_write_json
from tasks.parallel.affinity import FORKED

CHECK_ELEMS = 4096
CYCLE = 16  # element i of rank r is (i + r) % CYCLE


def contribution(rank: int, n: int = CHECK_ELEMS, dev=None):
    """What rank `rank` puts into the correctness all_reduce: small integers in float32. Every partial sum of W
    ranks is an integer below 15·W, so it is exact in fp32 (24-bit mantissa) for any world below 2^24 / 15 ≈ 1.1
    million ranks, whatever order the backend adds in — the result can be compared exactly. ((rank+1)·arange(4096)
    summed over 91+ ranks passes 2^24 and rounds.) A missing or doubled rank changes 15 of every 16 elements."""
    return ((torch.arange(n, device=dev) + rank) % CYCLE).to(torch.float32)


def expected(world: int, n: int = CHECK_ELEMS, dev=None):
    """The exact all_reduce SUM of every rank's contribution (computed in int64, then float32: exact below 2^24)."""
    i = torch.arange(n, dtype=torch.int64, device=dev)
    full, rest = divmod(world, CYCLE)  # each full cycle of ranks adds 0 + 1 + … + 15 to every element
    total = torch.full((n,), full * (CYCLE - 1) * CYCLE // 2, dtype=torch.int64, device=dev)
    for r in range(rest):
        total += (i + full * CYCLE + r) % CYCLE
    return total.to(torch.float32)


def _correctness(dev, world: int, rank: int) -> dict:
    """all_reduce of contribution(rank) must equal expected(world) exactly, on every rank (then a MAX of the error)."""
    t = contribution(rank, dev=dev)
    collectives.all_reduce(t)
    err = (t - expected(world, dev=dev)).abs().max()
    collectives.all_reduce(err, op=dist.ReduceOp.MAX)  # every rank must be right, not only rank 0
    return {"allreduce_ok": bool(err.item() == 0.0), "allreduce_max_error": float(err.item())}


def _bandwidth(dev, world: int, size_mb: float, iters: int) -> dict:
    """Bus bandwidth as nccl-tests defines it: algbw·2(n-1)/n, from the slowest rank's mean time."""
    numel = max(1, int(size_mb * 2**20) // 4)
    t = torch.ones(numel, dtype=torch.float32, device=dev)
    for _ in range(2):  # warm-up: connection set-up and allocator
        collectives.all_reduce(t)
    devlayer.synchronize(dev)
    collectives.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        collectives.all_reduce(t)
    devlayer.synchronize(dev)
    # float32: HCCL on A2 (910B) rejects float64 all_reduce; µs resolution is plenty for a mean step time.
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float32, device=dev)
    collectives.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    seconds = float(elapsed.item())
    algbw = numel * 4 / seconds / 1e9
    return {"size_mb": size_mb, "seconds": seconds, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", required=True, choices=sorted(devlayer.DIST_BACKEND))
    p.add_argument("--sizes-mb", type=float, nargs="*", default=[])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout-s", type=int, default=120)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = devlayer.torch_device(args.kind, int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(devlayer.dist_backend(args.kind), timeout=datetime.timedelta(seconds=args.timeout_s))
    result = {
        "world_size": world,
        "backend": dist.get_backend(),
        "ranks_forked": bool(os.environ.get(FORKED)),  # started as training's CPU ranks are (tasks/launch/agent.py)
        **_correctness(dev, world, rank),
        "sizes": [_bandwidth(dev, world, s, args.iters) for s in args.sizes_mb],
    }
    if rank == 0:
        atomic_write_json(args.out, result)
    collectives.barrier()
    dist.destroy_process_group()
    # A rare SIGABRT at interpreter exit after destroy_process_group fails torchrun; the work is done and saved.
    os._exit(0)


if __name__ == "__main__":
    main()
