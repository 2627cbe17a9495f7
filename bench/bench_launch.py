"""Starting CPU ranks: the forking agent (tasks/launch/agent.py, what train and profile use on CPU) against
torch.distributed.run exec'ing each rank, in the same run. The job is RANKS gloo ranks (2) that each do what a training
rank does before its first step, in miniature: the process group, an FSDP2-sharded layer, one forward and backward,
and a DCP save. Each variant's median user + sys CPU (the launcher and its ranks, all reaped) over RUNS jobs; the
ratio is forked over exec'd (< 1: cheaper)."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.child_cpu import child_cpu_s, interleaved_medians
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


# The agent's imports for the env stage's collective probe (tasks.launch.agent.preloads): the trainer's set (what every
# launch imported before) against the probe's own (torch, torch.distributed, the probe), each in a fresh interpreter.
PROBE_ENTRY = ["tasks.envcheck.probe_worker", "--kind", "cpu"]
PRELOAD = {
    "trainer_set": "import tasks.launch.agent as agent; agent.preload()",
    "probe_set": f"import tasks.launch.agent as agent; agent.preload(*agent.preloads({PROBE_ENTRY!r}))",
}


def probe_preload() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    got = interleaved_medians({name: ([sys.executable, "-c", code], env) for name, code in PRELOAD.items()}, RUNS)
    t, p = got["trainer_set"], got["probe_set"]
    return {
        "launch.probe_agent_imports_cpu_s_trainer_set": round(t, 3),
        "launch.probe_agent_imports_cpu_s_probe_set": round(p, 3),
        "launch.probe_agent_imports_cpu_ratio_probe_vs_trainer_set": round(p / t, 3),
    }


def _cpu(launcher: list[str], script: Path, out: Path) -> float:
    argv = [sys.executable, *launcher, "--standalone", "--nproc-per-node", str(RANKS), "--max-restarts", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return child_cpu_s([*argv, str(script), str(out)], env)


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
    } | probe_preload()


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
