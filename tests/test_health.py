"""Health check: alarm rules on npu-smi / chronyc fixture output, a real sample of this host logged to MLflow,
and the hourly DAG file parsing with real Airflow and without heavy imports."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.stages import health
from tasks import npu_smi
from tasks.envcheck import system
from tasks.errors import StageError

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"


def npu_sample(name: str, clock_fixture: str = "chronyc-tracking.txt") -> dict:
    """A sample as collect() builds it on an Ascend host, from fixture files in npu-smi/chronyc's own formats."""
    path = FIX / "health" / name if (FIX / "health" / name).is_file() else FIX / "env" / "npu-smi" / name
    return {
        "host": {"memory_available_gb": 900.0, "memory_total_gb": 1024.0},
        "npu_smi": npu_smi.parse(path.read_text()),
        "torch_devices": [],
        "backend": {"kind": "npu", "device_count": 2},
        "clock": system.parse_chronyc((FIX / "env" / clock_fixture).read_text()),
        "disk_paths": {"var": str(REPO)},
    }


def by_name(checks):
    return {c["name"]: c for c in checks}


def test_healthy_ascend_host_passes(cfg):
    checks = by_name(health.assess(npu_sample("910b2c.txt"), cfg, last_seen=2))
    assert {n: c["status"] for n, c in checks.items() if n in ("temperature", "hbm", "devices", "npu-health")} == {
        "temperature": "ok",
        "hbm": "ok",
        "devices": "ok",
        "npu-health": "ok",
    }
    assert checks["temperature"]["detail"] == "max 51 C"


def test_temperature_alarm_names_the_chip(cfg):
    checks = by_name(health.assess(npu_sample("910b2c-hot.txt"), cfg))
    assert checks["temperature"]["status"] == "fail"
    assert "NPU 1 chip 0 at 97 C" in checks["temperature"]["detail"]
    assert "NPU 0" not in checks["temperature"]["detail"]


def test_chip_in_alarm_state_fails(cfg):
    checks = by_name(health.assess(npu_sample("310b4.txt"), cfg))
    assert checks["npu-health"]["status"] == "fail" and "Alarm" in checks["npu-health"]["detail"]


def test_hbm_full_without_a_process_is_a_leak(cfg):
    checks = by_name(health.assess(npu_sample("910b2c-hbm-leak.txt"), cfg))
    assert checks["hbm"]["status"] == "fail"
    assert "NPU 1 chip 0 HBM 63940/65536 MB with no process" in checks["hbm"]["detail"]
    assert "NPU 0" not in checks["hbm"]["detail"]  # full, but its training process owns it
    cfg.hardware.max_hbm_used_pct = 99.5
    assert by_name(health.assess(npu_sample("910b2c-hbm-leak.txt"), cfg))["hbm"]["status"] == "ok"


def test_dropped_card_against_history_and_config(cfg):
    one = npu_sample("910b3-one-card.txt")
    assert by_name(health.assess(one, cfg, last_seen=1))["devices"]["status"] == "ok"
    dropped = by_name(health.assess(one, cfg, last_seen=8))["devices"]
    assert dropped["status"] == "fail" and "1 NPU chips (npu-smi) visible, 8 expected" in dropped["detail"]
    cfg.hardware.expected_devices = 2
    assert "hardware.expected_devices" in by_name(health.assess(one, cfg, last_seen=0))["devices"]["detail"]


def test_clock_offset_alarm_on_multi_node(cfg):
    cfg.hardware.nnodes = 2
    clock = by_name(health.assess(npu_sample("910b2c.txt", "chronyc-tracking-drifted.txt"), cfg))["clock"]
    assert clock["status"] == "fail" and "+742.3 ms off NTP" in clock["detail"]


