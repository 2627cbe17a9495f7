"""The profile stage end to end on fixtures, with a real MLflow store: outputs and artifacts, the baseline comparison
(a regression is a finding, and fails the task when configured; a failed run is never a baseline), the CLI, and the
collection entry points."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from tasks import cli
from tasks.device import BackendUnavailable
from tasks.errors import StageError
from tasks.profiling.collect import make_profiler, trace_path
from tasks.profiling.msprof import msprof_wrap, run_msprof_analyze
from tasks.runner import run_stage

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures" / "profiling"


def analyze_args(path) -> Namespace:
    return Namespace(action="analyze", path=str(path), shard_dir=None)


def slowed_copy(src: Path, dst: Path, factor: float) -> Path:
    """The same torch traces with every timestamp and duration stretched: step time × factor, same shares."""
    dst.mkdir(parents=True)
    for p in src.glob("*.json"):
        data = json.loads(p.read_text())
        for e in data["traceEvents"]:
            for key in ("ts", "dur"):
                if isinstance(e.get(key), (int, float)):
                    e[key] *= factor
        (dst / p.name).write_text(json.dumps(data))
    return dst


def test_analyze_stage_writes_report_and_logs_to_mlflow(cfg, tmp_path, monkeypatch):
    import mlflow

    bin_dir = tmp_path / "bin"  # python only: no Ascend tools (msprof, msprof-analyze) on PATH
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    result = run_stage("profile", cfg, tmp_path / "run", args=analyze_args(FIX / "ascend_pt_new_unhealthy"))
    assert result["status"] == "warn" and result["findings"] == 6 and result["world"] == 4
    assert result["summary"].startswith("step 150.0 ms") and "6 findings" in result["summary"]
    out = tmp_path / "run" / "profile"
    for name in ("report.json", "report.md", "step_breakdown.png", "top_ops.png"):
        assert (out / name).stat().st_size > 0
    report = json.loads((out / "report.json").read_text())
    assert report["source"]["msprof_analyze"]["status"] == "skipped"  # not on PATH: skipped, not failed
    assert "cluster.slow_rank" in (out / "report.md").read_text()
    client = mlflow.MlflowClient(cfg.tracking.uri)
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.metrics["profile.step_ms"] == pytest.approx(150.0)
    assert run.data.metrics["profile.findings"] == 6 and run.data.tags["profile.format"] == "ascend_pt"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "profile")}
    assert {"profile/report.json", "profile/report.md", "profile/step_breakdown.png"} <= artifacts


def test_baseline_regression_is_a_finding_and_can_fail_the_task(cfg, tmp_path):
    cfg.tracking.experiment = f"profile-baseline-{tmp_path.name}"  # runs of other tests are no baseline here
    first = run_stage("profile", cfg, tmp_path / "a", args=analyze_args(FIX / "torch_cuda_healthy"))
    assert first["status"] == "ok" and first["baseline_run_id"] is None and first["findings"] == 0

    slower = slowed_copy(FIX / "torch_cuda_healthy", tmp_path / "slower", 1.3)
    cfg.profile.fail_on_regression = True
    with pytest.raises(StageError, match=r"step time regressed \+30% against the baseline run"):
        run_stage("profile", cfg, tmp_path / "b", args=analyze_args(slower))
    assert (
        json.loads((tmp_path / "b" / "profile" / "report.json").read_text())["findings"][0]["rule"]
        == "baseline.regression"
    )  # the report is written before the task fails

    cfg.profile.fail_on_regression = False
    third = run_stage("profile", cfg, tmp_path / "c", args=analyze_args(slower))
    assert third["status"] == "warn" and third["rules"] == ["high:baseline.regression"]
    assert third["baseline_run_id"] == first["mlflow_run_id"]  # the failed run in between is no baseline
    report = json.loads(Path(third["report"]).read_text())
    assert report["baseline"]["metrics"]["profile.step_ms"]["change"] == pytest.approx(0.3, rel=1e-3)
    assert report["baseline"]["metrics"]["profile.comm_not_overlapped_share"]["change"] == pytest.approx(0, abs=1e-6)

    same = run_stage("profile", cfg, tmp_path / "d", args=analyze_args(slower))  # now compared with the 3rd run
    assert same["status"] == "ok" and same["baseline_run_id"] == third["mlflow_run_id"]


def test_cli_analyze_json_and_one_line_error(tmp_path, capsys):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "tasks",
        "profile",
        "analyze",
        str(FIX / "cluster_old_unhealthy"),
        "--json",
        "--no-tracking",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["format"] == "cluster_analysis" and result["findings"] == 3
    assert "high:cluster.slow_link" in result["rules"]
    (tmp_path / "empty").mkdir()
    assert (
        cli.main(["profile", "analyze", str(tmp_path / "empty"), "--no-tracking", "--run-dir", str(tmp_path / "run2")])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "no profiling data found" in err


def test_a_collected_profile_is_keyed_by_the_layout_and_shape_that_ran(cfg):
    """The baseline key of a collected profile is the layout train.prepare resolved (pinned or the plan's) and the
    model shape built, from traces/collected.json: keyed by the config, every planned layout was dp 0 tp 0 pp 0 —
    profiles of two layouts compared as one, a regression that was a layout change."""
    from tasks.profiling.baseline import key_digest, profile_key

    cfg.parallel.dp = cfg.parallel.tp = cfg.parallel.pp = 0  # left to the planner
    report = {"source": {"format": "torch_trace"}, "world": 4}
    ran = {"layout": {"dp": 2, "tp": 2, "pp": 1, "zero": 1, "micro_batch": 2}, "model": {"dim": 64, "n_layers": 2}}
    key = profile_key(cfg, report, "cpu", ran)
    assert (key["dp"], key["tp"], key["pp"], key["zero"], key["micro_batch"]) == (2, 2, 1, 1, 2)
    assert key["model"] == ran["model"]
    other = profile_key(cfg, report, "cpu", {**ran, "layout": {**ran["layout"], "tp": 1, "pp": 2}})
    assert key_digest(other) != key_digest(key)  # same config, another layout ran: another key
    assert profile_key(cfg, report, "cpu")["dp"] == 0  # an analysed folder: the config's, as before


def test_an_earlier_collect_is_reused_only_for_the_same_config_and_shard_set(cfg, tmp_path):
    """`profile collect --shard-dir B` after a collect on set A in the same run directory reused A's traces: the
    shard path is not in the config's digest."""
    from tasks.fsutil import atomic_write_json
    from tasks.stages.profile import reusable

    marker = tmp_path / "traces" / "collected.json"
    assert reusable(marker, cfg, "/data/A") is None  # nothing collected yet
    atomic_write_json(marker, {"config_hash": cfg.digest(), "shard_dir": "/data/A", "source": str(tmp_path / "PROF")})
    assert reusable(marker, cfg, "/data/A") == tmp_path / "PROF"
    assert reusable(marker, cfg, "/data/B") is None
    cfg.train.lr *= 2
    assert reusable(marker, cfg, "/data/A") is None


def test_collect_uses_the_training_stage_preparation(cfg, tmp_path):
    """Without a shard set the profiled run stops where the train stage would, with its one-line cause."""
    with pytest.raises(StageError, match="no shard set"):
        run_stage("profile", cfg, tmp_path / "run")


def test_make_profiler_cpu_trace_and_npu_unavailable(cfg, tmp_path):
    import torch

    pcfg = cfg.profile
    with make_profiler(pcfg, "cpu", tmp_path / "traces", rank=0) as prof:
        for _ in range(pcfg.steps_needed()):
            torch.randn(64, 64) @ torch.randn(64, 64)
            prof.step()
    events = json.loads(trace_path(tmp_path / "traces", 0).read_text())["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == [f"ProfilerStep#{pcfg.skip_first + pcfg.wait + pcfg.warmup + i}" for i in range(pcfg.active)]
    with pytest.raises(BackendUnavailable, match="torch_npu"):
        make_profiler(pcfg, "npu", tmp_path / "npu", rank=0)
    assert not (tmp_path / "npu").exists()  # a failed start leaves nothing behind
    with make_profiler(pcfg, "npu", None, rank=0) as off:  # no profile directory: the same loop, unprofiled
        off.step()


def test_msprof_tools_are_optional(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # as on a host without the Ascend tools: skipped cleanly
    assert shutil.which("msprof-analyze") is None
    assert run_msprof_analyze(FIX / "ascend_pt_new_healthy", tmp_path / "out")["status"] == "skipped"
    cmd = ["python", "-m", "torch.distributed.run", "--nproc-per-node", "8", "-m", "tasks.train.worker"]
    assert msprof_wrap(cmd, tmp_path / "m", None) == cmd
    assert msprof_wrap(cmd, tmp_path / "m", "/opt/msprof") == [
        "/opt/msprof",
        "--application=python -m torch.distributed.run --nproc-per-node 8 -m tasks.train.worker",
        f"--output={tmp_path / 'm'}",
    ]


def test_baseline_of_another_key_is_no_baseline_never_a_regression(cfg, tmp_path):
    """Changing what is profiled (here the micro-batch, then the layout) is not a regression: the report says there
    is no baseline yet for that key; a later profile of the same key is compared again."""
    cfg.tracking.experiment = f"profile-key-{tmp_path.name}"
    cfg.profile.fail_on_regression = True
    first = run_stage("profile", cfg, tmp_path / "a", args=analyze_args(FIX / "torch_cuda_healthy"))
    assert first["baseline_run_id"] is None and first["baseline_note"].startswith("no baseline yet: first profile")

    slower = slowed_copy(FIX / "torch_cuda_healthy", tmp_path / "slower", 1.5)
    cfg.train.micro_batch *= 2
    other = run_stage("profile", cfg, tmp_path / "b", args=analyze_args(slower))
    assert other["status"] == "ok" and other["baseline_run_id"] is None and other["rules"] == []
    assert "no baseline yet for this configuration" in other["baseline_note"]
    assert "micro_batch" in other["baseline_note"]
    report = json.loads(Path(other["report"]).read_text())
    assert report["baseline"] is None and "no baseline yet" in (tmp_path / "b" / "profile" / "report.md").read_text()

    cfg.parallel.dp += 1  # the layout differs too: still no baseline
    assert run_stage("profile", cfg, tmp_path / "c", args=analyze_args(slower))["baseline_run_id"] is None

    cfg.parallel.dp -= 1  # back to the second run's key: compared with it, and a 1.5x slowdown now fails the task
    much_slower = slowed_copy(FIX / "torch_cuda_healthy", tmp_path / "much_slower", 2.25)
    with pytest.raises(StageError, match=r"step time regressed \+50% against the baseline run"):
        run_stage("profile", cfg, tmp_path / "d", args=analyze_args(much_slower))
