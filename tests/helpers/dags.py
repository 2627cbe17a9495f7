"""`airflow dags test` of one DAG in a temporary var dir and MLflow store (the orchestration and e2e tests)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dags_test(dag_id: str, conf: dict, tmp_path: Path, extra_env: dict | None = None, timeout: int = 600):
    env = {
        **os.environ,
        "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}",
        **(extra_env or {}),
    }
    cmd = f"source scripts/airflow-env.sh && airflow dags test {dag_id} --conf '{json.dumps(conf)}'"
    return subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
