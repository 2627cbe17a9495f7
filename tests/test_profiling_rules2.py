"""Second-wave profile rules (cube vs vector, communication headroom, retransmission, AI CPU by name) and a folder
holding only kernel_details.csv (older CANN: no step trace) analysed for what it holds."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest

from tasks.stages.profile import analyze
from tasks.profiling.advisor import advise
from tasks.profiling.render import render_markdown
from tasks.profiling.rules_guides import guide_rules

FIX = Path(__file__).resolve().parent / "fixtures" / "profiling"


@pytest.fixture(scope="module")
def healthy():
    return analyze(FIX / "ascend_pt_new_healthy")


def rules(findings):
    return {f["rule"]: f for f in findings}


def test_ai_cpu_ops_are_listed_by_name_as_info(healthy):
    info = rules(healthy["info"])
    names = [o["name"] for o in healthy["ai_cpu_ops"]]
    assert names and all(n in info["operator.ai_cpu_list"]["title"] for n in names)
    assert "operator.ai_cpu_list" not in rules(healthy["findings"])  # info never counts as a finding
    assert healthy["op_support"]["ai_cpu"][0]["op"] == names[0]
    assert "## Operator support" in render_markdown(healthy) and "[info] operator.ai_cpu_list" in render_markdown(
        healthy
    )


def _with(report, cube_us, vector_us, comm_share, world=2):
    r = copy.deepcopy(report)
    r["categories"]["cube/matmul"]["total_us"] = cube_us
    r["categories"]["attention"]["total_us"] = 0.0
    r["categories"]["vector"]["total_us"] = vector_us
    r["categories"]["communication"]["total_us"] = r["categories"]["ai_cpu"]["total_us"] = 0.0
    r["step"]["shares"]["communication"] = comm_share
    r["world"] = world
    return r


def test_cube_vector_imbalance_both_ways(healthy):
    vec = rules(guide_rules(_with(healthy, 100.0, 900.0, 0.3)))["compute.cube_vector_imbalance"]
    assert vec["severity"] == "medium" and "cube (matmul) units idle" in vec["title"]
    assert "npu_rms_norm" in vec["advice"] and vec["evidence"]["vector_share"] == pytest.approx(0.9)
    cube = rules(guide_rules(_with(healthy, 900.0, 100.0, 0.3)))["compute.cube_vector_imbalance"]
    assert cube["severity"] == "info" and "vector units mostly idle" in cube["title"]
    assert "compute.cube_vector_imbalance" not in rules(guide_rules(_with(healthy, 500.0, 500.0, 0.3)))


def test_communication_headroom_only_below_15_percent_and_with_ranks(healthy):
    low = rules(guide_rules(_with(healthy, 1, 1, 0.10)))["scaling.communication_headroom"]
    assert low["severity"] == "info" and "adding cards is fine" in low["title"]
    assert "scaling.communication_headroom" not in rules(guide_rules(_with(healthy, 1, 1, 0.20)))
    assert "scaling.communication_headroom" not in rules(guide_rules(_with(healthy, 1, 1, 0.05, world=1)))


def test_retransmission_absolute_threshold(healthy):
    r = copy.deepcopy(healthy)
    r["communication"] = [
        {
            "op": "hcom_allReduce",
            "kind": "collective",
            "count": 2,
            "elapse_ms": 9000.0,
            "transit_ms": 8400.0,
            "wait_ms": 10.0,
            "wait_ratio": 0.0,
        }
    ]
    f = rules(guide_rules(r))["communication.retransmission"]
    assert f["severity"] == "high" and "4200 ms" in f["title"] and "nic-link" in f["advice"]
    r["communication"][0]["transit_ms"] = 7000.0
    assert "communication.retransmission" not in rules(guide_rules(r))


@pytest.mark.parametrize("scenario", ["ascend_pt_old_unhealthy", "ascend_pt_new_unhealthy"])
def test_kernel_details_only_folder_is_analysed_not_refused(tmp_path, scenario):
    """Only kernel_details.csv (written by the fixture generator in the exact torch_npu format) per rank."""
    for rank_dir in sorted((FIX / scenario).glob("*_ascend_pt")):
        out = tmp_path / rank_dir.name / "ASCEND_PROFILER_OUTPUT"
        out.mkdir(parents=True)
        shutil.copy(rank_dir / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv", out)
        for info in rank_dir.glob("profiler_info*.json"):
            shutil.copy(info, tmp_path / rank_dir.name)
    full = analyze(FIX / scenario)
    only = analyze(tmp_path)
    assert only["world"] == full["world"] and only["steps_per_rank"] >= 1
    assert any("derived from kernel_details timings" in n for n in only["source"]["notes"])
    assert "one window per Step Id" in only["source"]["notes"][0]
    # operators and categories are the same as with the full export
    assert [o["name"] for o in only["top_ops"]] == [o["name"] for o in full["top_ops"]]
    assert only["categories"]["communication"]["share"] == pytest.approx(full["categories"]["communication"]["share"])
    # the derived breakdown tiles each window: computing + exposed communication + free = step
    s = only["step"]
    assert s["computing_us"] + s["comm_not_overlapped_us"] + s["free_us"] == pytest.approx(s["step_us"])
    assert 0 < s["shares"]["communication"] < 1
    assert "derived from kernel_details timings" in render_markdown(only)


def _cpu_traces(out: Path) -> Path:
    """Two ranks' real torch.profiler CPU traces (make_profiler, as a CPU collect writes them): mostly element-wise
    aten ops and a small matmul, rank 1 doing eight times rank 0's work (one thread: less noise on a busy host)."""
    import torch

    from tasks.config import load_config
    from tasks.profiling.collect import make_profiler

    pcfg = load_config("demo-cpu").profile
    x, w, threads = torch.randn(512, 512), torch.randn(8, 8), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.relu(x * 2 + 1).sigmoid().exp(), torch.mm(w, w)  # first calls (library set-up) outside the profile
        for rank, reps in ((0, 1), (1, 8)):
            with make_profiler(pcfg, "cpu", out, rank=rank) as prof:
                for _ in range(pcfg.steps_needed()):
                    for _ in range(reps):
                        torch.relu(x * 2 + 1).sigmoid().exp()
                        torch.mm(w, w)
                    prof.step()
    finally:
        torch.set_num_threads(threads)
    return out


