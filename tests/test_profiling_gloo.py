"""A real profiled 2-rank gloo run on CPU (torchrun, tasks.profiling.collect.make_profiler in every rank) analysed
into a report: communication is non-zero on both ranks and is the gloo collective, data-loader waits and memory
were recorded, and only the schedule's active steps are in the traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.launch.torchrun import launcher
from tasks.profiling.advisor import advise
from tasks.profiling.loader import load_profile
from tasks.profiling.report import build_report

REPO = Path(__file__).resolve().parent.parent


def test_profiled_two_rank_gloo_run(tmp_path):
    out = tmp_path / "traces"
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # OMP_NUM_THREADS=1 from tests/conftest.py
    proc = subprocess.run(
        [
            sys.executable,
            *launcher("cpu"),  # the ranks start as training's CPU ranks do: forked by torchrun's agent
            "--standalone",
            "--nproc-per-node",
            "2",
            str(REPO / "tests" / "profiling_gloo_worker.py"),
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["rank0.pt.trace.json", "rank1.pt.trace.json"]

    report = build_report(load_profile(out))
    report["findings"] = advise(report)
    assert report["source"]["format"] == "torch_trace" and [r["rank"] for r in report["ranks"]] == [0, 1]
    for rank in report["ranks"]:
        assert [s["step"] for s in rank["steps"]] == [2, 3]  # skip_first=1, warmup=1, active=2
        assert rank["mean"]["communication_us"] > 0 and rank["mean"]["computing_us"] > 0
        windows = {
            e["name"]: e["dur"]
            for e in json.loads(Path(rank["origin"]).read_text())["traceEvents"]
            if e.get("name", "").startswith("ProfilerStep#")
        }
        for s in rank["steps"]:  # computing + exposed communication + free tile each ProfilerStep window
            assert s["total"] == pytest.approx(windows[f"ProfilerStep#{s['step']}"], rel=1e-6)
            assert min(s["computing"], s["comm_not_overlapped"], s["overlapped"], s["free"]) >= 0
        assert rank["data_wait_us_per_step"] > 0  # the DataLoader's __next__ spans
        assert rank["memory_peak_mb"]["allocated"] > 4  # the 4 MB gradient bucket at least
        assert rank["allreduce_us_per_step"] > 0
    comm = [o for o in report["top_ops"] if o["category"] == "communication"]
    assert "gloo:all_reduce" in {o["name"] for o in comm} and report["categories"]["communication"]["total_us"] > 0
    assert "aten::mm" in report["categories"]["cube/matmul"]["top"]
