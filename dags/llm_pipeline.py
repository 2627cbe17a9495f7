"""
### LLM pipeline: Ascend cards + a text corpus → a trained, profiled, INT8-quantized, evaluated, registered LLM

Stages, each a module in `tasks/` that also runs without Airflow (`python -m tasks <stage>`):
environment validation → WebDataset sharding → smoke run (FP32 then BF16) → parallel plan → hybrid-parallel
training → profiling → INT8 quantization → evaluation & registry gate. A stage that fails stops the run with a
one-line cause (task log, the stage's `<stage>.json`, and the MLflow run tag `pipeline.error`).

Runs whenever the `llm_data` DAG publishes a new shard set (data-aware retraining), by hand (Trigger), and on a
timetable only when `LLM_PIPELINE_SCHEDULE` (a cron expression, e.g. `0 3 * * 1`) is set where the DAG is parsed.
When the preset asks for it (`evaluate.require_approval`, or the DAG's Require approval), the
`approve` task waits for a person (Browse → Required actions); Approve makes the new version the champion.
Results: `var/runs/llm_pipeline/<run_id>/`; MLflow: one parent run per DAG run, one child run per stage
(each task's **MLflow run** link opens it).
"""

from __future__ import annotations

import datetime

import pendulum
from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import (
    AssetAlias,
    AssetOrTimeSchedule,
    CronTriggerTimetable,
    ExceptionRetryPolicy,
    Param,
    RetryAction,
    RetryRule,
    dag,
    task,
)

from tasks.pipeline import (  # light: no torch, no mlflow
    RetryableStageFailure,
    StageFailure,
    approval_timeout_from_run_config,
    bound_from_run_config,
    end_parent_run,
    param_schemas,
    time_schedule,
)
from tasks.notify import notify_failure  # light: no torch, no mlflow
from tasks.shard_fanout import shard_fanout
from tasks.stages import STAGES, TITLES

SHARD_SET = AssetAlias("llm-shard-set")  # the llm_data DAG attaches each newly published shard set to it

DOCS = {
    "env": "Versions (Python, torch, torch_npu, CANN, driver) against the compatibility matrix, devices, "
    "npu-smi health, a collective all_reduce + bandwidth probe, clock offset, HCCL timeouts, disk and memory.",
    "shard": "Corpus → cleaned, deduplicated documents → BPE tokenizer → packed windows → WebDataset shards with a "
    "manifest, built by the shard_* tasks before it (one per partition, one per write range); this task checks "
    "their outputs and publishes the set. Same input and config: a cache hit, nothing rewritten.",
    "smoke": "One device, the configured model (or a smaller sibling when it does not fit one device: "
    "smoke.model): N steps in FP32, then the same in BF16. Fails (and stops the run) "
    "on a non-finite loss, a loss that does not fall, or FP32/BF16 curves that disagree; names the first bad "
    "layer.",
    "plan": "Memory estimate and DP/TP/PP/ZeRO/recompute search for the cluster; the best feasible plan configures "
    "training unless parallel.dp/tp/pp are pinned.",
    "train": "torchrun over one DeviceMesh (pp × dp × tp): FSDP2, tensor and pipeline parallel, recompute, BF16, DCP "
    "checkpoints. A retry resumes from the latest complete checkpoint.",
    "profile": "A short profiled run of the same trainer and plan (torch_npu.profiler on Ascend, torch.profiler "
    "elsewhere), analysed into a report with advisor findings and a comparison with the last baseline.",
    "quantize": "INT8 quantization (AMCT on Ascend, torchao elsewhere; skips configured layers), gated on "
    "evaluate.gate_metric (default: the task accuracy drop vs BF16, FP16 with quantize.dtype=fp16, on "
    "evaluate.tasks, lm-eval) within evaluate.max_drop_pct; QAT when PTQ misses the gate and quantize.qat_on_fail "
    "is set.",
    "evaluate": "INT8 vs BF16 (FP16 with quantize.dtype=fp16) and FP32 on evaluate.tasks (lm-evaluation-harness; "
    "demo-continuation from the val split) and on held-out tokens (perplexity, top-1, greedy agreement, size, "
    "speed); the gate registers a version (alias candidate), and the champion, scored on the same tasks in the same "
    "run, gives way unless it is better.",
}


def triggering_shard_sets(ctx) -> list[dict]:
    """The `llm-shard-set` asset events that triggered this run, as plain dicts (none for a manual/cron run)."""
    try:
        events = ctx.get("triggering_asset_events") or {}
        found = events[SHARD_SET] if events else []
    except KeyError:
        return []
    return [
        {
            "uri": e.asset.uri,
            "name": e.asset.name,
            "extra": dict(e.extra or {}),
            "source_dag_id": e.source_dag_id,
            "source_run_id": e.source_run_id,
            "source_task_id": e.source_task_id,
            "timestamp": e.timestamp.isoformat() if e.timestamp else None,
        }
        for e in found
    ]


