"""Host binding inside a rank: torchrun's entry point applies this rank's cores, then runs the worker; the rank's
data loader is sized from the cores it was given.

The launcher computes the plan (tasks/launch/binding.py) and hands it over in $LLM_PIPELINE_CPU_BINDING (JSON, one
entry per local rank); torchrun starts `python -m tasks.parallel.affinity --worker MODULE <worker args>` per rank.
The rank binds itself with `numactl --physcpubind=… --localalloc` when numactl is on PATH (exec, same PID), else the
taskset equivalent os.sched_setaffinity; then the worker module runs. A rank forked by tasks/launch/agent.py always
uses sched_setaffinity (an exec would throw the fork away; Linux's default memory policy allocates on the local node
as --localalloc does). Nothing here imports torch or another project
module: it runs before the worker in every rank.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys

ENV = "LLM_PIPELINE_CPU_BINDING"  # the plan this entry point applies (one entry per local rank)
FORKED = "LLM_PIPELINE_FORKED_RANK"  # set by tasks/launch/agent.py in each rank it forks


def apply(entry: dict, argv: list[str], worker: str) -> None:
    """Bind this process (numactl exec when available, else sched_setaffinity) and run the worker."""
    if os.environ.get("LLM_PIPELINE_BOUND"):  # already under numactl (this module exec'd itself)
        return
    cpus = entry.get("cpus") or []
    print(
        f"[binding] local rank {entry.get('local_rank')} → CPUs {entry.get('cpulist')} ({entry.get('source')})",
        file=sys.stderr,
        flush=True,
    )
    numactl = None if os.environ.get(FORKED) else shutil.which("numactl")
    if cpus and numactl:
        os.environ["LLM_PIPELINE_BOUND"] = "1"
        os.execv(
            numactl,
            [
                numactl,
                f"--physcpubind={entry['cpulist']}",
                "--localalloc",
                sys.executable,
                "-m",
                __name__,
                "--worker",
                worker,
                *argv,
            ],
        )
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point: `--worker MODULE [args]`: bind this rank per $LLM_PIPELINE_CPU_BINDING, then run the
    worker module with args."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["--worker"] or len(argv) < 2:
        raise SystemExit(f"{__name__}: expected --worker MODULE [worker args], got {argv[:3]}")
    worker, argv = argv[1], argv[2:]
    raw = os.environ.get(ENV)
    if raw:
        entries = json.loads(raw)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local < len(entries):
            apply(entries[local], argv, worker)
    sys.argv = [worker, *argv]
    runpy.run_module(worker, run_name="__main__", alter_sys=True)


def loader_options(cfg, device) -> dict:
    """ShardLoader keywords for this rank: workers from its cores (after binding), pinned memory on accelerators,
    the configured prefetch factor."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = loader_workers(cfg, cores)
    return {
        "num_workers": workers,
        "pin_memory": device.type != "cpu",
        "prefetch_factor": cfg.data.prefetch_factor if workers > 0 else None,
    }


def loader_workers(cfg, cores_per_rank: int) -> int:
    """data.loader_workers: an explicit value (>= 0) wins; -1 = one worker per spare core of the rank (the rank's
    own thread keeps one), at most 4, at least 0."""
    if cfg.data.loader_workers >= 0:
        return cfg.data.loader_workers
    return max(0, min(4, cores_per_rank - 1))


if __name__ == "__main__":
    main()