def test_real_sample_of_this_host_is_logged_to_mlflow(cfg, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    cfg.tracking.experiment = f"tests-{tmp_path.name}"  # its own: the worker's store holds other tests' runs
    cfg.hardware.min_host_memory_gb = 0.01
    cfg.hardware.min_free_disk_gb = 0.01
    result = health.run_health(cfg, tmp_path / "run")
    assert result["status"] in ("ok", "warn") and result["mlflow_run_id"]
    run = mlflow.MlflowClient(cfg.tracking.uri).get_run(result["mlflow_run_id"])
    assert run.data.tags["health.status"] == result["status"]
    assert run.data.metrics["host.memory_available_gb"] > 0
    assert run.data.metrics["disk.var.free_gb"] > 0
    assert (tmp_path / "run" / "health.json").is_file()

    cfg.hardware.min_free_disk_gb = 1e9  # an alarm: the task fails with one line, and MLflow keeps the sample
    with pytest.raises(StageError) as err:
        health.run_health(cfg, tmp_path / "run2")
    cause = str(err.value)
    assert cause.startswith("health alarm: disk: ") and "\n" not in cause
    client = mlflow.MlflowClient(cfg.tracking.uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment + "-health")
    failed = client.search_runs([exp.experiment_id], "attributes.status = 'FAILED'")
    assert len(failed) == 1 and failed[0].data.tags["pipeline.error"] == cause
    assert failed[0].data.metrics["disk.var.free_gb"] > 0


def test_health_dag_parses_light_and_hourly(tmp_path):
    code = (
        "import sys; from airflow.dag_processing.dagbag import DagBag; "
        "b = DagBag(dag_folder='dags/llm_health.py'); d = b.dags['llm_health']; "
        "heavy = [m for m in ('torch', 'mlflow') if m in sys.modules]; "
        "print(b.import_errors, d.catchup, \"'0 * * * *'\" in str(d.timetable), d.task_ids, heavy, "
        "d.params['preset'])"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(PYTHONPATH=str(REPO), AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__LOAD_EXAMPLES="False")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    # the preset: none given means the site's default ($LLM_PIPELINE_PRESET), never a hard-coded demo-cpu whose
    # thresholds (and hardware.device cpu: no dropped-card alarm) would judge an NPU host
    assert out.stdout.strip().splitlines()[-1] == "{} False True ['health'] [] None"


def fake_nvidia_smi(bin_dir: Path) -> Path:
    """An `nvidia-smi` on PATH that answers the two CSV queries with fixture output (the driver's tool's format)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    fix = FIX / "health" / "nvidia-smi"
    exe.write_text(
        '#!/bin/sh\ncase "$1" in\n'
        f"  --query-gpu=*) cat '{fix / 'query-gpu.csv'}';;\n"
        f"  --query-compute-apps=*) cat '{fix / 'query-compute-apps.csv'}';;\n"
        "  *) exit 2;;\nesac\n"
    )
    exe.chmod(0o755)
    return bin_dir


def test_cuda_health_from_nvidia_smi_without_any_device_context(cfg, tmp_path):
    """collect() asks nvidia-smi only: it never imports torch (so it can create no CUDA/NPU context, nor call
    mem_get_info on a GPU a job is using); the alarms come from nvidia-smi's own figures."""
    bin_dir = fake_nvidia_smi(tmp_path / "bin")
    code = (
        "import sys, json; from tasks.config import load_config; from tasks.stages import health; "
        "cfg = load_config('demo-cpu'); cfg.hardware.device = 'cuda'; s = health.collect(cfg); "
        "print(json.dumps({'torch': 'torch' in sys.modules, 'backend': s['backend'], "
        "'checks': health.assess(s, cfg, last_seen=2), 'metrics': health.metrics(s)}))"
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
    }
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] is False  # no torch: no device context is possible
    assert got["backend"] == {"kind": "cuda", "device_count": 2}
    checks = {c["name"]: c for c in got["checks"]}
    assert checks["temperature"]["status"] == "fail" and "GPU 1 at 93 C" in checks["temperature"]["detail"]
    assert (
        checks["hbm"]["status"] == "fail"
        and "GPU 1 memory 80100/81559 MB with no process" in checks["hbm"]["detail"]
        and "GPU 0" not in checks["hbm"]["detail"]
    )  # GPU 0 is full but busy
    assert checks["devices"]["status"] == "ok" and "2 GPUs (nvidia-smi)" in checks["devices"]["detail"]
    assert got["metrics"]["gpu0.util_pct"] == 97 and "gpu1.power_w" not in got["metrics"]


def test_configured_devices_missing_from_the_tools_is_an_alarm(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither npu-smi nor nvidia-smi here
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    cfg.hardware.device = "npu"
    checks = by_name(health.assess(health.collect(cfg), cfg))
    assert checks["backend"]["status"] == "fail" and "npu-smi lists no device" in checks["backend"]["detail"]


def test_health_runs_through_the_runner(cfg, tmp_path, monkeypatch):
    """Like every stage: run_stage writes <run-dir>/health.json (ok, and the failure record with the one-line cause
    on an alarm), holds the run-directory lock, and refuses a moved run directory; the CLI runs it too."""
    import json

    from tasks import runner

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    cfg.tracking.enabled = False
    cfg.hardware.min_host_memory_gb = cfg.hardware.min_free_disk_gb = 0.01
    calls = []
    real = runner.run_stage
    monkeypatch.setattr(runner, "run_stage", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    result = health.run_health(cfg, tmp_path / "run")
    assert calls == ["health"]
    written = json.loads((tmp_path / "run" / "health.json").read_text())
    assert written["stage"] == "health" and written["status"] == result["status"] and "seconds" in written
    assert {c["name"] for c in written["checks"]} >= {"disk", "host-memory"}
    assert (tmp_path / "run" / "health" / "sample.json").is_file() and (tmp_path / "run" / ".run-dir").is_file()

    cfg.hardware.min_free_disk_gb = 1e9
    with pytest.raises(StageError) as err:
        health.run_health(cfg, tmp_path / "run")
    failed = json.loads((tmp_path / "run" / "health.json").read_text())
    assert failed["status"] == "failed" and failed["error"] == str(err.value)
    assert failed["error"].startswith("health alarm: disk: ") and "\n" not in failed["error"]

    (tmp_path / "run").rename(tmp_path / "moved")  # the runner's own check, so it is the runner that ran
    with pytest.raises(StageError, match="was copied or moved"):
        health.run_health(cfg, tmp_path / "moved")

    env = {**os.environ, "PYTHONPATH": str(REPO), "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tasks",
            "health",
            "--no-tracking",
            "--run-dir",
            str(tmp_path / "cli"),
            "--set",
            "hardware.min_free_disk_gb=1e6",  # the field's maximum (1 PB): an alarm on any disk
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: health alarm: disk: "), out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1
    assert json.loads((tmp_path / "cli" / "health.json").read_text())["status"] == "failed"
