"""The MLflow-link plugin, loaded by Airflow's real plugins manager, answering the real extra-links API.

A child process gets its own AIRFLOW_HOME (Airflow reads its config once per process): it migrates a SQLite
metadata DB, runs a tiny DAG with `dag.test()` (a stage-like task returning a result dict with `mlflow_run_id`, and
a task returning a plain value), then asks the API server's route
`GET /api/v2/dags/{dag}/dagRuns/{run}/taskInstances/{task}/links` through FastAPI's TestClient, exactly what the
UI's task page calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN_ID = "0f3c9a5e1d2b4c6a8e7f9b1d3c5a7e90"

PROBE_DAG = f'''
from airflow.sdk import dag, task


@dag(schedule=None, catchup=False)
def link_probe():
    @task
    def train():
        return {{"stage": "train", "status": "ok", "summary": "loss 2.1", "mlflow_run_id": "{RUN_ID}",
                "mlflow_experiment_id": "3"}}

    @task
    def plain():
        return 42

    train() >> plain()


link_probe()
'''


def probe(home: Path) -> dict:
    """Runs in the child: returns what the plugins manager loaded and what the links route answered."""
    from fastapi.testclient import TestClient

    from airflow import plugins_manager
    from airflow.api_fastapi.app import create_app
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils.db import initdb

    initdb()
    dag = DagBag(str(home / "dags")).get_dag("link_probe")
    dag_run = dag.test()
    plugins = {p.name: str(p.source) for p in plugins_manager._get_plugins()[0]}
    client = TestClient(create_app("core"))  # the API server's public API (the UI's); not the execution API
    links = {}
    for task_id in ("train", "plain"):
        r = client.get(f"/api/v2/dags/link_probe/dagRuns/{dag_run.run_id}/taskInstances/{task_id}/links")
        links[task_id] = [r.status_code, r.json()]
    return {"plugins": plugins, "links": links, "state": str(dag_run.state)}


def run_probe(tmp_path: Path, ui_url: str | None) -> dict:
    home = tmp_path / "airflow"
    (home / "dags").mkdir(parents=True)
    (home / "dags" / "link_probe.py").write_text(PROBE_DAG)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_UI_URL"))}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
            # The links route requires an authenticated user; every request is an admin here.
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "PYTHONPATH": str(REPO),
        }
    )
    if ui_url:
        env["MLFLOW_UI_URL"] = ui_url
    out = subprocess.run([sys.executable, __file__, str(home)], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_link_resolves_from_the_stage_xcom(tmp_path):
    got = run_probe(tmp_path, ui_url="http://mlflow.example:5005/")
    assert got["plugins"]["mlflow_link"].endswith("mlflow_link.py")
    assert got["state"].endswith("success"), got
    status, body = got["links"]["train"]
    assert status == 200, body
    # The run's own page in its experiment, in the model-training view (tasks.tracking.UI_VIEW).
    want = f"http://mlflow.example:5005/#/experiments/3/runs/{RUN_ID}?workflowType=machine_learning"
    assert body["extra_links"] == {"MLflow run": want}
    # A task whose return value carries no run id shows the button disabled (no URL).
    status, body = got["links"]["plain"]
    assert status == 200 and body["extra_links"] == {"MLflow run": None}, body


def test_url_helpers_default_and_bad_values(monkeypatch):
    sys.path.insert(0, str(REPO / "plugins"))
    try:
        import mlflow_link
    finally:
        sys.path.remove(str(REPO / "plugins"))
    monkeypatch.delenv("MLFLOW_UI_URL", raising=False)
    monkeypatch.delenv("MLFLOW_PORT", raising=False)
    assert mlflow_link.mlflow_run_url("abc") == "http://127.0.0.1:5000/#/runs/abc"
    assert mlflow_link.run_id_from_result({"mlflow_run_id": " abc "}) == "abc"
    for value in (None, 42, "abc", {"mlflow_run_id": None}, {"mlflow_run_id": ""}, {"status": "ok"}):
        assert mlflow_link.run_id_from_result(value) is None


if __name__ == "__main__":
    print(json.dumps(probe(Path(sys.argv[1]))), flush=True)
    # The answer is out: skip the interpreter's teardown of Airflow's thousands of API models (~4 CPU s).
    os._exit(0)
