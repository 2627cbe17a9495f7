"""Failure notifications with the stage's one-line cause.

Each failure is appended to var/notifications.jsonl and logged; an operator wires it to mail/chat by replacing
`deliver()` (or by an Airflow notifier reading the same line).
"""

from __future__ import annotations

import json
import logging
import time

from tasks.config import var_dir
from tasks.fsutil import read_json
from tasks.runner import default_run_dir

log = logging.getLogger(__name__)


def failure_cause(dag_id: str, run_id: str, stage: str, exception=None) -> str:
    """The failed try's one-line cause: a StageFailure's own (the task log's ERROR line; the stage's record may be an
    earlier try's or another mapped task's), a timeout's (the stage and the bound to raise), else the stage's record
    (a bug's, written by the runner with any CANN diagnosis), else the exception's first non-empty line. Never raises:
    it runs in the failure callback."""
    from tasks.errors import StageError
    from tasks.pipeline import StageFailure

    if isinstance(exception, StageFailure) and str(exception):
        return str(exception)
    text = next((line for line in str(exception or "").splitlines() if line.strip()), "")
    if stage == "shard" and type(exception).__name__ == "AirflowFailException" and text:
        return text  # a fan-out step's bug (tasks.shard_fanout._call): no runner record is its, shard.json another's
    if type(exception).__name__ == "AirflowTaskTimeout":  # "Timeout, PID: N" names neither the stage nor the fix
        return (
            f"{stage}: stopped at its Airflow execution_timeout ({text}); "
            "if it was only slow, raise its bound (timeouts.*)"
        )
    try:  # a relative $LLM_PIPELINE_VAR_DIR is a ConfigError here: the exception still names the cause
        recorded = read_json(default_run_dir(dag_id, run_id) / f"{stage}.json").get("error")
    except (OSError, ValueError, AttributeError, StageError):  # no record, unreadable, not an object
        recorded = None
    if recorded and isinstance(recorded, str):
        return recorded
    if not text:
        return type(exception).__name__ if exception is not None else "unknown failure"
    return text


def record_failure(
    dag_id: str, run_id: str, stage: str, exception=None, task_id: str | None = None, map_index: int = -1
) -> dict:
    """The note of one failed try: `task_id` and `map_index` (-1: not mapped) say which task, e.g. which partition of
    the shard fan-out (`shard_partition`, map_index 3), where `stage` alone says only "shard"."""
    note = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dag_id": dag_id,
        "run_id": run_id,
        "stage": stage,
        "task_id": task_id or stage,
        "map_index": map_index,
        "cause": failure_cause(dag_id, run_id, stage, exception),
    }
    deliver(note)
    return note


def deliver(note: dict) -> None:
    """Log the note (the task log's line) and append it to var/notifications.jsonl; a var dir that cannot take it
    (relative, read-only, full) is one warning line, never a traceback in the failure callback."""
    from data_prep.errors import DataPrepError
    from tasks.errors import os_error_cause

    log.error("%s %s failed at %s: %s", note["dag_id"], note["run_id"], note["stage"], note["cause"])
    try:
        path = var_dir() / "notifications.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(note) + "\n")
    except DataPrepError as e:
        log.warning("notification not appended to notifications.jsonl: %s", e)
    except OSError as e:
        log.warning("notification not appended to notifications.jsonl: %s", os_error_cause(e))


def notify_failure(context) -> None:
    """Airflow's on_failure_callback of every stage task (llm_pipeline's, llm_data's shard tasks, llm_health's health):
    the failed task's notification with its one-line cause."""
    ti = context["ti"]
    stage = "shard" if ti.task_id.startswith("shard_") else ti.task_id  # the shard stage's fan-out tasks
    map_index = getattr(ti, "map_index", None)
    record_failure(
        ti.dag_id,
        context["run_id"],
        stage,
        context.get("exception"),
        task_id=ti.task_id,
        map_index=-1 if map_index is None else map_index,
    )
