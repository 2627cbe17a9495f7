"""Starting CPU ranks: the forking agent (tasks/launch/agent.py, what train and profile use on CPU) against
torch.distributed.run exec'ing each rank, in the same run. The job is RANKS gloo ranks (2) that each do what a training
rank does before its first step, in miniature: the process group, an FSDP2-sharded layer, one forward and backward,
and a DCP save. Each variant's median user + sys CPU (the launcher and its ranks, all reaped) over RUNS jobs; the
ratio is forked over exec'd (< 1: cheaper)."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tasks.launch.torchrun import launcher

ROOT = Path(__file__).resolve().parent.parent
RUNS = 3
RANKS = 2  # the CPU default (dp 2): more ranks than cores would load the host by themselves
RANK = """
import os, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
layer = fully_shard(torch.nn.Linear(256, 256))
layer(torch.randn(8, 256)).sum().backward()
dcp.save({"layer": layer.state_dict()}, checkpoint_id=os.path.join(sys.argv[1], "ckpt"))
dist.destroy_process_group()
"""


def _cpu(launcher: list[str], script: Path, out: Path) -> float:
    argv = [sys.executable, *launcher, "--standalone", "--nproc-per-node", str(RANKS), "--max-restarts", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([*argv, str(script), str(out)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run() -> dict:
    exec_, fork = [], []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK)
        for i in range(RUNS):  # interleaved: a change in the host's load falls on both
            exec_.append(_cpu(["-m", "torch.distributed.run"], script, Path(tmp) / f"exec{i}"))
            fork.append(_cpu(launcher("cpu"), script, Path(tmp) / f"fork{i}"))
    e, f = statistics.median(exec_), statistics.median(fork)
    return {
        "launch.cpu_s_2_gloo_ranks_exec": round(e, 2),
        "launch.cpu_s_2_gloo_ranks_forked": round(f, 2),
        "launch.cpu_ratio_forked_vs_exec": round(f / e, 3),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
