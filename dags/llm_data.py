"""
### LLM data refresh: re-shard the corpus daily; publish a new shard set as an Asset event

The build fans out: one `shard_partition` task per partition of the corpus (files, size-balanced; the `partitions`
Param, or one per 128 MB), one `shard_write` task per range of shards, then `shard` checks every output, writes the
manifest and publishes the set. The shards are the same bytes however many partitions or workers built them.
A cache hit (same corpus contents, same config) publishes nothing. A new shard-set version is attached to the
`llm-shard-set` alias, which schedules `llm_pipeline` (data-aware retraining). The main DAG shards too (a cache
hit then), but never publishes, so a run can never trigger itself.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Asset, AssetAlias, Param, dag, task

from tasks.bounds import task_timeout_s
from tasks.config import load_config
from tasks.notify import notify_failure
from tasks.pipeline import DATA_PARAMS, bound_from_run_config, end_parent_run, param_schemas
from tasks.shard_fanout import shard_fanout

SHARD_SET = AssetAlias("llm-shard-set")
SHARD_TIMEOUT_S = task_timeout_s("shard", load_config())  # the default preset's; again from the run's at task start


@dag(
    dag_id="llm_data",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    doc_md=__doc__,
    tags=["llm", "data"],
    params={n: Param(**s) for n, s in param_schemas().items() if n in DATA_PARAMS},
    on_success_callback=end_parent_run(success=True),  # the MLflow parent run ends with the DAG run's outcome
    on_failure_callback=end_parent_run(success=False),
)
def llm_data():
    @task(
        task_id="shard",
        outlets=[SHARD_SET],
        trigger_rule="none_failed",
        execution_timeout=pendulum.duration(seconds=SHARD_TIMEOUT_S),
        pre_execute=bound_from_run_config,
        on_failure_callback=notify_failure,  # the one-line cause in var/notifications.jsonl, as llm_pipeline's tasks
        doc_md="Check every partition's and write range's output, write the manifest, publish the shard set; emit "
        "the asset event when it is new. A missing or bad output is named and nothing is published.",
    )
    def shard(*, outlet_events=None) -> dict:
        from airflow.sdk import get_current_context

        from tasks.errors import StageError, os_error_cause
        from tasks.logs import to_logging
        from tasks.pipeline import DATA_DAG_SHARD_ARGS, failure, run_for_dag_run

        ctx = get_current_context()
        with to_logging():  # as the fan-out's tasks and llm_pipeline's: a known cause is the log's one ERROR line
            try:
                result = run_for_dag_run(
                    "shard",
                    dict(ctx["params"]),
                    ctx["dag"].dag_id,
                    ctx["run_id"],
                    ctx["ti"].try_number,  # on the stage's MLflow run: a cleared task's try 2 is told apart
                    args=DATA_DAG_SHARD_ARGS,
                )
            except StageError as e:
                raise failure(str(e)) from None
            except OSError as e:  # a full or read-only disk: the path and the errno's meaning
                raise failure(os_error_cause(e)) from None
        if not result.get("cache_hit", False):
            outlet_events[SHARD_SET].add(
                Asset(uri=result["asset_uri"], name=f"llm-{result['version']}"),
                extra={"manifest_digest": result.get("manifest_digest", "")},
            )
        return result

    # The fan-out's tasks carry no failure callback: a task with one whose process is killed (a worker lost
    # mid-partition, retried) is handed to the DAG processor for its callback before its retry is scheduled
    # (airflow/jobs/scheduler_job_runner.py: TaskCallbackRequest), which `airflow dags test --use-executor` never
    # runs (tests/test_shard_fanout.py waited for ever); the `shard` task above notifies the stage's failure.
    shard_fanout(shard(), SHARD_TIMEOUT_S)


llm_data()
