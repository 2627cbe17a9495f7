"""Chrome-trace reading and interval arithmetic, shared by torch.profiler traces and Ascend's trace_view.json.

Ascend writes `ts` as strings ("1704161511422904.204") and the file as a bare array; torch writes numbers inside
`{"traceEvents": [...]}`. Both are µs. A `*.gz` trace (torch's `tensorboard_trace_handler(use_gzip=True)`
writes `<worker>.<ns>.pt.trace.json.gz`) is read through gzip.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path

from tasks.errors import StageError

STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")


def open_trace(path: Path, mode: str = "rt"):
    """The trace file, decompressed when its name ends in .gz (torch's use_gzip export)."""
    if str(path).endswith(".gz"):
        return gzip.open(path, mode, **({"encoding": "utf-8"} if "t" in mode else {}))
    return open(path, mode, **({"encoding": "utf-8"} if "t" in mode else {}))


def load_trace(path: Path) -> tuple[dict, list[dict]]:
    """(top-level metadata, events) with numeric ts/dur; a truncated or non-trace file fails naming it."""
    try:
        with open_trace(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise StageError(
            f"{path}: not valid JSON (line {e.lineno}: {e.msg}); the trace was cut short or is still being written"
        ) from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # a .gz cut short or not gzip at all
        raise StageError(
            f"{path}: not a complete gzip file ({e}); the trace was cut short or is still being written: "
            "collect the profile again"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise StageError(f"{path}: unreadable ({e})") from None
    meta, events = ({}, data) if isinstance(data, list) else (data, data.get("traceEvents"))
    if not isinstance(events, list):
        raise StageError(f"{path}: not a Chrome trace (no event array / traceEvents)")
    for e in events:
        for key in ("ts", "dur"):
            if isinstance(e.get(key), str):
                try:
                    e[key] = float(e[key].strip())
                except ValueError:
                    e[key] = None if key == "ts" else e[key]
        dur = e.get("dur") if isinstance(e, dict) and e.get("ph") == "X" else 0
        if dur is not None and not (isinstance(dur, (int, float)) and 0 <= dur < float("inf")):
            raise StageError(
                f"{path}: event {str(e.get('name', '?'))[:80]!r} has duration {dur!r} (must be a finite number "
                ">= 0); the trace is corrupt or was edited: collect the profile again"
            )
    return meta, events


def is_trace(data) -> bool:
    if isinstance(data, dict):
        return isinstance(data.get("traceEvents"), list)
    return isinstance(data, list) and bool(data) and isinstance(data[0], dict) and "ph" in data[0]


def names(events: list[dict]) -> tuple[dict, dict]:
    """pid → process name and (pid, tid) → thread name, from the "M" metadata events."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        label = (e.get("args") or {}).get("name", "")
        if e.get("name") == "process_name":
            procs[e.get("pid")] = label
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = label
    return procs, threads


def spans(events: list[dict]) -> list[dict]:
    """Complete events with a usable start and duration."""
    return [
        e
        for e in events
        if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))
    ]


def step_windows(events: list[dict]) -> list[tuple[int, float, float]]:
    """(step number, start, end) of every ProfilerStep#N span, in time order."""
    out = []
    for e in events:
        m = STEP_RE.match(str(e.get("name", "")))
        if m:
            out.append((int(m.group(1)), e["ts"], e["ts"] + e["dur"]))
    return sorted(out, key=lambda w: w[1])


def union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def length(merged) -> float:
    return sum(e - s for s, e in merged)


def clip(merged, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in merged if e > lo and s < hi]


def subtract(a, b) -> list[tuple[float, float]]:
    """Parts of the merged intervals `a` not covered by the merged intervals `b`."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out
