"""CPU seconds of child processes, the unit of the benches that compare two ways of starting or ending a process."""

from __future__ import annotations

import resource
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_cpu_s(argv: list[str], env: dict, timeout: float = 600) -> float:
    """user + sys CPU seconds of one child process and everything it reaped, start to exit (run in the repository)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True, timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def interleaved_medians(variants: dict[str, tuple[list[str], dict]], runs: int) -> dict[str, float]:
    """Each variant's (argv, env) median child_cpu_s over `runs`, the variants taking turns: a change in the host's
    load falls on all of them."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, (argv, env) in variants.items():
            times[name].append(child_cpu_s(argv, env))
    return {name: statistics.median(t) for name, t in times.items()}
