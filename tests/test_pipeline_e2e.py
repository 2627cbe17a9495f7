"""The whole main DAG through `airflow dags test` on CPU (the ci-tiny preset), read back from MLflow."""
import json
import os
import subprocess
from pathlib import Path

import mlflow
import pytest

from tasks.stages import STAGES

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_dags_test_runs_every_stage(tmp_path, airflow_db):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"), "MLFLOW_TRACKING_URI": uri}
    conf = json.dumps({"preset": "ci-tiny"})
    cmd = f"source scripts/airflow-env.sh && airflow dags test llm_pipeline --conf '{conf}'"
    out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=1200, env=env)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]

    run_dirs = list((tmp_path / "var" / "runs" / "llm_pipeline").iterdir())
    assert len(run_dirs) == 1
    results = {s: json.loads((run_dirs[0] / f"{s}.json").read_text()) for s in STAGES}
    assert all(r["status"] in ("ok", "warn") for r in results.values()), {s: r["summary"] for s, r in results.items()}

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("llm-pipeline")
    parents = client.search_runs([exp.experiment_id], "tags.`pipeline.kind` = 'parent'")
    assert len(parents) == 1
    assert parents[0].info.status == "FINISHED" and parents[0].data.tags["pipeline.outcome"] == "success"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert sorted(c.data.tags["pipeline.stage"] for c in children) == sorted(STAGES)
    assert {c.info.run_id for c in children} == {r["mlflow_run_id"] for r in results.values()}
    assert "Evaluation & registry" in log  # the summary table was printed


@pytest.mark.slow
def test_failed_stage_stops_the_run_and_notifies_its_cause(tmp_path, airflow_db):
    var = tmp_path / "var"
    env = {**os.environ, "LLM_PIPELINE_VAR_DIR": str(var), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"}
    conf = json.dumps({"preset": "ci-tiny", "data_inputs": [str(tmp_path / "no-such-corpus")]})
    cmd = f"source scripts/airflow-env.sh && airflow dags test llm_pipeline --conf '{conf}'"
    out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    run_dir = next((var / "runs" / "llm_pipeline").iterdir())
    shard = json.loads((run_dir / "shard.json").read_text())
    assert shard["status"] == "failed" and "no-such-corpus" in shard["error"], shard
    assert not (run_dir / "smoke.json").exists()  # nothing downstream of a failed stage ran
    notes = [json.loads(line) for line in (var / "notifications.jsonl").read_text().splitlines()]
    assert [(n["stage"], n["cause"]) for n in notes] == [("shard", shard["error"])]
    assert "Evaluation & registry" in out.stdout + out.stderr  # the summary still printed


@pytest.mark.slow
def test_data_dag_publishes_only_new_shard_sets(tmp_path, airflow_db):
    """llm_data attaches a new shard set to the asset alias that schedules llm_pipeline; a cache hit publishes
    nothing, so a re-shard that changed nothing never starts a retraining."""
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session
    from sqlalchemy import select

    env = {**os.environ, "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}"}
    cmd = "source scripts/airflow-env.sh && airflow dags test llm_data --conf '{\"preset\": \"ci-tiny\"}'"
    results = []
    for _ in range(2):
        out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        run_dir = max((tmp_path / "var" / "runs" / "llm_data").iterdir(), key=lambda p: p.stat().st_mtime)
        results.append(json.loads((run_dir / "shard.json").read_text()))
    assert [r["cache_hit"] for r in results] == [False, True]
    with create_session() as session:
        events = [e for e in session.scalars(select(AssetEvent)) if str(tmp_path) in e.asset.uri]
        assert [(e.asset.uri, e.extra.get("manifest_digest")) for e in events] == \
            [(results[0]["asset_uri"], results[0]["manifest_digest"])]
