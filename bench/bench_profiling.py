"""Profiling figures, each against a baseline measured in the same run:
- the cost of profiling a step: median step time of a small training loop under make_profiler (CPU, memory
  recording on, the stage's settings) over the same loop unprofiled;
- the analyser's time: load_profile + build_report + advise on the traces that loop wrote (copied as 2 ranks),
  over plain json.load's time on the same files (the floor any trace reader pays; > 1: slower than that floor)."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

STEPS = 12


def _loop(prof=None) -> list[float]:
    """Forward/backward/SGD of a 4-layer MLP; per-step wall times (the first two warm up and are dropped)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512)
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if prof is not None:
            prof.step()
    return times[2:-1]  # the last profiled step also exports the trace


def run() -> dict:
    from tasks.config import ProfileConfig
    from tasks.profiling.advisor import advise
    from tasks.profiling.collect import make_profiler, trace_path
    from tasks.profiling.loader import load_profile
    from tasks.profiling.report import build_report

    pcfg = ProfileConfig(skip_first=0, wait=0, warmup=1, active=STEPS - 1, profile_memory=True)
    base = statistics.median(_loop())
    with tempfile.TemporaryDirectory() as tmp:
        traces = Path(tmp) / "traces"
        with make_profiler(pcfg, "cpu", traces, rank=0) as prof:
            profiled = statistics.median(_loop(prof))
        data = json.loads(trace_path(traces, 0).read_text())
        data["distributedInfo"] = {"rank": 1, "world_size": 2}
        trace_path(traces, 1).write_text(json.dumps(data))
        files = sorted(traces.glob("*.json"))
        t0 = time.perf_counter()
        for p in files:
            json.loads(p.read_text())
        t_json = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = build_report(load_profile(traces))
        advise(report)
        t_analyze = time.perf_counter() - t0
    events = 2 * len(data["traceEvents"])
    return {
        "profiling.step_ms_unprofiled": round(base * 1000, 3),
        "profiling.step_ms_profiled": round(profiled * 1000, 3),
        "profiling.step_overhead_ratio": round(profiled / base, 3),
        "profiling.analyze_events_per_s": round(events / t_analyze),
        "profiling.analyze_vs_json_load_ratio": round(t_analyze / t_json, 2),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
