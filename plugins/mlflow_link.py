"""Airflow plugin: an "MLflow run" button on every task whose return value names its MLflow run.

Each pipeline stage returns its result dict (it becomes the task's `return_value` XCom) with the key
`mlflow_run_id`. A *global* operator link works for the @task-decorated stages without a custom operator class;
in Airflow 3 global links are resolved on the API server, so `get_link` reads the XCom from the metadata database
there (the same way Airflow's own XComOperatorLink does). Tasks without a run id get no link (empty URL).

The MLflow UI address is `tasks.tracking.ui_url()` of the pipeline's preset (LLM_PIPELINE_PRESET, else the
default) — the one setting the end-of-run summary also prints: tracking.ui_url when set, else MLFLOW_UI_URL (the API
server's environment; `make ui` sets it), else http://127.0.0.1:5000 (on $MLFLOW_PORT when set). The link is
`tasks.tracking.run_url()` with the run's experiment from the same result (`mlflow_experiment_id`): the API server
needs no access to the tracking store.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin
from airflow.sdk import BaseOperatorLink

RUN_ID_KEY = "mlflow_run_id"


def mlflow_run_url(run_id: str, experiment_id: str | None = None) -> str:
    """The run's MLflow page on the preset's tracking.ui_url() (a preset that does not load: the env/default), in
    the model-training view when the stage's result names the run's experiment."""
    from tasks.config import load_config
    from tasks.errors import ConfigError
    from tasks.tracking import run_url

    try:
        cfg = load_config()
    except ConfigError:
        cfg = None
    return run_url(run_id, cfg, experiment_id)


def run_id_from_result(value) -> str | None:
    """The MLflow run id from a stage's return value (a dict), or None for anything else."""
    if isinstance(value, dict) and isinstance(value.get(RUN_ID_KEY), str) and value[RUN_ID_KEY].strip():
        return value[RUN_ID_KEY].strip()
    return None


def stage_result(ti_key):
    """The task instance's `return_value` XCom, read from the metadata DB (runs on the API server)."""
    from airflow.models.xcom import XCOM_RETURN_KEY, XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.execute(
            XComModel.get_many(
                key=XCOM_RETURN_KEY,
                run_id=ti_key.run_id,
                dag_ids=ti_key.dag_id,
                task_ids=ti_key.task_id,
                map_indexes=ti_key.map_index,
            ).with_only_columns(XComModel.value)
        ).first()
    return None if row is None else XComModel.deserialize_value(row)


class MLflowRunLink(BaseOperatorLink):
    name = "MLflow run"

    def get_link(self, operator, *, ti_key) -> str:
        result = stage_result(ti_key)
        run_id = run_id_from_result(result)
        return mlflow_run_url(run_id, result.get("mlflow_experiment_id")) if run_id else ""


class MLflowLinkPlugin(AirflowPlugin):
    name = "mlflow_link"
    global_operator_extra_links = [MLflowRunLink()]
