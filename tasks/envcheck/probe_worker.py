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

from tasks import device as devlayer
from tasks.fsutil import atomic_write_json

# What HCCL's all_reduce accepts (Ascend/pytorch ProcessGroupHCCL.cpp, checkSupportedDataTypeOfAllReduce): no fp64,
# no uint8/bool — "HCCL AllReduce & Reduce: Unsupported data type" otherwise. The probe only uses these, on every
# backend, so what passes on gloo/NCCL also passes on HCCL.
HCCL_ALLREDUCE_DTYPES = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16}
)


def _correctness(dev, world: int, rank: int) -> dict:
    """Each rank contributes (rank+1)·arange(n): the sum must be exactly arange(n)·world(world+1)/2 everywhere."""
    n = 4096
    t = torch.arange(n, dtype=torch.float32, device=dev) * (rank + 1)
    dist.all_reduce(t)
    expected = torch.arange(n, dtype=torch.float32, device=dev) * (world * (world + 1) / 2)
    err = (t - expected).abs().max()
    dist.all_reduce(err, op=dist.ReduceOp.MAX)  # every rank must be right, not only rank 0
    return {"allreduce_ok": bool(err.item() == 0.0), "allreduce_max_error": float(err.item())}


def _bandwidth(dev, world: int, size_mb: float, iters: int) -> dict:
    """Bus bandwidth as nccl-tests defines it: algbw·2(n-1)/n, from the slowest rank's mean time."""
    numel = max(1, int(size_mb * 2**20) // 4)
    t = torch.ones(numel, dtype=torch.float32, device=dev)
    for _ in range(2):  # warm-up: connection set-up and allocator
        dist.all_reduce(t)
    devlayer.synchronize(dev)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    devlayer.synchronize(dev)
    # float32: HCCL on A2 (910B) rejects float64 all_reduce; µs resolution is plenty for a mean step time.
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float32, device=dev)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
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
    dist.init_process_group(devlayer.DIST_BACKEND[args.kind], timeout=datetime.timedelta(seconds=args.timeout_s))
    result = {
        "world_size": world,
        "backend": dist.get_backend(),
        **_correctness(dev, world, rank),
        "sizes": [_bandwidth(dev, world, s, args.iters) for s in args.sizes_mb],
    }
    if rank == 0:
        atomic_write_json(args.out, result)
    dist.barrier()
    dist.destroy_process_group()
    # A rare SIGABRT at interpreter exit after destroy_process_group fails torchrun; the work is done and saved.
    os._exit(0)


if __name__ == "__main__":
    main()
