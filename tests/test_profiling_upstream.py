"""The profile readers on real upstream output (tests/fixtures/profiling_upstream, from msprof-analyze's own test
resources; see the README there): expected figures are computed from the files with the csv/json modules here,
independently of tasks.profiling."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import pytest

from tasks.stages.profile import analyze
from tasks.profiling import ascend, tables

UP = Path(__file__).resolve().parent / "fixtures" / "profiling_upstream"


def test_msprof_analyze_cluster_output_is_read_exactly():
    root = UP / "msprof_analyze_cluster" / "cluster_analysis_output"
    rows = [r for r in csv.DictReader(open(root / "cluster_step_trace_time.csv")) if r["Type"] == "rank"]
    report = analyze(root)
    assert report["source"]["format"] == "cluster_analysis" and report["world"] == len(rows) == 8
    mean = lambda col: sum(float(r[col]) for r in rows) / len(rows)  # noqa: E731
    step = report["step"]
    assert step["computing_us"] == pytest.approx(mean("Computing"))
    assert step["comm_not_overlapped_us"] == pytest.approx(mean("Communication(Not Overlapped)"))
    assert step["free_us"] == pytest.approx(mean("Free"))
    by_rank = report["slow_ranks"]["dims"]["communication"]["by_rank_us"]
    assert by_rank == pytest.approx({int(r["Index"]): float(r["Communication"]) for r in rows})
    # msprof-analyze's slow-rank logic: the rank that waits least in communication arrived last
    least = min(rows, key=lambda r: float(r["Communication"]))["Index"]
    assert report["slow_ranks"]["slowest_rank"] == int(least) == 1
    assert "cluster.slow_rank" in {f["rule"] for f in report["findings"]}
    # the communication file: per-rank bandwidth from the real Transit Size / Transit Time
    comm = ascend._cluster_comm(root / "cluster_communication.json")
    data = json.loads((root / "cluster_communication.json").read_text())
    n_ops = {rank: sum(rank in ranks for ranks in data["(0, 1)"]["step"].values()) for rank in ("0", "1")}
    assert {r: len(ops) for r, ops in comm.items()} == {0: n_ops["0"], 1: n_ops["1"]} == {0: 2, 1: 2}


def test_torch_npu_level1_kernel_details_are_read_exactly():
    path = UP / "msprof_analyze_kernels" / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv"
    header, rows = tables.read_csv(path)
    assert tables.detect_kind(header) == "kernel_details" and "Block Dim" in header
    expected = defaultdict(lambda: [0, 0.0])
    for r in csv.DictReader(open(path)):
        expected[r["Type"]][0] += 1
        expected[r["Type"]][1] += float(r["Duration(us)"])
    ops = ascend.ops_from_kernels(rows)
    assert list(ops) == [None]  # no Device_id column in this torch_npu release
    got = {op.name: [op.count, op.total_us] for op in ops[None]}
    assert got.keys() == expected.keys()
    for name, (count, total) in expected.items():
        assert got[name][0] == count and got[name][1] == pytest.approx(total), name
