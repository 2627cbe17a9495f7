"""What an operator sees when a DAG task fails: the failure notification's one-line cause (tasks/notify.py) and the
documented execution_timeout. Function level, real exceptions (Airflow's AirflowTaskTimeout, the DAG's
StageFailure), no DAG run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tasks import notify
from tasks.pipeline import RetryableStageFailure, StageFailure
from tasks.runner import default_run_dir

REPO = Path(__file__).resolve().parent.parent
DAG, RUN = "llm_pipeline", "manual__2026-01-01T00:00:00+00:00"


def _record(stage: str, record) -> None:
    run_dir = default_run_dir(DAG, RUN)  # under $LLM_PIPELINE_VAR_DIR, set by the test
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"{stage}.json").write_text(json.dumps(record))


def test_a_relative_var_dir_is_notified_in_one_line_not_raised(tmp_path, monkeypatch, caplog):
    # The callback used to raise ConfigError from default_run_dir (Airflow: "Failed to run task callback" + traceback,
    # and no notification at all); now the note carries the task's own cause and the log says why it was not appended.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", "rel-var")
    cause = "LLM_PIPELINE_VAR_DIR=rel-var is a relative path (…); give an absolute one"
    with caplog.at_level(logging.WARNING, logger="tasks.notify"):
        note = notify.record_failure(DAG, RUN, "env", StageFailure(cause))
    assert note["cause"] == cause
    assert "notification not appended" in caplog.text and "relative path" in caplog.text
    assert not (tmp_path / "rel-var").exists()  # nothing written under a working-directory-relative path


def test_a_var_dir_that_cannot_take_the_note_is_a_warning(tmp_path, monkeypatch, caplog):
    var = tmp_path / "var"
    var.write_text("a file where the var dir belongs")
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(var))
    with caplog.at_level(logging.WARNING, logger="tasks.notify"):
        note = notify.record_failure(DAG, RUN, "smoke", StageFailure("smoke: loss did not fall"))
    assert note["cause"] == "smoke: loss did not fall"
    assert "notification not appended" in caplog.text


def test_the_try_s_own_cause_wins_over_an_earlier_try_s_record(tmp_path, monkeypatch):
    # try 1 failed retryably and left train.json; try 2 failed before the runner wrote a record of its own: the
    # notification must name try 2's cause (the task log's ERROR line), not try 1's.
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    _record("train", {"stage": "train", "status": "failed", "error": "rank 1 was killed (SIGKILL)"})
    now = "run directory … is in use by pid 7 on host-a (stage train, since …)"
    assert notify.failure_cause(DAG, RUN, "train", StageFailure(now)) == now
    assert notify.failure_cause(DAG, RUN, "train", RetryableStageFailure(now)) == now
    notify.record_failure(DAG, RUN, "train", StageFailure(now))
    notes = (tmp_path / "var" / "notifications.jsonl").read_text().splitlines()
    assert [json.loads(n)["cause"] for n in notes] == [now]
    # two mapped shard tasks failing at once: each one's own cause, not the shard.json the other wrote last
    _record("shard", {"stage": "shard", "status": "failed", "error": "shard: partition 1: b.jsonl.gz is truncated"})
    mine = "shard: partition 0: a.jsonl.gz is truncated"
    assert notify.failure_cause(DAG, RUN, "shard", StageFailure(mine)) == mine
    # a bug in another partition's step (shard_fanout._call's AirflowFailException): its own line, not partition 1's
    from airflow.sdk.exceptions import AirflowFailException

    bug = "shard: partition: KeyError: 'job' (traceback below)"
    assert notify.failure_cause(DAG, RUN, "shard", AirflowFailException(bug)) == bug


def test_a_bug_takes_the_runner_s_record_a_timeout_names_its_bound(tmp_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException, AirflowTaskTimeout

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    # a bug in the stage: the runner's record carries the CANN diagnosis the task's AirflowFailException lacks
    recorded = "RuntimeError: EI0006 … (CANN: HCCL socket build timed out; fix: …)"
    _record("smoke", {"stage": "smoke", "status": "failed", "error": recorded})
    bug = AirflowFailException("smoke: RuntimeError: EI0006 … (traceback below and in …/smoke.json)")
    assert notify.failure_cause(DAG, RUN, "smoke", bug) == recorded
    # Airflow's own timeout ("Timeout, PID: N"): the stage and the bound, whatever another mapped task recorded
    _record("shard", {"stage": "shard", "status": "failed", "error": "shard: partition 1: bad.jsonl.gz is truncated"})
    for stage in ("train", "shard"):
        cause = notify.failure_cause(DAG, RUN, stage, AirflowTaskTimeout("Timeout, PID: 12"))
        assert cause.startswith(f"{stage}: stopped at its Airflow execution_timeout") and "timeouts." in cause, cause


def test_a_blank_first_line_or_a_record_that_is_no_object_is_not_an_empty_cause(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    assert notify.failure_cause(DAG, RUN, "plan", RuntimeError("\nplan: no layout fits")) == "plan: no layout fits"
    _record("plan", [1])  # a record that is JSON but no object: used to raise AttributeError
    assert notify.failure_cause(DAG, RUN, "plan", RuntimeError("plan: boom")) == "plan: boom"


def test_operations_md_states_the_execution_timeout_the_code_sets():
    from tasks.bounds import GRACE_S, stage_timeout_s, task_timeout_s
    from tasks.config import load_config

    cfg = load_config("ci-tiny")
    assert task_timeout_s("train", cfg) == stage_timeout_s("train", cfg) + GRACE_S
    text = " ".join((REPO / "docs" / "operations.md").read_text().split())
    assert f"`execution_timeout` of that bound + {GRACE_S} s" in text
    assert "Train's is `train.steps`" not in text  # the old sentence gave the bound as the execution_timeout


def test_every_stage_task_of_every_dag_notifies_its_failure():
    """llm_data's shard tasks and llm_health's health task (its alarms) had no failure callback: their failures never
    reached var/notifications.jsonl, while llm_pipeline's stage tasks' did. Every task that runs a stage now
    notifies, through the one tasks.notify.notify_failure."""
    from airflow.dag_processing.dagbag import DagBag

    from tasks.notify import notify_failure
    from tasks.stages import STAGES

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert not bag.import_errors, bag.import_errors

    def callbacks(t) -> list:
        cb = t.on_failure_callback
        return list(cb) if isinstance(cb, (list, tuple)) else [cb]

    stage_tasks = {
        "llm_data": {"shard"},  # not its fan-out: dags/llm_data.py says why
        "llm_health": {"health"},
        "llm_pipeline": {
            t for t in (t.task_id for t in bag.dags["llm_pipeline"].tasks) if t in STAGES or t.startswith("shard_")
        },
    }
    for dag_id, task_ids in stage_tasks.items():
        for task_id in task_ids:
            assert notify_failure in callbacks(bag.dags[dag_id].get_task(task_id)), (dag_id, task_id)
