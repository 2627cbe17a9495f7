"""torch.profiler Chrome traces (CPU and CUDA, one JSON per rank) → RankData.

The step breakdown follows Ascend's overlap analysis so every backend reads the same way: per ProfilerStep#N window,
computing = union of compute intervals, communication = union of collective intervals, not-overlapped = the part of
communication outside computing, free = the rest of the window.
- CUDA traces: device kernels (NCCL kernels are communication).
- CPU traces: cpu ops; gloo runs collectives on its own threads ("gloo:all_reduce"), so the main thread waiting in
  `work.wait()` shows as not computing while the gloo thread communicates — not-overlapped communication.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from tasks.errors import StageError
from tasks.profiling import timeline as tl
from tasks.profiling.model import Op, RankData, Step, categorize
from tasks.units import MB

DATA_WAIT_RE = re.compile(r"enumerate\(DataLoader\)|DataLoader\w*Iter\.__next__|^data_wait$", re.I)
_RANK_RE = re.compile(r"rank[_-]?(\d+)", re.I)
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def data_wait_per_step(events: list[dict], windows) -> list[float]:
    waits = tl.union((e["ts"], e["ts"] + e["dur"]) for e in events if DATA_WAIT_RE.search(str(e.get("name", ""))))
    return [tl.length(tl.clip(waits, lo, hi)) for _, lo, hi in windows] if waits else []


def _self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """(event, self time): its duration minus its direct children's, per thread (ops nest on one thread)."""
    out, by_tid = [], defaultdict(list)
    for e in events:
        by_tid[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                out.append(tuple(stack.pop()))
            if stack:
                stack[-1][1] -= e["dur"]
            stack.append([e, e["dur"]])
        out.extend(tuple(s) for s in stack)
    return out


def _aggregate(pairs, core: str) -> list[Op]:
    acc: dict[str, list] = {}
    for e, self_us in pairs:
        a = acc.setdefault(e["name"], [0, 0.0, 0.0])
        a[0] += 1
        a[1] += max(self_us, 0.0)
        a[2] = max(a[2], e["dur"])
    return [Op(name, core, c, t, m) for name, (c, t, m) in acc.items()]


def _rank_of(meta: dict, path: Path, fallback: int) -> int:
    info = meta.get("distributedInfo") or {}
    if isinstance(info.get("rank"), int):
        return info["rank"]
    m = _RANK_RE.search(path.name)
    return int(m.group(1)) if m else fallback


def read_torch_trace(path: Path, fallback_rank: int = 0) -> RankData:
    meta, events = tl.load_trace(path)
    xs = tl.spans(events)
    windows = tl.step_windows(xs)
    if not windows:
        raise StageError(f"{path}: no ProfilerStep#N spans; profile with a schedule and call prof.step() each step")
    inside = _within(windows)
    device = [e for e in xs if e.get("cat") in _DEVICE_CATS and inside(e)]
    if device:  # CUDA: the device timeline is the truth; CPU-side nccl annotations are only the enqueue
        comm_ev = [e for e in device if categorize(e["name"]) == "communication"]
        comp_ev = [e for e in device if categorize(e["name"]) != "communication"]
        compute = tl.union((e["ts"], e["ts"] + e["dur"]) for e in comp_ev)
        ops = _aggregate(((e, e["dur"]) for e in device), "CUDA")
    else:
        cpu = [
            e
            for e in xs
            if inside(e) and (e.get("cat") == "cpu_op" or (e.get("cat") == "user_annotation" and _is_comm(e)))
        ]
        comm_ev = [e for e in cpu if _is_comm(e)]
        compute = _cpu_compute(cpu)
        ops = _aggregate(_self_times(cpu), "CPU")
    comm = tl.union((e["ts"], e["ts"] + e["dur"]) for e in comm_ev)
    steps = [_breakdown(n, lo, hi, compute, comm) for n, lo, hi in windows]
    rank = RankData(
        rank=_rank_of(meta, path, fallback_rank),
        origin=str(path),
        steps=steps,
        ops=ops,
        data_wait_us=data_wait_per_step(xs, windows),
    )
    rank.memory_peak_mb = _memory_peak(events)
    return rank


def _is_comm(e: dict) -> bool:
    return categorize(str(e.get("name", ""))) == "communication"


def _within(windows):
    lo, hi = windows[0][1], windows[-1][2]
    return lambda e: lo <= e["ts"] < hi


def _cpu_compute(cpu_ops: list[dict]):
    """Per thread: time inside non-communication ops minus time inside communication ops (a blocking collective
    nested in an op is waiting, not computing); then the union over threads."""
    per_thread = defaultdict(lambda: ([], []))
    for e in cpu_ops:
        per_thread[e.get("tid")][1 if _is_comm(e) else 0].append((e["ts"], e["ts"] + e["dur"]))
    parts = []
    for comp, comm in per_thread.values():
        parts.extend(tl.subtract(tl.union(comp), tl.union(comm)))
    return tl.union(parts)


def _breakdown(step: int, lo: float, hi: float, compute, comm) -> Step:
    c, m = tl.clip(compute, lo, hi), tl.clip(comm, lo, hi)
    computing, communication = tl.length(c), tl.length(m)
    busy = tl.length(tl.union(c + m))
    not_overlapped = busy - computing
    return Step(
        step=step,
        computing=computing,
        comm_not_overlapped=not_overlapped,
        overlapped=communication - not_overlapped,
        communication=communication,
        free=max(hi - lo - busy, 0.0),
    )


def _memory_peak(events: list[dict]) -> dict:
    """Peak of the profiler's "[memory]" records (profile_memory=True), preferring the accelerator's."""
    peaks: dict[int, list[float]] = {}
    for e in events:
        if e.get("name") == "[memory]" and e.get("ph") == "i":
            a = e.get("args") or {}
            p = peaks.setdefault(int(a.get("Device Type", 0)), [0.0, 0.0])
            p[0] = max(p[0], float(a.get("Total Allocated", 0)))
            p[1] = max(p[1], float(a.get("Total Reserved", 0)))
    if not peaks:
        return {}
    alloc, reserved = peaks[max(peaks)]  # device type 0 is CPU; accelerators have higher numbers
    return {"allocated": alloc / MB, "reserved": reserved / MB}
