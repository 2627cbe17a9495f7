"""The env stage end to end: the real CLI with a real 2-rank gloo torchrun probe and MLflow, the npu error, and the
stage over fixture files (Ascend install tree, npu-smi output from a stand-in npu-smi on PATH)."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.errors import StageError
from tasks.fsutil import read_json
from tasks.runner import run_stage
from tests.helpers.mlflow_store import fresh_store

REPO = Path(__file__).resolve().parent.parent
ENV = REPO / "tests" / "fixtures" / "env"


def _cli(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    (tmp / "tmp").mkdir(exist_ok=True)  # the run's temporary directory: the probe's torchrun must leave nothing there
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TMPDIR": str(tmp / "tmp")}
    env.pop("ASCEND_HOME_PATH", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tasks",
            "env",
            "--run-dir",
            str(tmp / "run"),
            "--set",
            f"tracking.uri={fresh_store(tmp / 'm.db')}",
            "--set",
            f"tracking.artifact_root={tmp}/art",
            "--json",
            *extra,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One real CLI run, collective probe included (2 gloo ranks under torchrun), shared by the assertions."""
    tmp = tmp_path_factory.mktemp("env-cli")
    proc = _cli(tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, json.loads(proc.stdout), proc.stderr


@pytest.mark.slow
def test_cli_result_is_small_and_complete(cli_run):
    tmp, result, stderr = cli_run
    assert result["status"] == "ok" and result["backend"] == "cpu" and result["device_count"] >= 1
    assert result["summary"].startswith("cpu ×2, torch 2.13.0, all_reduce ok ")
    assert len(json.dumps(result)) < 1000  # XCom-sized
    assert read_json(tmp / "run" / "env.json")["summary"] == result["summary"]  # the runner's result file
    assert "env: OK — cpu ×2" in stderr and "[  ok] allreduce" in stderr
    # torch elastic's per-rank files beside the probe's result, not a torchelastic_* directory left in $TMPDIR
    assert not list((tmp / "tmp").glob("torchelastic_*"))
    assert (tmp / "run" / "env" / "probe-torchelastic").is_dir()


@pytest.mark.slow
def test_cli_probe_really_ran_two_gloo_ranks(cli_run):
    tmp, result, _ = cli_run
    report = read_json(result["env_json"])
    p = report["probe"]
    # gloo, or under the test session's strict mode gloo behind HCCL's checks (tasks/collectives.py)
    want = "gloo_as_hccl" if os.environ.get("LLM_PIPELINE_STRICT_COLLECTIVES") == "hccl" else "gloo"
    assert (p["world_size"], p["backend"], p["allreduce_ok"], p["allreduce_max_error"]) == (2, want, True, 0.0)
    assert p["ranks_forked"]  # the ranks started as training's CPU ranks do (tasks/launch/agent.py)
    expected = [float(s) for s in load_config("demo-cpu").hardware.probe_sizes_mb]
    assert [s["size_mb"] for s in p["sizes"]] == expected  # hardware.probe_sizes_mb
    assert all(s["busbw_gbps"] > 0 and s["seconds"] > 0 for s in p["sizes"])
    names = [c["name"] for c in report["checks"]]
    for name in (
        "python-torch",
        "torch_npu-torch-cann",
        "import-torch",
        "backend",
        "clock",
        "hccl-timeouts",
        "visible-devices",
        "host-memory",
        "disk",
        "allreduce",
        "bus-bandwidth",
    ):
        assert name in names
    assert report["versions"]["torch"].startswith("2.13.0") and report["host"]["memory_total_gb"] > 0
    assert report["import_torch"] == {"ok": True, "torch": report["versions"]["torch"]}  # the subprocess check


@pytest.mark.slow
def test_cli_logged_to_mlflow(cli_run):
    import mlflow

    tmp, result, _ = cli_run
    client = mlflow.MlflowClient(f"sqlite:///{tmp}/m.db")
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.params["env.backend"] == "cpu" and run.data.params["env.torch"].startswith("2.13.0")
    sizes = load_config("demo-cpu").hardware.probe_sizes_mb
    assert {f"env.busbw_gbps.{float(s):g}mb" for s in sizes} <= set(run.data.metrics)
    assert run.data.metrics["env.checks_fail"] == 0
    assert run.data.tags["pipeline.stage"] == "env"
    assert "env.json" in [a.path for a in client.list_artifacts(run.info.run_id)]


def test_cli_npu_without_torch_npu_is_one_line_exit_2(tmp_path):
    proc = _cli(tmp_path, "--set", "hardware.device=npu", "--no-tracking")
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "torch_npu is not importable" in errors[0] and "Traceback" not in proc.stderr
    report = read_json(tmp_path / "run" / "env" / "env.json")
    assert report["status"] == "fail" and read_json(tmp_path / "run" / "env.json")["status"] == "failed"


@pytest.fixture
def fake_npu_smi(tmp_path, monkeypatch):
    """Put an `npu-smi` on PATH that prints a fixture (the real tool's exact text), like a host with NPUs."""

    def install(fixture: str):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        exe = bin_dir / "npu-smi"
        exe.write_text(f"#!/bin/sh\ncat '{ENV / 'npu-smi' / fixture}'\n")
        exe.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    return install


def test_stage_over_fixtures_warns_npus_unused(cfg, tmp_path, fake_npu_smi):
    fake_npu_smi("910b2c.txt")
    args = argparse.Namespace(no_probe=True, ascend_root=str(ENV / "ascend-legacy"))
    result = run_stage("env", cfg, tmp_path / "run", args=args)
    assert result["status"] == "warn"
    assert {"torch_npu-torch-cann", "npu-idle", "backend", "allreduce"} <= set(result["warnings"])
    report = read_json(result["env_json"])
    assert report["versions"]["cann"]["version"] == "8.3.RC1" and report["versions"]["driver"]["version"] == "24.1.rc1"
    assert report["npu_smi"]["chips"][0]["name"] == "910B2C"
    checks = {c["name"]: c for c in report["checks"]}
    assert "pip install torch==2.8.0 torch-npu==2.8.0 (CANN 8.3.RC1)" in checks["torch_npu-torch-cann"]["detail"]
    assert "npu-smi lists 2 NPU chips but the backend is cpu" in checks["backend"]["detail"]


def test_an_ascend_root_that_is_not_a_directory_is_refused(cfg, tmp_path):
    """A mistyped --ascend-root would read as "no CANN installed" (a warning): refused in one line before any check."""
    from tasks.errors import ConfigError

    args = argparse.Namespace(no_probe=True, ascend_root=str(tmp_path / "Ascnd"))
    with pytest.raises(ConfigError, match=r"^--ascend-root .*/Ascnd is not a directory; give the Ascend install root"):
        run_stage("env", cfg, tmp_path / "run", args=args)


def test_stage_failure_is_one_line_and_still_reported(cfg, tmp_path, fake_npu_smi):
    import mlflow

    fake_npu_smi("310b4.txt")
    args = argparse.Namespace(no_probe=True, ascend_root=str(ENV / "ascend-cann"))
    with pytest.raises(StageError) as err:
        run_stage("env", cfg, tmp_path / "run", args=args)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("driver-firmware: firmware 7.3.0.1.231 is outside")
    assert "+1 more failed checks" in msg  # the 310B4 Alarm
    report = read_json(tmp_path / "run" / "env" / "env.json")
    assert report["status"] == "fail"
    run_id = read_json(tmp_path / "run" / "env.json")["mlflow_run_id"]  # the failed run still holds the facts
    assert mlflow.MlflowClient(cfg.tracking.uri).get_run(run_id).data.metrics["env.checks_fail"] == 2
    assert {c["name"] for c in report["checks"] if c["status"] == "fail"} == {"driver-firmware", "npu-health"}


def test_device_memory_below_the_plans_sizing_fails_the_stage(cfg, tmp_path, monkeypatch):
    """Two 910B4 chips with 32 GB of HBM under the 910b preset (64 GB per device, what plan, smoke and rehearsal size
    with): the env stage fails naming both figures and the fix; it used to record 32768 MB and say only npu-health ok.
    The npu-smi text is the 910B2C fixture with a 910B4's name and HBM total."""
    text = (ENV / "npu-smi" / "910b2c.txt").read_text().replace("910B2C", "910B4 ").replace("65536", "32768")
    (tmp_path / "910b4.txt").write_text(text)
    exe = tmp_path / "bin" / "npu-smi"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\ncat '{tmp_path / '910b4.txt'}'\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    cfg.hardware.cluster = "910b"
    args = argparse.Namespace(no_probe=True, ascend_root=str(ENV / "ascend-legacy"))
    with pytest.raises(StageError) as err:
        run_stage("env", cfg, tmp_path / "run", args=args)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("device-memory: each device has 34.36 GB (npu-smi: 910B4 HBM total 32768 MiB)")
    assert "the plan sizes devices with 64 GB (hardware.cluster 910b's preset memory)" in msg
    assert "set hardware.device_memory_gb to the real size (34.36) or pick the hardware.cluster" in msg
    report = read_json(tmp_path / "run" / "env" / "env.json")
    assert report["device_memory"] == {
        "measured_gb": 34.36,
        "measured": "npu-smi: 910B4 HBM total 32768 MiB",
        "sizing_gb": 64.0,
    }

    from tasks.stages.env import _device_memory_check

    cfg.hardware.device_memory_gb = 32.0  # the real size given: the plan now sizes with it
    memory = _device_memory_check(cfg, {"npu_smi": report["npu_smi"]})
    assert memory["status"] == "ok" and "(hardware.device_memory_gb)" in memory["detail"]
    cfg.hardware.device_memory_gb, cfg.hardware.cluster = 0.0, "cpu-laptop"  # a CPU preset sizes host memory
    assert _device_memory_check(cfg, {"npu_smi": report["npu_smi"]}) is None
