"""The scale-out profile, all real on this host (tests/celery_cluster.py): PostgreSQL + Redis (Debian packages),
Airflow's api-server, scheduler and dag-processor on the CeleryExecutor, two Celery workers, and an MLflow server
on PostgreSQL serving the artifacts. One cluster is shared by the module's tests (they run in file order; the
killed-worker test is last). Worker w2 also consumes the device queue of the preset (hardware.device_queue), as an
NPU node's worker would."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tasks.launch.placement import DEVICE_STAGES
from tasks.stages import STAGES

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from celery_cluster import Cluster, free_port  # noqa: E402

DEVICE_QUEUE = "npu-node-1"
PROBE_DAGS = REPO / "tests" / "fixtures" / "dags" / "celery_probe.py"


def check_services(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_services.py")],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_unreachable_broker_and_db_are_named_in_one_line_each():
    """No server needed: nothing listens on these ports. Which service, where (no password), the setting."""
    db, broker = free_port(), free_port()
    out = check_services(
        {
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql+psycopg2://airflow:s3cret@127.0.0.1:{db}/airflow",
            "AIRFLOW__CELERY__BROKER_URL": f"redis://:s3cret@127.0.0.1:{broker}/0",
            "AIRFLOW__CELERY__RESULT_BACKEND": f"db+postgresql+psycopg2://airflow:s3cret@127.0.0.1:{db}/airflow",
        }
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 3, out.stderr
    assert lines[0].startswith(f"metadata DB unreachable at postgresql+psycopg2://airflow@127.0.0.1:{db}/airflow: ")
    assert lines[1].startswith(f"Celery broker unreachable at redis://127.0.0.1:{broker}/0: ")
    assert lines[2].startswith("Celery result backend unreachable at db+postgresql+psycopg2://airflow@127.0.0.1:")
    assert "Connection refused" in lines[0] and "AIRFLOW__CELERY__BROKER_URL" in lines[1]
    assert "s3cret" not in out.stderr


def test_device_stages_go_to_the_presets_device_queue(tmp_path):
    """The DAG file parsed with a site's preset file ($LLM_PIPELINE_PRESET, a path outside configs/) that names a
    device queue: the device stages carry it, the rest stay on Airflow's default queue; without it, none moves."""
    preset = yaml.safe_load((REPO / "configs" / "ci-tiny.yaml").read_text())
    preset["hardware"]["device_queue"] = DEVICE_QUEUE
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(preset))
    code = (
        "import json; from airflow.dag_processing.dagbag import DagBag; "
        f"bag = DagBag(dag_folder={str(REPO / 'dags' / 'llm_pipeline.py')!r}); "
        "assert not bag.import_errors, bag.import_errors; "
        "print(json.dumps({t.task_id: t.queue for t in bag.dags['llm_pipeline'].tasks}))"
    )

    def queues(env: dict) -> dict:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO), **env},
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    routed = queues({"LLM_PIPELINE_PRESET": str(tmp_path / "site.yaml")})
    assert {k for k, q in routed.items() if q == DEVICE_QUEUE} == set(DEVICE_STAGES)
    assert {q for k, q in routed.items() if k not in DEVICE_STAGES} == {"default"}
    assert set(queues({"LLM_PIPELINE_PRESET": "ci-tiny"}).values()) == {"default"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("redis-server") is None or not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.fail("PostgreSQL/Redis not installed: run scripts/install-services.sh (make test does)")
    root = tmp_path_factory.mktemp("celery")
    preset = yaml.safe_load((REPO / "configs" / "ci-tiny.yaml").read_text())
    preset["hardware"]["device_queue"] = DEVICE_QUEUE
    (root / "ci-tiny-celery.yaml").write_text(yaml.safe_dump(preset))
    c = Cluster(
        root / "cluster",
        dags=[REPO / "dags" / "llm_pipeline.py", PROBE_DAGS],
        extra_env={"LLM_PIPELINE_PRESET": str(root / "ci-tiny-celery.yaml")},
    )
    try:
        c.start(workers={"w1": "default", "w2": f"default,{DEVICE_QUEUE}"})
        yield c
    finally:
        c.stop()


@pytest.mark.slow
def test_a_down_broker_is_named_while_the_db_is_up(cluster):
    out = check_services({**cluster.env, "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"})
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("Celery broker unreachable at redis://127.0.0.1:")
    assert check_services(cluster.env).returncode == 0  # the cluster's own settings: all reachable


@pytest.mark.slow
def test_mapped_tasks_spread_over_both_workers(cluster):
    run = cluster.trigger("celery_fanout_probe", {"items": 6, "hold_s": 3})
    assert cluster.wait_run("celery_fanout_probe", run, 600) == "success"
    tis = cluster.task_instances("celery_fanout_probe", run)
    mapped = [t for t in tis if t["task_id"] == "work"]
    assert sorted(t["map_index"] for t in mapped) == list(range(6))
    assert {t["hostname"] for t in mapped} == {"w1", "w2"}, [(t["map_index"], t["hostname"]) for t in mapped]
    reduced = cluster.get(
        f"/api/v2/dags/celery_fanout_probe/dagRuns/{run}/taskInstances/reduce/xcomEntries/return_value"
    )["value"]
    assert reduced["items"] == list(range(6)) and reduced["workers"] == ["w1", "w2"]
    # bench/bench_fanout.py's reading of a fanned-out run (what it measures once the data DAG maps partitions)
    spec = importlib.util.spec_from_file_location("bench_fanout", REPO / "bench" / "bench_fanout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    t = bench.timings(tis, cluster.get(f"/api/v2/dags/celery_fanout_probe/dagRuns/{run}"))
    assert t["partitions"] == 6 and t["workers"] == ["w1", "w2"] and 0 < t["reduce_s"] < t["wall_s"]


@pytest.fixture(scope="module")
def pipeline_run(cluster):
    run = cluster.trigger("llm_pipeline", {})  # the preset: $LLM_PIPELINE_PRESET (ci-tiny + the device queue)
    return run, cluster.wait_run("llm_pipeline", run, 1500)


@pytest.mark.slow
def test_ci_tiny_pipeline_on_celery_with_device_stages_on_the_device_queue(cluster, pipeline_run):
    run, state = pipeline_run
    tis = {t["task_id"]: t for t in cluster.task_instances("llm_pipeline", run)}
    assert state == "success", {k: t["state"] for k, t in tis.items()}
    assert {k for k, t in tis.items() if t["state"] == "success"} == {*STAGES, "summary", "pipeline_ok"}
    for stage in DEVICE_STAGES:  # only w2 consumes the device queue
        assert (tis[stage]["queue"], tis[stage]["hostname"]) == (DEVICE_QUEUE, "w2"), stage
    for task_id in set(tis) - set(DEVICE_STAGES):
        assert tis[task_id]["queue"] == "default", task_id


@pytest.mark.slow
def test_mlflow_runs_and_registry_live_in_postgresql_with_served_artifacts(cluster, pipeline_run):
    import mlflow
    import psycopg2

    run, state = pipeline_run
    assert state == "success"
    client = mlflow.MlflowClient(cluster.mlflow_url)
    exp = client.get_experiment_by_name("llm-pipeline")
    assert exp.artifact_location.startswith("mlflow-artifacts:")  # through the server, not a worker's disk

    def parent_run():
        runs = client.search_runs([exp.experiment_id], f"tags.`airflow.run_id` = '{run}'")
        return next(p for p in runs if p.data.tags.get("pipeline.kind") == "parent")

    # The DAG's success callback ends the parent run; Airflow 3 runs DAG callbacks in the dag-processor, after the
    # run's state is already success: wait for it (bounded).
    deadline = time.monotonic() + 180
    while (parent := parent_run()).info.status == "RUNNING" and time.monotonic() < deadline:
        time.sleep(2)
    assert parent.info.status == "FINISHED" and parent.data.tags["pipeline.outcome"] == "success"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["pipeline.stage"] for c in children) == sorted(STAGES)
    ev = json.loads(next((cluster.var / "runs" / "llm_pipeline").glob("*/evaluate.json")).read_text())
    assert ev["passed"] and ev.get("version"), ev
    model = client.get_registered_model(ev["registered_model"])
    assert ev["aliases"] == {"candidate": ev["version"], "champion": ev["version"]}  # the first gated version
    assert {k: str(v) for k, v in model.aliases.items()} == ev["aliases"]
    assert client.get_model_version_by_alias(ev["registered_model"], "champion").status == "READY"

    conn = psycopg2.connect(cluster.mlflow_db_url.replace("postgresql+psycopg2", "postgresql"))
    with conn, conn.cursor() as cur:  # the backend store is PostgreSQL: the same rows, read with SQL
        cur.execute("SELECT count(*) FROM runs WHERE run_uuid = %s AND status = 'FINISHED'", (parent.info.run_id,))
        assert cur.fetchone()[0] == 1
        cur.execute("SELECT alias, version FROM registered_model_aliases WHERE name = %s", (ev["registered_model"],))
        assert sorted(cur.fetchall()) == [("candidate", int(ev["version"])), ("champion", int(ev["version"]))]
    conn.close()
    served = [p for p in cluster.artifacts.rglob("*") if p.is_file()]
    assert any(p.name == "config.json" for p in served), served[:10]  # the parent's config, stored by the server
    assert not (cluster.var / "mlartifacts").exists()


@pytest.mark.slow
def test_a_killed_worker_s_task_is_retried_on_the_other_worker(cluster, tmp_path):
    """Last in the module: it kills a worker. SIGKILL to the worker's process group mid-task; the task stops
    heartbeating, the scheduler fails that try and the retry runs on the surviving worker."""
    run = cluster.trigger("celery_kill_probe", {"marker_dir": str(tmp_path), "hold_s": 600})
    first = tmp_path / "try-1"
    deadline = time.monotonic() + 300
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert first.exists(), cluster.task_instances("celery_kill_probe", run)
    victim = first.read_text()
    survivor = {"w1": "w2", "w2": "w1"}[victim]
    cluster.kill_worker(victim)
    assert cluster.wait_run("celery_kill_probe", run, 600) == "success"
    assert (tmp_path / "try-2").read_text() == survivor
    tries = {t["try_number"]: t for t in cluster.tries("celery_kill_probe", run, "hold")}
    assert tries[1]["hostname"] == victim and tries[1]["state"] == "failed"
    assert tries[2]["hostname"] == survivor and tries[2]["state"] == "success"
