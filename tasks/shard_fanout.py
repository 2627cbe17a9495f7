"""The shard build fanned out with dynamic task mapping, shared by llm_data and llm_pipeline (not a DAG itself: it
lives here, not in dags/, and imports Airflow only inside shard_fanout(), which the DAG files call at parse time).

shard_prepare → shard_partition.expand(one per partition) → shard_layout → shard_write.expand(one per write range)
→ the DAG's own `shard` task (the shard stage with --reduce: checks every output, writes the manifest, publishes).
A mapped task keeps nothing outside the build's directory under data.out_dir and carries only paths and indices in
XCom, so it can run on any worker that sees that directory; a worker killed mid-task is retried and the step is
redone from its start (tasks.pipeline.shard_step, data_prep.job). A known cause, a bug in a step and Airflow's
execution_timeout fail at once: a retry would meet the same input under the same bound.
"""

from __future__ import annotations


def bug_line(e: BaseException) -> str:
    """A Python exception's one line: its type and its message's first line."""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _call(step: str, arg=None, skip=None):
    """One shard step for this DAG run (imports stay inside: parse time stays light). Output keeps its level in the
    task log, a known cause is its one ERROR line (as the stage tasks: dags/llm_pipeline.run_stage_task)."""
    from airflow.sdk import get_current_context

    from tasks.errors import StageError, os_error_cause
    from tasks.logs import to_logging
    from tasks.pipeline import failure, shard_step

    ctx = get_current_context()
    if skip is not None and skip(ctx):
        return []
    with to_logging():
        try:
            return shard_step(step, dict(ctx["params"]), ctx["dag"].dag_id, ctx["run_id"], arg)
        except StageError as e:
            raise failure(str(e)) from None
        except OSError as e:  # a full or read-only disk: the path and the errno's meaning, not retried
            raise failure(os_error_cause(e)) from None
        except Exception as e:  # a bug in the step (KeyError, UnicodeDecodeError…): a retry would fail the same way
            from airflow.sdk.exceptions import AirflowFailException

            cause = f"shard: {step}: {bug_line(e)} (traceback below)"
            failure(cause)
            raise AirflowFailException(cause) from e  # fails at once (no retry), the traceback stays in the log


def shard_fanout(reduce, timeout_s: int, skip=None, **task_kwargs):
    """Add the fan-out before `reduce` (the DAG's `shard` task, already made, trigger_rule none_failed: it runs when
    the mapped tasks were skipped, a cache hit); return (first task, `reduce`). `skip(ctx)`: true when this run
    does not shard (llm_pipeline triggered by a published set: it adopts it). `task_kwargs` go to every task.

    Every task's execution_timeout is `timeout_s` (the default preset's shard bound, at parse time), set again at
    task start from the run's own config (tasks.pipeline.bound_from_run_config), as the stage tasks' are."""
    import functools

    import pendulum
    from airflow.sdk import ExceptionRetryPolicy, RetryAction, RetryRule, task

    from tasks.pipeline import bound_from_run_config

    common = dict(
        execution_timeout=pendulum.duration(seconds=timeout_s),
        pre_execute=functools.partial(bound_from_run_config, stage="shard"),
        **task_kwargs,
    )
    # Only a killed worker is retried (the step is redone from its start). A known cause (tasks.pipeline.StageFailure)
    # and Airflow's own timeout fail at once: a retry would meet the same input under the same bound; a bug is an
    # AirflowFailException (_call), which never reaches the policy. A SIGKILLed task process never reaches it either:
    # its retry is the supervisor's (airflow/sdk/execution_time/supervisor.py, ActivitySubprocess.final_state: a
    # non-zero exit with the server's should_retry → UP_FOR_RETRY) or, a lost worker host, the scheduler's.
    known_cause_fails = ExceptionRetryPolicy(
        rules=[
            RetryRule(exception="tasks.pipeline.StageFailure", action=RetryAction.FAIL, reason="a known cause"),
            RetryRule(
                exception="airflow.sdk.exceptions.AirflowTaskTimeout",
                action=RetryAction.FAIL,
                reason="stopped at its execution_timeout: a retry would meet the same bound (timeouts.shard_s)",
            ),
        ]
    )
    retry = dict(retries=2, retry_delay=pendulum.duration(seconds=5), retry_policy=known_cause_fails)

    @task(
        task_id="shard_prepare",
        doc_md="Resolve the corpus, plan partitions (files, size-balanced), train or "
        "copy the tokenizer; nothing when the shard set is already published (cache hit).",
        **common,
    )
    def prepare() -> list[dict]:
        return _call("prepare", skip=skip)

    @task(
        task_id="shard_partition",
        doc_md="One partition: read, clean, de-duplicate, tokenize its files.",
        **common,
        **retry,
    )
    def partition(part: dict) -> dict:
        return _call("partition", part)

    @task(
        task_id="shard_layout",
        trigger_rule="none_failed",
        doc_md="Every partition → global de-duplication and the shard plan (the same for any number of partitions).",
        **common,
    )
    def layout(parts: list[dict]) -> list[dict]:
        return _call("layout", list(parts))

    @task(task_id="shard_write", doc_md="One range of shards of the plan → WebDataset tars.", **common, **retry)
    def write(w: dict) -> dict:
        return _call("write", w)

    parts = prepare()
    tokenized = partition.expand(part=parts)
    writes = layout(parts)
    tokenized >> writes
    write.expand(w=writes) >> reduce
    return parts, reduce
