"""Run every bench/bench_*.py (each `run() -> {"area.figure": value}`), write bench/results.json and results.md.

Each bench measures its figure side by side with a baseline in the same run and reports ratios. A bench that
fails is recorded as an error (and makes this exit non-zero) without hiding the others' figures.
`python bench/run_all.py [name …]` runs only the named benches (e.g. `data train_step`): their figures replace
that bench's old ones, every other figure is kept as it was, with the date and machine it was measured on
(each figure carries its own provenance), and the files say which benches this run refreshed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def machine() -> dict:
    """What the figures were measured on: platform, CPU model and count (the committed figures are CPU-bound)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": cpu,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


def _legacy_provenance(previous: dict) -> dict:
    """A results.json from before per-figure provenance: every figure gets that file's one date and machine."""
    stamp = {"date": previous.get("date", "unknown"), "machine": previous.get("machine", {}), "bench": None}
    return {k: dict(stamp) for k in previous.get("figures", {})}


def merge(previous: dict, fresh: dict[str, dict], stamp: dict) -> tuple[dict, dict]:
    """Old figures + this run's: a rerun bench's old figures are dropped (also ones it no longer reports), every
    other figure keeps its value and its own provenance. `fresh` maps bench name → its figures.
    → (figures, provenance)."""
    figures = dict(previous.get("figures", {}))
    prov = previous.get("provenance") or _legacy_provenance(previous)
    prov = {k: prov.get(k) or {"date": "unknown", "machine": {}, "bench": None} for k in figures}
    for name, figs in fresh.items():
        areas = {k.split(".", 1)[0] for k in figs}
        stale = [
            k
            for k, p in prov.items()
            if p.get("bench") == name or (p.get("bench") is None and k.split(".", 1)[0] in areas)
        ]
        for k in stale:
            figures.pop(k, None)
            prov.pop(k, None)
        for k, v in figs.items():
            figures[k] = v
            prov[k] = dict(stamp, bench=name)
    return figures, prov


def _machine_label(m: dict) -> str:
    return f"{m.get('processor', '?')} ×{m.get('cpus', '?')}, {m.get('platform', '?')}" if m else "unknown"


def markdown(doc: dict) -> str:
    machines: list[str] = []
    for p in doc["provenance"].values():
        label = _machine_label(p.get("machine", {}))
        if label not in machines:
            machines.append(label)
    refreshed = ", ".join(doc["refreshed"]) or "none"
    lines = [
        "# Benchmark results",
        "",
        f"Last run {doc['date']} refreshed: {refreshed}. Every other figure is from its own earlier run: "
        "each row says when and on which machine (M#) it was measured.",
        "",
    ]
    lines += [f"- M{i + 1}: {label}" for i, label in enumerate(machines)]
    lines += ["", "| figure | value | measured |", "|---|---|---|"]
    for k in sorted(doc["figures"]):
        v, p = doc["figures"][k], doc["provenance"][k]
        m = machines.index(_machine_label(p.get("machine", {}))) + 1
        lines.append(f"| `{k}` | {json.dumps(v) if isinstance(v, (dict, list)) else v} | {p['date']} M{m} |")
    if doc["errors"]:
        lines += ["", "## Errors (this run)", ""] + [f"- `{k}`: {v}" for k, v in doc["errors"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from tasks.fsutil import atomic_write_json, atomic_write_text

    # sorted: the data bench (peak RSS of this process and its workers) runs before the model benches grow the heap
    names = sorted(set(argv)) if argv else sorted(p.stem[len("bench_") :] for p in HERE.glob("bench_*.py"))
    unknown = [n for n in names if not (HERE / f"bench_{n}.py").is_file()]
    if unknown:
        print(
            f"run_all: no bench/bench_{unknown[0]}.py; choose from "
            f"{', '.join(sorted(p.stem[6:] for p in HERE.glob('bench_*.py')))}",
            file=sys.stderr,
        )
        return 2
    out_json = HERE / "results.json"
    fresh, errors, timings = {}, {}, {}
    stamp = {"date": time.strftime("%Y-%m-%d"), "machine": machine()}
    for name in names:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"bench_{name}.py")
        mod = importlib.util.module_from_spec(spec)
        started = time.time()
        print(f"== bench {name}", flush=True)
        try:
            spec.loader.exec_module(mod)
            figures = mod.run()
            fresh[name] = figures
            for k, v in figures.items():
                print(f"   {k} = {v}", flush=True)
        except Exception:  # keep the other benches' figures; report this one
            errors[name] = traceback.format_exc().strip().splitlines()[-1]
            print(traceback.format_exc(), file=sys.stderr)
        timings[name] = round(time.time() - started, 1)
    # Read now, not at the start: another partial run that finished meanwhile keeps its figures.
    previous = json.loads(out_json.read_text()) if argv and out_json.exists() else {}  # full run: nothing old
    timings = {**previous.get("seconds", {}), **timings}
    figures, prov = merge(previous, fresh, stamp)
    doc = {
        "figures": figures,
        "provenance": prov,
        "refreshed": sorted(fresh),
        "errors": errors,
        "seconds": timings,
        "date": stamp["date"],
        "machine": stamp["machine"],
    }
    atomic_write_json(out_json, doc)
    atomic_write_text(HERE / "results.md", markdown(doc))
    print(f"\nwrote {out_json} and {HERE / 'results.md'} (refreshed: {', '.join(sorted(fresh)) or 'none'})")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