def adopts_published_set(ctx) -> bool:
    """An asset-triggered run adopts the published shard set: its fan-out shards nothing."""
    from tasks.pipeline import published_shard_set

    return published_shard_set(triggering_shard_sets(ctx)) is not None


def run_stage_task(stage: str, args: dict | None = None) -> dict:
    """Body of every stage task: Params → config → the stage on its launcher (imports stay inside: parse time
    stays light). hardware.launcher=kubernetes runs the device stages as Jobs on the training nodes.

    What the stage prints reaches the task log at the level it names (tasks.logs.to_logging: Airflow would log
    every stderr line at ERROR). A known failure (StageError, OSError) is one ERROR line with the cause and a
    StageFailure, which Airflow records without a traceback; a bug keeps its traceback."""
    from airflow.sdk import get_current_context
    from airflow.sdk.exceptions import AirflowFailException

    from tasks.errors import StageError, os_error_cause
    from tasks.launch.placement import runs_on_kubernetes
    from tasks.logs import to_logging
    from tasks.pipeline import config_for_run, failure, join_dag_run, published_shard_set, run_for_dag_run
    from tasks.runner import default_run_dir

    ctx = get_current_context()
    params, dag_id, run_id, try_number = dict(ctx["params"]), ctx["dag"].dag_id, ctx["run_id"], ctx["ti"].try_number
    published = published_shard_set(triggering_shard_sets(ctx)) if stage == "shard" else None
    with to_logging():
        try:
            cfg = config_for_run(params, default_run_dir(dag_id, run_id), dag_id)
            if runs_on_kubernetes(stage, cfg):
                from tasks.launch.k8s_submit import run_stage_job  # imports the cncf provider itself

                join_dag_run(cfg, dag_id, run_id, try_number)  # the pods' `python -m tasks` runs nest under it
                return run_stage_job(stage, cfg, dag_id, run_id, try_number)
            return run_for_dag_run(stage, params, dag_id, run_id, try_number, published=published, args=args)
        except StageError as e:  # retryable: e.g. a rank died, the retry resumes training from the last checkpoint
            raise failure(str(e), e.retryable) from None
        except OSError as e:  # read-only or full var dir, a file in the way: the path and the errno's meaning
            raise failure(os_error_cause(e)) from None
        except Exception as e:  # a Python exception in the stage itself: a retry would fail the same way
            first = str(e).splitlines()[0] if str(e) else ""
            where = default_run_dir(dag_id, run_id) / f"{stage}.json"
            cause = f"{stage}: {type(e).__name__}: {first} (traceback below and in {where})"
            failure(cause)
            raise AirflowFailException(cause) from e


# The train task retries only what a retry can fix (StageError.retryable: a rank killed by a signal, a lost peer, a
# collective timeout); a retry resumes from the newest verified checkpoint. Everything else fails at once.
RETRY_ONLY_RETRYABLE = ExceptionRetryPolicy(
    rules=[
        RetryRule(exception=RetryableStageFailure, action=RetryAction.RETRY),
        RetryRule(exception=StageFailure, action=RetryAction.FAIL, reason="a retry cannot fix this cause"),
    ]
)
RETRIES = {
    "train": dict(retries=2, retry_delay=pendulum.duration(seconds=15), retry_policy=RETRY_ONLY_RETRYABLE),
}
SHARD_REDUCE = {"reduce": True}  # the shard task publishes what its fan-out (tasks/shard_fanout.py) built


def _approval_timeout_h() -> int:
    from tasks.config import load_config

    return load_config().evaluate.approval_timeout_h


APPROVAL_TIMEOUT_H = _approval_timeout_h()  # the default preset's, at parse time; each run's own: pre_execute


def stage_task(stage_id: str):
    """One TaskFlow task per stage, all with the same body; its return value (ids and paths) is the XCom.

    execution_timeout: the default preset's bound at parse time, set again from the run's config at task start.
    queue: the preset's hardware.device_queue for device stages (CeleryExecutor: the training nodes' workers)."""
    from tasks.bounds import task_timeout_s
    from tasks.config import load_config
    from tasks.launch.placement import celery_queue

    def body() -> dict:
        return run_stage_task(stage_id, SHARD_REDUCE if stage_id == "shard" else None)

    body.__name__ = stage_id
    cfg = load_config()
    queue = celery_queue(stage_id, cfg)
    return task(
        task_id=stage_id,
        doc_md=DOCS.get(stage_id, f"{TITLES[stage_id]}: `python -m tasks {stage_id}`."),  # a new stage's, until written
        on_failure_callback=notify_failure,
        execution_timeout=pendulum.duration(seconds=task_timeout_s(stage_id, cfg)),
        pre_execute=bound_from_run_config,
        **({"queue": queue} if queue else {}),
        **RETRIES.get(stage_id, {}),
        **({"trigger_rule": "none_failed"} if stage_id == "shard" else {}),  # its fan-out is skipped on a cache hit
    )(body)


