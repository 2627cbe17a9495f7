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
    """The stage's own one-line cause when it recorded one, else the exception's first line."""
    path = default_run_dir(dag_id, run_id) / f"{stage}.json"
    if path.is_file():
        try:
            recorded = read_json(path).get("error")
        except (OSError, ValueError):
            recorded = None
        if recorded:
            return recorded
    text = str(exception or "unknown failure")
    return text.splitlines()[0] if text else type(exception).__name__


def record_failure(dag_id: str, run_id: str, stage: str, exception=None) -> dict:
    note = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dag_id": dag_id,
        "run_id": run_id,
        "stage": stage,
        "cause": failure_cause(dag_id, run_id, stage, exception),
    }
    deliver(note)
    return note


def deliver(note: dict) -> None:
    path = var_dir() / "notifications.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(note) + "\n")
    log.error("%s %s failed at %s: %s", note["dag_id"], note["run_id"], note["stage"], note["cause"])
