"""
### LLM health: hourly device and host check of this training host

Samples the chips with the vendors' tools only (`npu-smi info`, `nvidia-smi`: never a device context, so a
running training job is not disturbed) and the host (memory, disk, NTP clock) and logs them
to the MLflow experiment `llm-pipeline-health` (one run per check: temperatures, HBM fill, clock offset over time).
The task **fails with a one-line cause** on an alarm: a chip in alarm or at/above `hardware.max_device_temp_c`, a
dropped card, HBM full with no process on the chip, a clock beyond `hardware.max_clock_offset_ms` (multi-node),
or disk/host memory below the minimums. Logic: `tasks/stages/health.py`, run by `runner.run_stage` like every stage
(result file `<run-dir>/health.json`, lock, one-line error; also `python -m tasks health`).
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Param, dag, task

from tasks.notify import notify_failure


def _queue() -> str | None:
    """The Celery queue of the health task: the env probe's (tasks.launch.placement.celery_queue), i.e. the preset's
    hardware.device_queue with launcher local, so the check samples the device host as the device stages run there
    (None: Airflow's default queue). Read at parse time from the site's preset, as the pipeline's stage tasks do."""
    from tasks.config import load_config
    from tasks.launch.placement import celery_queue

    return celery_queue("env", load_config())


QUEUE = _queue()


@dag(
    dag_id="llm_health",
    schedule="@hourly",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    doc_md=__doc__,
    tags=["llm", "ascend", "health"],
    params={
        "preset": Param(
            None,
            type=["null", "string"],
            title="Configuration preset",
            description="The preset whose hardware section sets the alarm thresholds; empty: the site's default "
            "($LLM_PIPELINE_PRESET where the task runs, else demo-cpu), as every other stage uses.",
        )
    },
    default_args={"retries": 0},
)
def llm_health():
    @task(
        task_id="health",
        doc_md="Sample devices and host, log to MLflow, fail with the cause on an alarm.",
        on_failure_callback=notify_failure,  # an alarm's one line in var/notifications.jsonl, as every stage's
        **({"queue": QUEUE} if QUEUE else {}),
    )
    def health() -> dict:
        from airflow.sdk import get_current_context

        from tasks.config import load_config
        from tasks.errors import StageError
        from tasks.logs import to_logging
        from tasks.pipeline import failure
        from tasks.stages.health import run_health
        from tasks.runner import default_run_dir

        ctx = get_current_context()
        with to_logging():  # the task log keeps each line's level (Airflow logs stderr at ERROR)
            try:
                cfg = load_config(ctx["params"]["preset"] or None)  # None: $LLM_PIPELINE_PRESET, else demo-cpu
                return run_health(
                    cfg,
                    default_run_dir(ctx["dag"].dag_id, ctx["run_id"]),
                    tags={"airflow.dag_id": ctx["dag"].dag_id, "airflow.run_id": ctx["run_id"]},
                )
            except StageError as e:
                raise failure(str(e)) from None  # an alarm, one line: a retry an hour later is the next run

    health()


llm_health()