CRON = time_schedule()  # LLM_PIPELINE_SCHEDULE: timed runs are opt-in (see tasks.pipeline.time_schedule)


@dag(
    dag_id="llm_pipeline",
    schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable(CRON, timezone="UTC"), assets=SHARD_SET)
    if CRON
    else SHARD_SET,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    doc_md=__doc__,
    tags=["llm", "ascend", "training"],
    params={name: Param(**schema) for name, schema in param_schemas().items()},
    default_args={"retries": 0},
    on_success_callback=end_parent_run(success=True),  # the MLflow parent run ends with the DAG run's outcome
    on_failure_callback=end_parent_run(success=False),
)
def llm_pipeline():
    @task(
        task_id="summary",
        trigger_rule="all_done",
        doc_md="The one-screen summary of the run (all stages, the model's outcome and the approval, in full).",
    )
    def summary() -> str:
        from airflow.sdk import get_current_context

        from tasks.errors import StageError
        from tasks.logs import to_logging
        from tasks.pipeline import failure, print_summary

        ctx = get_current_context()
        answer = ctx["ti"].xcom_pull(task_ids="approve")
        with to_logging():
            try:
                return print_summary(dict(ctx["params"]), ctx["dag"].dag_id, ctx["run_id"], answer=answer)
            except StageError as e:  # Params the first task refused already: the same one line
                raise failure(str(e)) from None

    @task.short_circuit(
        task_id="approval_needed",
        ignore_downstream_trigger_rules=False,  # skip only `approve` (and so `promote`), never the summary
        doc_md="Asks for a person's approval when evaluate.require_approval is set (evaluate.json `approval`); "
        "otherwise `approve` and `promote` are skipped.",
    )
    def approval_needed() -> dict:
        from airflow.sdk import get_current_context

        from tasks.errors import StageError
        from tasks.logs import to_logging
        from tasks.pipeline import approval_request, failure

        ctx = get_current_context()
        with to_logging():
            try:
                return approval_request(dict(ctx["params"]), ctx["dag"].dag_id, ctx["run_id"])
            except StageError as e:
                raise failure(str(e)) from None

    approve = ApprovalOperator(
        task_id="approve",
        subject="{{ ti.xcom_pull(task_ids='approval_needed')['subject'] }}",
        body="{{ ti.xcom_pull(task_ids='approval_needed')['body'] }}",
        defaults="Reject",  # what an unanswered request becomes after response_timeout
        # a datetime.timedelta: the task runner's msgpack encoder refuses pendulum's Duration
        response_timeout=datetime.timedelta(hours=APPROVAL_TIMEOUT_H),  # this run's, set by the pre_execute
        pre_execute=approval_timeout_from_run_config,
        doc_md="Approve: the new version becomes the champion (the promote task). Reject, or no answer within "
        "evaluate.approval_timeout_h (this run's config): the champion stays. Answer under Browse → Required actions.",
    )

    @task(task_id="promote", doc_md="Sets the alias champion on the approved version (tasks.quant.registry.promote).")
    def promote() -> dict:
        from airflow.sdk import get_current_context

        from tasks.errors import StageError
        from tasks.logs import to_logging
        from tasks.pipeline import failure, promote_approved

        ctx = get_current_context()
        with to_logging():
            try:
                answer = ctx["ti"].xcom_pull(task_ids="approve")
                return promote_approved(dict(ctx["params"]), ctx["dag"].dag_id, ctx["run_id"], answer)
            except StageError as e:
                raise failure(str(e)) from None

    @task(
        task_id="pipeline_ok",
        doc_md="Fails unless every stage succeeded, so the run's state tells the truth "
        "(the summary task runs either way).",
    )
    def pipeline_ok() -> None:
        return None

    from tasks.bounds import task_timeout_s
    from tasks.config import load_config

    by_stage = {stage_id: stage_task(stage_id)() for stage_id in STAGES}
    fanout, _ = shard_fanout(
        by_stage["shard"],
        task_timeout_s("shard", load_config()),
        skip=adopts_published_set,
        on_failure_callback=notify_failure,
    )
    for upstream, downstream in zip(STAGES, list(STAGES)[1:]):
        by_stage[upstream] >> (fanout if downstream == "shard" else by_stage[downstream])
    last = by_stage[list(STAGES)[-1]]
    promoted = last >> approval_needed() >> approve >> promote()
    [last, promoted] >> summary()
    last >> pipeline_ok()


llm_pipeline()