def test_ascend_rules_and_advice_stay_off_cpu_and_cuda_traces(tmp_path):
    """categorize() files every operator not named like a matmul under "vector": a CPU trace got "vector operators take
    92% of AI Core time" with torch_npu advice, a CUDA trace "cube operators take 100% of AI Core time", and a slow
    CPU rank the advice to run npu-smi."""
    cpu = analyze(_cpu_traces(tmp_path / "cpu"))
    cats = cpu["categories"]
    assert cats["vector"]["total_us"] > 0.8 * (cats["vector"]["total_us"] + cats["cube/matmul"]["total_us"])
    assert "compute.cube_vector_imbalance" not in rules(cpu["findings"] + cpu["info"])
    slow = rules(cpu["findings"])["cluster.slow_rank"]
    assert "npu-smi" not in slow["advice"] and "host" in slow["advice"]
    cuda = analyze(FIX / "torch_cuda_healthy")  # tests/fixtures/profiling/generate.py, torch.profiler's CUDA format
    assert cuda["top_ops"][0]["core"] == "CUDA" and cuda["categories"]["cube/matmul"]["total_us"] > 0
    assert "compute.cube_vector_imbalance" not in rules(cuda["findings"] + cuda["info"])
    as_cuda = copy.deepcopy(cpu)  # the same spread on a GPU: nvidia-smi, not npu-smi
    as_cuda["top_ops"][0]["core"] = "CUDA"
    advice = rules(advise(as_cuda))["cluster.slow_rank"]["advice"]
    assert "nvidia-smi" in advice and "npu-smi" not in advice
    # Ascend data keeps both: the cube/vector rule and the npu-smi advice
    npu = analyze(FIX / "ascend_pt_new_unhealthy")
    assert "npu-smi info" in rules(npu["findings"])["cluster.slow_rank"]["advice"]
    assert "compute.cube_vector_imbalance" in rules(guide_rules(_with(npu, 100.0, 900.0, 0.3)))
