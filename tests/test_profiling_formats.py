"""Profile analysis on fixtures written in the exact Ascend / torch formats (tests/fixtures/profiling/generate.py):
the right advisor findings fire on the unhealthy ones and none on the healthy ones, the numbers are read right from
every header variant, and broken folders fail in one line naming the missing or broken file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.errors import StageError
from tasks.profiling import tables, timeline
from tasks.profiling.advisor import advise
from tasks.profiling.loader import load_profile
from tasks.profiling.render import render_markdown
from tasks.profiling.report import build_report

FIX = Path(__file__).resolve().parent / "fixtures" / "profiling"
EXPECTED = json.loads((FIX / "expected.json").read_text())
FORMATS = {
    "ascend_pt": [
        "ascend_pt_new_healthy",
        "ascend_pt_new_unhealthy",
        "ascend_pt_old_healthy",
        "ascend_pt_old_unhealthy",
        "ascend_output_trace_only/ASCEND_PROFILER_OUTPUT",
    ],
    "msprof": ["msprof_new_healthy", "msprof_old_unhealthy"],
    "cluster_analysis": ["cluster_new_healthy", "cluster_old_unhealthy"],
    "torch_trace": ["torch_cuda_healthy", "torch_cuda_unhealthy"],
}


def report_of(path) -> dict:
    report = build_report(load_profile(path))
    report["findings"] = advise(report)
    return report


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_findings_per_fixture(scenario):
    report = report_of(FIX / scenario)
    assert {f["rule"] for f in report["findings"]} == set(EXPECTED[scenario])
    assert report["source"]["format"] == next(fmt for fmt, names in FORMATS.items() if scenario in names)
    for f in report["findings"]:
        assert f["severity"] in ("high", "medium", "low") and f["advice"] and f["evidence"]
    md = render_markdown(report)
    assert all(f"**[{f['severity']}] {f['rule']}**" in md for f in report["findings"])
    assert ("No rule fired." in md) == (not EXPECTED[scenario])


def test_new_cann_four_ranks_numbers():
    r = report_of(FIX / "ascend_pt_new_unhealthy")
    assert r["world"] == 4 and r["steps_per_rank"] == 2
    step = r["step"]
    assert step["step_us"] == pytest.approx(150_000)
    assert step["shares"]["comm_not_overlapped"] == pytest.approx((3 * 60_000 + 44_000) / 4 / 150_000)
    slow = r["slow_ranks"]
    assert slow["slowest_rank"] == 2
    assert slow["dims"]["computing"]["spread"] == pytest.approx(16_000 / 84_000)
    assert slow["links"]["RDMA"]["by_rank_gbps"][3] == pytest.approx(12.0, rel=1e-3)
    assert slow["links"]["HCCS"]["spread"] == pytest.approx(0.0, abs=1e-6)
    ops = {o["name"]: o for o in r["top_ops"]}
    assert ops["MatMulV2"]["category"] == "cube/matmul" and ops["MatMulV2"]["core"] == "AI_CORE"
    assert ops["FlashAttentionScore"]["category"] == "attention"
    assert ops["RmsNorm"]["category"] == "vector"
    assert ops["hcom_allReduce_"]["category"] == "communication"
    assert {o["name"]: o["max_us"] for o in r["ai_cpu_ops"]} == {"IndexPut": 50.0, "NonZero": 12.0}
    ai_cpu = [f for f in r["findings"] if f["rule"] == "operator.ai_cpu"]
    assert [f["evidence"]["op"] for f in ai_cpu] == ["IndexPut"]  # 12 µs stays under the 20 µs rule
    assert r["data_wait"]["max_us_per_step"] == pytest.approx(15_000)
    assert r["memory"]["peak_allocated_mb"] == pytest.approx(5303.0)  # APP (whole process) is not the allocator
    assert r["memory"]["peak_reserved_mb"] == pytest.approx(9000.0)
    comm = {c["op"]: c for c in r["communication"]}
    assert comm["hcom_allReduce"]["count"] == 8 and comm["hcom_allReduce"]["wait_ratio"] == pytest.approx(0.2)
    assert r["step"]["allreduce_share"] == pytest.approx(0.8 * 65_000 / 150_000)


def test_older_cann_variants_and_bubble():
    r = report_of(FIX / "ascend_pt_old_unhealthy")
    variants = " | ".join(r["source"]["variants"])
    assert "Block Dim (CANN < 9)" in variants and "no Preparing" in variants and "no Device_id" in variants
    assert r["step"]["shares"]["bubble"] == pytest.approx(0.25)
    assert {o["core"] for o in r["top_ops"] if o["category"] == "communication"} == {"HCCL"}  # pre-COMMUNICATION
    new = " | ".join(report_of(FIX / "ascend_pt_new_healthy")["source"]["variants"])
    assert "Block Num (CANN ≥ 9)" in new and "Preparing" in new and "Step Id" in new and "no Device_id" not in new


def test_trace_view_only_and_msprof_and_cluster_paths():
    r = report_of(FIX / "ascend_output_trace_only" / "ASCEND_PROFILER_OUTPUT")  # steps from Overlap Analysis
    assert [s["step"] for s in r["ranks"][0]["steps"]] == [1, 2]
    assert r["step"]["shares"]["busy"] == pytest.approx(0.35)
    old = report_of(FIX / "msprof_old_unhealthy")  # CANN 7.0.0: device_0/summary + device_0/timeline
    assert old["ranks"][0]["rank"] == 0 and old["step"]["shares"]["comm_not_overlapped"] == pytest.approx(0.4)
    cluster = report_of(FIX / "cluster_old_unhealthy")  # renamed folder, found by the CSV header
    assert cluster["slow_ranks"]["slowest_rank"] == 1 and [r["rank"] for r in cluster["ranks"]] == [0, 1, 2, 3]


def test_csv_quirks():
    assert tables.num('"1736413971558972.912\t"') == pytest.approx(1736413971558972.912)
    assert tables.num("N/A") is None and tables.num("") is None and tables.num(" 12.5\t") == 12.5
    base = ["Name", "Type", "Accelerator Core", "Start Time(us)", "Duration(us)", "Wait Time(us)"]
    assert (
        tables.detect_kind(base + ["Block Dim"])
        == tables.detect_kind(["Step Id", "Device_id"] + base + ["Block Num"])
        == "kernel_details"
    )
    op_summary = ["Op Name", "OP Type", "Task Type", "Task Start Time(us)", "Task Duration(us)", "Block Dim"]
    assert tables.detect_kind(op_summary) == "op_summary"
    assert set(tables.kernel_rows([dict.fromkeys(op_summary, "x")])[0]) == {
        "Name",
        "Type",
        "Accelerator Core",
        "Start Time(us)",
        "Duration(us)",
        "Block Num",
    }
    step = ["Step", "Computing", "Communication(Not Overlapped)", "Overlapped", "Communication", "Free"]
    assert tables.detect_kind(step) == "step_trace" and tables.detect_kind(["Device_id"] + step) == "step_trace"
    assert tables.detect_kind(["Step", "Type", "Index"] + step[1:]) == "cluster_step_trace"
    assert tables.detect_kind(["Name", "Duration(us)"]) is None


def test_string_ts_and_interval_arithmetic(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps(
            [{"ph": "X", "name": "ProfilerStep#4", "pid": 1, "tid": 1, "ts": "1704161511422904.204", "dur": 10.5}]
        )
    )
    _, events = timeline.load_trace(path)
    assert timeline.step_windows(events) == [
        (4, pytest.approx(1704161511422904.204), pytest.approx(1704161511422914.704))
    ]
    a = timeline.union([(0, 10), (5, 20), (30, 40)])
    assert a == [(0, 20), (30, 40)]
    assert timeline.subtract(a, [(2, 4), (15, 35)]) == [(0, 2), (4, 15), (35, 40)]
    assert timeline.length(timeline.clip(a, 10, 35)) == 15


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIX / name, dst)
    return dst


def _one_line_error(path, *needles):
    with pytest.raises(StageError) as e:
        load_profile(path)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


def test_broken_folders_name_the_missing_file(tmp_path):
    _one_line_error(tmp_path / "nope", "no such file or folder")
    (tmp_path / "empty").mkdir()
    _one_line_error(tmp_path / "empty", "no profiling data found")

    root = _copy("ascend_pt_new_healthy", tmp_path)
    rank1 = sorted(root.glob("rank1_*_ascend_pt"))[0]
    out = rank1 / "ASCEND_PROFILER_OUTPUT"
    (out / "step_trace_time.csv").write_bytes(b"\xff\xfeS\x00t\x00e\x00p\x00")  # UTF-16: not what CANN writes
    _one_line_error(root, "step_trace_time.csv", "unreadable CSV")
    (out / "step_trace_time.csv").unlink()
    (out / "trace_view.json").write_text((out / "trace_view.json").read_text()[:-200])  # cut short mid-write
    _one_line_error(root, "trace_view.json", "not valid JSON")
    (out / "trace_view.json").unlink()
    # kernel_details.csv alone (older CANN) is analysed for what it holds, with the missing step trace stated
    assert any("derived from kernel_details timings" in n for n in load_profile(root).notes)
    (out / "kernel_details.csv").unlink()
    _one_line_error(root, rank1.name, "step_trace_time.csv")
    (out / "ascend_pytorch_profiler_1.db").write_bytes(b"SQLite format 3\x00")
    _one_line_error(root, rank1.name, "step_trace_time.csv", "export_type=Text")
    shutil.rmtree(out)
    _one_line_error(root, rank1.name, "ASCEND_PROFILER_OUTPUT", "analyse(")

    prof = _copy("msprof_new_healthy", tmp_path)
    next(prof.rglob("msprof_*.json")).unlink()
    for p in prof.rglob("op_summary_*.csv"):  # with op_summary left it is analysed from kernel timings
        p.unlink()
    _one_line_error(prof, "mindstudio_profiler_output/msprof_*.json")

    cluster = _copy("cluster_new_healthy", tmp_path) / "cluster_analysis_output" / "cluster_step_trace_time.csv"
    cluster.write_text(cluster.read_text().splitlines()[0] + "\n")
    _one_line_error(cluster.parent, "cluster_step_trace_time.csv")

    trace = tmp_path / "torch" / "rank0.pt.trace.json"
    trace.parent.mkdir()
    trace.write_text(
        json.dumps(
            {
                "schemaVersion": 1,
                "traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2, "pid": 1, "tid": 1}],
            }
        )
    )
    _one_line_error(trace.parent, "rank0.pt.trace.json", "ProfilerStep")

    twice = _copy("ascend_pt_old_healthy", tmp_path)
    shutil.copytree(sorted(twice.glob("rank0_*"))[0], twice / "rank0_copy_ascend_pt")
    _one_line_error(twice, "rank 0 appears twice")


def test_a_present_but_unusable_step_trace_is_not_called_missing(tmp_path):
    """step_trace_time.csv there but header only, with a foreign header, or 0 bytes was reported as "missing — profile
    at level 1"; a kernels-only folder left it unsaid. Rank 1 of ascend_pt_new_healthy (generate.py, torch_npu's
    format) with only its step_trace_time.csv beside profiler_info_1.json."""
    root = _copy("ascend_pt_new_healthy", tmp_path)
    out = sorted(root.glob("rank1_*_ascend_pt"))[0] / "ASCEND_PROFILER_OUTPUT"
    csv_path = out / "step_trace_time.csv"
    header = csv_path.read_text().splitlines()[0]
    (out / "trace_view.json").unlink()
    csv_path.write_text(header + "\n")
    assert any("step_trace_time.csv has no data rows" in n for n in load_profile(root).notes)  # kernels-only analysis
    (out / "kernel_details.csv").unlink()
    _one_line_error(root, "step_trace_time.csv has no data rows (header only)")
    csv_path.write_text("a,b\n1,2\n")
    _one_line_error(root, "step_trace_time.csv header not recognised as step_trace (columns a, b)")
    csv_path.write_bytes(b"")
    _one_line_error(root, "step_trace_time.csv has no data rows (an empty file)")
    for msg_case in ("missing", "profile at level 1"):
        with pytest.raises(StageError) as e:
            load_profile(root)
        assert msg_case not in str(e.value)


@pytest.mark.parametrize(
    "name,core,category",
    [
        ("aclnnMatmul_MatMulCommon_MatMulV2", "AI_CORE", "cube/matmul"),
        ("aten::addmm", "CPU", "cube/matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "CUDA", "cube/matmul"),
        ("FlashAttentionScore", "MIX_AIC", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "CPU", "attention"),
        ("RmsNorm", "AI_VECTOR_CORE", "vector"),
        ("aten::broadcast_tensors", "CPU", "vector"),
        ("IndexPut", "AI_CPU", "ai_cpu"),
        ("aclnnNonzero_NonZeroAiCpu_NonZero", "N/A", "ai_cpu"),
        ("hcom_allReduce_", "COMMUNICATION", "communication"),
        ("hcom_receive__501_2_1", "HCCL", "communication"),
        ("gloo:all_reduce", "CPU", "communication"),
        ("ncclDevKernel_Broadcast_RING_LL", "CUDA", "communication"),
        ("FSDP::all_gather (layers.1)", "CPU", "communication"),
    ],
)
def test_operator_categories(name, core, category):
    from tasks.profiling.model import categorize

    assert categorize(name, core) == category
