"""A small real 2-rank gloo job profiled with tasks.profiling.collect.make_profiler (started by torchrun in
tests/test_profiling_gloo.py): each step loads a batch through a torch DataLoader, runs matmuls and all-reduces
the result, like a data-parallel step. Usage: torchrun --nproc-per-node 2 tests/profiling_gloo_worker.py OUT_DIR"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from tasks.config import ProfileConfig
    from tasks.profiling.collect import make_profiler

    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pcfg = ProfileConfig(skip_first=1, wait=0, warmup=1, active=2, profile_memory=True)
    torch.manual_seed(rank)
    loader = iter(DataLoader(TensorDataset(torch.randn(64, 128, 128)), batch_size=4))
    weight = torch.randn(128, 128)
    with make_profiler(pcfg, "cpu", out_dir, rank) as prof:
        for _ in range(pcfg.steps_needed()):
            (x,) = next(loader)
            y = torch.relu(x @ weight) @ weight.T
            grad = torch.full((1 << 20,), float(y.mean()))  # a 4 MB gradient bucket
            dist.all_reduce(grad)
            prof.step()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skips a rare SIGABRT in interpreter teardown after gloo shutdown (it would fail torchrun)


if __name__ == "__main__":
    main()
