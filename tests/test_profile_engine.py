"""profile.analyzer: auto | builtin | msprof-analyze. The agreement check runs on fixtures in the exact formats of
both producers (torch_npu ASCEND_PROFILER_OUTPUT and msprof-analyze's cluster_analysis_output, written by
tests/fixtures/profiling/generate.py); the end-to-end run of the real msprof-analyze needs the PyPI package
msprof-analyze on PATH in the test environment and is skipped without it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tasks.errors import StageError
from tasks.stages.profile import analyze
from tasks.profiling import engine

FIX = Path(__file__).resolve().parent / "fixtures" / "profiling"
HAS_TOOL = shutil.which("msprof-analyze") is not None


def _cluster_output(fixture: str, folder: str = "cluster_analysis_output"):
    """The cluster_analysis_output msprof-analyze writes, taken from a fixture in its format."""

    def run(data_dir, out_dir, **_):  # msprof-analyze's inputs (fmt) are not needed by the stand-in output
        shutil.copytree(FIX / fixture / folder, Path(out_dir) / "cluster_analysis_output")
        return {"status": "ok", "output": str(out_dir)}

    return run


def test_builtin_never_runs_the_tool(tmp_path):
    r = engine.apply("builtin", analyze(FIX / "ascend_pt_new_healthy"), FIX / "ascend_pt_new_healthy", tmp_path)
    assert r["engine"]["used"] == "builtin" and "msprof_analyze" not in r["source"]


def test_auto_falls_back_and_required_fails_in_one_line_without_the_tool(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))  # a host without msprof-analyze (requirements.txt has it)
    src = FIX / "ascend_pt_new_healthy"
    r = engine.apply("auto", analyze(src), src, tmp_path)
    assert r["engine"]["used"] == "builtin" and "not on PATH" in r["engine"]["reason"]
    assert any("msprof-analyze not used" in n for n in r["source"]["notes"])
    with pytest.raises(StageError) as e:
        engine.apply("msprof-analyze", analyze(src), src, tmp_path)
    assert "pip install msprof-analyze==" in str(e.value) and "\n" not in str(e.value)


def test_torch_traces_are_builtin_only(tmp_path):
    src = FIX / "torch_cuda_healthy"
    assert engine.apply("auto", analyze(src), src, tmp_path)["engine"]["used"] == "builtin"
    with pytest.raises(StageError, match="does not read"):
        engine.apply("msprof-analyze", analyze(src), src, tmp_path)


def test_msprof_analyze_breakdown_is_primary_and_agrees_within_one_percent(tmp_path):
    src = FIX / "ascend_pt_new_healthy"
    builtin = analyze(src)
    r = engine.apply("msprof-analyze", analyze(src), src, tmp_path, run=_cluster_output("cluster_new_healthy"))
    eng = r["engine"]
    assert eng["used"] == "msprof-analyze" and eng["agreement"]["within"], eng["agreement"]
    assert eng["agreement"]["worst"] <= 0.01
    assert r["step"]["step_us"] != builtin["step"]["step_us"] and r["step"]["step_us"] == pytest.approx(100450.0)
    assert "analysis.disagreement" not in {f["rule"] for f in r["findings"]}


def test_msprof_analyze_db_output_is_read(tmp_path):
    """CANN >= 8.5: torch_npu writes ascend_pytorch_profiler_{rank}.db beside the text export, msprof-analyze 26.2.0
    then takes the db input and writes only cluster_analysis_output/cluster_analysis.db (table ClusterStepTraceTime).
    The fixture is that file as msprof-analyze itself wrote it (tests/fixtures/profiling/generate.py cluster_db)."""
    src = FIX / "ascend_pt_new_healthy"
    run = _cluster_output("cluster_db_healthy")
    r = engine.apply("msprof-analyze", analyze(src), src, tmp_path, run=run)
    assert not list((tmp_path / "cluster_analysis_output").glob("*.csv"))
    eng = r["engine"]
    assert eng["used"] == "msprof-analyze" and eng["agreement"]["within"], eng["agreement"]
    assert r["step"]["step_us"] == pytest.approx((100000 + 100500 + 100400 + 100902) / 4)


def test_a_disagreement_is_a_finding(tmp_path):
    src = FIX / "ascend_pt_new_healthy"
    r = engine.apply(
        "auto", analyze(src), src, tmp_path, run=_cluster_output("cluster_old_unhealthy", "msprof_analyze_out")
    )
    f = next(f for f in r["findings"] if f["rule"] == "analysis.disagreement")
    assert f["severity"] == "medium" and not r["engine"]["agreement"]["within"]


def _step_trace_output(computing, comm_not_overlapped, free, bubble):
    """A cluster_analysis_output in msprof-analyze's text format (the header of the fixture cluster_new_healthy,
    written by tests/fixtures/profiling/generate.py) whose two ranks (those of ascend_pt_new_healthy) both show this
    step breakdown (µs)."""
    header = (FIX / "cluster_new_healthy" / "cluster_analysis_output" / "cluster_step_trace_time.csv").read_text()
    header = header.splitlines()[0]
    step = computing + comm_not_overlapped + free
    rows = [
        f",rank,{r},{computing},{comm_not_overlapped},0,{comm_not_overlapped},{free},{step - bubble},{bubble},"
        f"{comm_not_overlapped},0,{r},0,0"
        for r in range(2)
    ]

    def run(data_dir, out_dir, **_):
        out = Path(out_dir) / "cluster_analysis_output"
        out.mkdir(parents=True)
        (out / "cluster_step_trace_time.csv").write_text("\n".join([header, *rows]) + "\n")
        return {"status": "ok", "output": str(out_dir)}

    return run


def test_findings_judge_the_msprof_analyze_breakdown_the_report_shows(tmp_path):
    """The rules ran in analyze() over the built-in breakdown, before engine.apply swapped in msprof-analyze's: a 40 %
    exposed communication and a 20 % bubble from msprof-analyze raised no finding."""
    from tasks.profiling.render import render_markdown

    src = FIX / "ascend_pt_new_healthy"
    builtin = analyze(src)
    assert not {"communication.not_overlapped", "pipeline.bubble"} & {f["rule"] for f in builtin["findings"]}
    run = _step_trace_output(40000, 40000, 20000, 20000)
    r = engine.apply("auto", analyze(src), src, tmp_path, run=run)
    assert r["engine"]["used"] == "msprof-analyze"
    assert r["step"]["shares"]["comm_not_overlapped"] == pytest.approx(0.4)
    rules = {f["rule"]: f for f in r["findings"]}
    assert rules["communication.not_overlapped"]["evidence"]["comm_not_overlapped_share"] == pytest.approx(0.4)
    assert rules["pipeline.bubble"]["evidence"]["bubble_share"] == pytest.approx(0.2)
    assert "analysis.disagreement" in rules  # still reported beside the re-run rules
    md = render_markdown(r)
    assert "| **all** (msprof-analyze) | 100.00 | 40.00 | 40.00 |" in md
    assert "| 0 (built-in) |" in md and "| 0 |" not in md
    assert "| **all** |" in render_markdown(builtin) and "(built-in)" not in render_markdown(builtin)


def test_an_earlier_output_in_the_folder_is_never_this_runs_result(tmp_path):
    """engine.apply accepted any cluster_analysis_output already in its folder: a tool that exits 0 and writes nothing
    (here a stand-in for it) had the previous run's numbers reported as msprof-analyze's."""
    src, out = FIX / "ascend_pt_new_healthy", tmp_path / "msprof_analyze"
    _cluster_output("cluster_old_unhealthy", "msprof_analyze_out")(src, out)  # an earlier run's output

    def writes_nothing(data_dir, out_dir, **_):
        return {"status": "ok", "output": str(out_dir)}

    builtin = analyze(src)
    r = engine.apply("auto", analyze(src), src, out, run=writes_nothing)
    assert r["engine"]["used"] == "builtin" and "wrote no cluster_analysis_output" in r["engine"]["reason"]
    assert r["step"]["step_us"] == builtin["step"]["step_us"] and not out.exists()
    with pytest.raises(StageError, match="wrote no cluster_analysis_output"):
        engine.apply("msprof-analyze", analyze(src), src, out, run=writes_nothing)


def test_another_analyzer_on_the_same_trace_is_no_regression(cfg, tmp_path, monkeypatch):
    """The baseline key had no analyzer while report_metrics logged the engine's breakdown: builtin, then
    msprof-analyze on one identical trace reported "communication share regressed"."""
    from argparse import Namespace
    from functools import partial

    from tasks.runner import run_stage

    cfg.tracking.experiment = f"profile-analyzer-{tmp_path.name}"
    cfg.profile.fail_on_regression = True
    args = Namespace(action="analyze", path=str(FIX / "ascend_pt_new_healthy"), shard_dir=None)
    cfg.profile.analyzer = "builtin"
    first = run_stage("profile", cfg, tmp_path / "a", args=args)
    assert first["analyzer"] == "builtin" and first["comm_not_overlapped_share"] < 0.1
    # msprof-analyze's breakdown of the same trace (a stand-in output far from the built-in one)
    monkeypatch.setattr(engine, "apply", partial(engine.apply, run=_step_trace_output(40000, 40000, 20000, 0)))
    cfg.profile.analyzer = "msprof-analyze"
    second = run_stage("profile", cfg, tmp_path / "b", args=args)
    assert second["analyzer"] == "msprof-analyze" and second["comm_not_overlapped_share"] == pytest.approx(0.4)
    assert second["baseline_run_id"] is None and "analyzer 'builtin'→'msprof-analyze'" in second["baseline_note"]
    assert "baseline.regression" not in {r.split(":")[1] for r in second["rules"]}
    third = run_stage("profile", cfg, tmp_path / "c", args=args)  # the same analyzer again: compared
    assert third["baseline_run_id"] == second["mlflow_run_id"]


@pytest.mark.skipif(not HAS_TOOL, reason="needs the PyPI package msprof-analyze on PATH (requirements.txt installs it)")
def test_the_install_hint_only_when_the_tool_is_missing(tmp_path):
    """With msprof-analyze installed, msprof's text export (it reads PROF_* only as db) and a failing run ended in
    "fix: pip install msprof-analyze==…": the line names the db export instead, or no install at all."""
    src = FIX / "msprof_new_healthy"  # msprof's text export, tests/fixtures/profiling/generate.py
    with pytest.raises(StageError) as e:
        engine.apply("msprof-analyze", analyze(src), src, tmp_path)
    msg = str(e.value)
    assert "pip install" not in msg and "\n" not in msg
    assert "msprof --export=on --type=db --output=" in msg
    failed = lambda data_dir, out_dir, **_: {"status": "failed", "returncode": 1}  # noqa: E731
    with pytest.raises(StageError) as e:
        engine.apply("msprof-analyze", analyze(FIX / "ascend_pt_new_healthy"), src, tmp_path, run=failed)
    assert "msprof-analyze failed" in str(e.value) and "pip install" not in str(e.value)


@pytest.mark.slow  # the real msprof-analyze over the fixture: one run of the tool, 6-16 CPU s on this host
@pytest.mark.skipif(not HAS_TOOL, reason="needs the PyPI package msprof-analyze on PATH (requirements.txt installs it)")
def test_real_msprof_analyze_agrees_with_builtin(tmp_path):
    src = tmp_path / "data"
    shutil.copytree(FIX / "ascend_pt_new_healthy", src)
    r = engine.apply("msprof-analyze", analyze(src), src, tmp_path / "out")
    assert r["source"]["msprof_analyze"]["status"] == "ok", r["source"]["msprof_analyze"]  # the tool's own run
    assert r["engine"]["used"] == "msprof-analyze" and r["engine"]["agreement"]["within"], r["engine"]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TOOL, reason="needs the PyPI package msprof-analyze on PATH (requirements.txt installs it)")
def test_real_msprof_analyze_on_a_db_export(tmp_path):
    """The whole path on a CANN >= 8.5 folder: the fixture plus torch_npu's db export (formats.torch_npu_db, schema of
    torch-npu 2.13.0), the real msprof-analyze, its db output read by the engine."""
    import sys

    sys.path.insert(0, str(FIX))
    import formats

    src = tmp_path / "data"
    shutil.copytree(FIX / "ascend_pt_new_healthy", src)
    for r, rank_dir in enumerate(sorted(src.glob("rank*_ascend_pt"))):
        formats.torch_npu_db(rank_dir, r)
    r = engine.apply("msprof-analyze", analyze(src), src, tmp_path / "out")
    out = tmp_path / "out" / "cluster_analysis_output"
    assert (out / "cluster_analysis.db").is_file() and not list(out.glob("*.csv"))
    assert r["engine"]["used"] == "msprof-analyze" and r["engine"]["agreement"]["within"], r["engine"]
    assert r["step"]["step_us"] == pytest.approx((100000 + 100500 + 100400 + 100902) / 4)
