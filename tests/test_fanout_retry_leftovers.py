"""What an operator gets when a shard fan-out task or a stage hits a bug or Airflow's timeout: a bug and a timeout
fail at once (a retry would meet the same input under the same bound), the runner's record of a timeout names the
bound to raise, and a shard_* notification says which task and which partition. Function level, the real policy
object of the parsed DAG, no DAG run."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN = "manual__2026-01-01T00:00:00+00:00"


@pytest.fixture(scope="module")
def llm_data():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / "llm_data.py"))
    assert not bag.import_errors, bag.import_errors
    return bag.dags["llm_data"]


@pytest.mark.parametrize("task_id", ["shard_partition", "shard_write"])
def test_a_timeout_or_a_known_cause_fails_the_mapped_task_at_once(llm_data, task_id):
    from airflow.sdk import RetryAction
    from airflow.sdk.exceptions import AirflowTaskTimeout

    from tasks.pipeline import StageFailure

    task = llm_data.get_task(task_id)
    assert task.retries == 2  # a killed worker: the supervisor's retries, which never consult the policy
    policy = task.retry_policy
    decide = lambda e: policy.evaluate(exception=e, try_number=1, max_tries=3).action  # noqa: E731
    assert decide(AirflowTaskTimeout("Timeout, PID: 12")) == RetryAction.FAIL  # was DEFAULT: 3 × the shard bound
    assert decide(StageFailure("shard: partition 0: a.jsonl.gz is truncated")) == RetryAction.FAIL
    assert decide(ConnectionResetError("the API server went away")) == RetryAction.DEFAULT  # a transient fault


def test_a_bug_in_a_step_is_one_line_and_an_airflow_fail_exception(llm_data, tmp_path, monkeypatch, caplog):
    """AirflowFailException is never retried (task_runner: the policy is not consulted); the bug's own traceback
    stays chained under it. Before, the KeyError went out as is and was retried twice, failing the same way."""
    from airflow.sdk.exceptions import AirflowFailException
    from airflow.sdk.execution_time.context import set_current_context

    from tasks.shard_fanout import _call

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    # as in a task process: no CLI console handler (an earlier in-process CLI test's would echo the line to stderr,
    # which to_logging turns into a second record; tasks.logs.console)
    tasks_log = logging.getLogger("tasks")
    monkeypatch.setattr(tasks_log, "handlers", [h for h in tasks_log.handlers if not getattr(h, "_tasks_console", 0)])
    context = {"params": llm_data.params, "dag": llm_data, "run_id": RUN}
    with set_current_context(context), caplog.at_level(logging.ERROR), pytest.raises(AirflowFailException) as e:
        _call("partition", {})  # no "job": a KeyError inside the step, as a bug would raise
    assert str(e.value) == "shard: partition: KeyError: 'job' (traceback below)"
    assert isinstance(e.value.__cause__, KeyError)  # Airflow logs the chained traceback
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [str(e.value)]


def test_the_runner_s_record_of_a_timeout_names_the_bound_a_kill_says_rerun(tmp_path):
    from airflow.sdk.exceptions import AirflowTaskTerminated, AirflowTaskTimeout

    from tasks.config import load_config
    from tasks.runner import _stopped_cause

    cfg = load_config("ci-tiny")
    timeout = AirflowTaskTimeout("Timeout, PID: 12")
    shard = _stopped_cause("shard", cfg, tmp_path, timeout)
    assert f"its bound is {cfg.timeouts.shard_s} s (timeouts.shard_s)" in shard and "rerun the stage" not in shard
    assert "a rerun meets the same bound" in shard and shard.startswith("shard: stopped before it finished")
    train = _stopped_cause("train", cfg, tmp_path, timeout)
    assert "timeouts.train_margin" in train and "rerun the stage" not in train
    for stop in (AirflowTaskTerminated("killed"), KeyboardInterrupt()):
        assert _stopped_cause("shard", cfg, tmp_path, stop).endswith("killed or interrupted; rerun the stage")


def test_a_shard_notification_names_the_task_and_its_map_index(tmp_path, monkeypatch):
    from airflow.sdk.api.datamodels._generated import TaskInstance

    from tasks.notify import notify_failure
    from tasks.pipeline import StageFailure

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))

    def ti(task_id: str, map_index: int) -> TaskInstance:  # the task runner's TaskInstance fields, as a worker has
        ids = dict(id=uuid.uuid4(), dag_version_id=uuid.uuid4())
        return TaskInstance(**ids, task_id=task_id, dag_id="llm_data", run_id=RUN, try_number=1, map_index=map_index)

    notify_failure({"ti": ti("shard_partition", 3), "run_id": RUN, "exception": StageFailure("shard: bad input")})
    notify_failure({"ti": ti("shard", -1), "run_id": RUN, "exception": StageFailure("shard: no output")})
    notes = [json.loads(n) for n in (tmp_path / "var" / "notifications.jsonl").read_text().splitlines()]
    assert [(n["stage"], n["task_id"], n["map_index"]) for n in notes] == [
        ("shard", "shard_partition", 3),
        ("shard", "shard", -1),
    ]
