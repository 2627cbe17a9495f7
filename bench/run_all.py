"""Run every bench/bench_*.py (each `run() -> {"area.figure": value}`), write bench/results.json and results.md.

Each bench measures its figure side by side with a baseline in the same run and reports ratios. A bench that
fails is recorded as an error (and makes this exit non-zero) without hiding the others' figures.
`python bench/run_all.py [name …]` runs only the named benches (e.g. `data train_step`).
"""
from __future__ import annotations

import importlib.util
import json
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main(argv: list[str]) -> int:
    from tasks.fsutil import atomic_write_json, atomic_write_text

    names = argv or sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))
    out_json = HERE / "results.json"
    previous = json.loads(out_json.read_text()) if out_json.exists() else {}
    results = dict(previous.get("figures", {})) if argv else {}
    errors, timings = {}, {}
    for name in names:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"bench_{name}.py")
        mod = importlib.util.module_from_spec(spec)
        started = time.time()
        print(f"== bench {name}", flush=True)
        try:
            spec.loader.exec_module(mod)
            figures = mod.run()
            results.update(figures)
            for k, v in figures.items():
                print(f"   {k} = {v}", flush=True)
        except Exception:  # keep the other benches' figures; report this one
            errors[name] = traceback.format_exc().strip().splitlines()[-1]
            print(traceback.format_exc(), file=sys.stderr)
        timings[name] = round(time.time() - started, 1)
    doc = {"figures": results, "errors": errors, "seconds": timings,
           "machine": {"python": platform.python_version(), "platform": platform.platform(),
                       "processor": platform.processor() or platform.machine()},
           "date": time.strftime("%Y-%m-%d")}
    atomic_write_json(out_json, doc)
    lines = ["# Benchmark results", "", f"Machine: {doc['machine']['platform']}, {doc['date']}.", "",
             "| figure | value |", "|---|---|"]
    for k in sorted(results):
        v = results[k]
        lines.append(f"| `{k}` | {json.dumps(v) if isinstance(v, (dict, list)) else v} |")
    if errors:
        lines += ["", "## Errors", ""] + [f"- `{k}`: {v}" for k, v in errors.items()]
    atomic_write_text(HERE / "results.md", "\n".join(lines) + "\n")
    print(f"\nwrote {out_json} and {HERE / 'results.md'}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
