"""
### LLM pipeline: Ascend cards + a text corpus → a trained, profiled, INT8-quantized, evaluated, registered LLM

Stages, each a module in `tasks/` that also runs without Airflow (`python -m tasks <stage>`):
environment validation → WebDataset sharding → smoke run (FP32 then BF16) → parallel plan → hybrid-parallel
training → profiling → INT8 quantization → evaluation & registry gate. A stage that fails stops the run with a
one-line cause (task log, the stage's `<stage>.json`, and the MLflow run tag `pipeline.error`).

Runs weekly (no catch-up) and whenever the `llm_data` DAG publishes a new shard set (data-aware retraining).
Results: `var/runs/llm_pipeline/<run_id>/`; MLflow: one parent run per DAG run, one child run per stage
(each task's **MLflow run** link opens it).
"""
from __future__ import annotations

import pendulum
from airflow.sdk import AssetAlias, AssetOrTimeSchedule, CronTriggerTimetable, Param, dag, task

from tasks.pipeline import param_schemas  # light: config schema only (no torch, no mlflow)
from tasks.stages import STAGES

SHARD_SET = AssetAlias("llm-shard-set")  # the llm_data DAG attaches each newly published shard set to it

DOCS = {
    "env": "Versions (Python, torch, torch_npu, CANN, driver) against the compatibility matrix, devices, "
           "npu-smi health, a collective all_reduce + bandwidth probe, clock offset, HCCL timeouts, disk and memory.",
    "shard": "Corpus → cleaned, deduplicated documents → BPE tokenizer → packed windows → WebDataset shards with a "
             "manifest. Same input and config: a cache hit, nothing rewritten.",
    "smoke": "One device, the configured model: N steps in FP32, then the same in BF16. Fails (and stops the run) "
             "on a non-finite loss, a loss that does not fall, or FP32/BF16 curves that disagree; names the first bad "
             "layer.",
    "plan": "Memory estimate and DP/TP/PP/ZeRO/recompute search for the cluster; the best feasible plan configures "
            "training unless parallel.dp/tp/pp are pinned.",
    "train": "torchrun over one DeviceMesh (pp × dp × tp): FSDP2, tensor and pipeline parallel, recompute, BF16, DCP "
             "checkpoints. A retry resumes from the latest complete checkpoint.",
    "profile": "A short profiled run of the same trainer and plan (torch_npu.profiler on Ascend, torch.profiler "
               "elsewhere), analysed into a report with advisor findings and a comparison with the last baseline.",
    "quantize": "INT8 post-training quantization: AMCT on Ascend, torchao elsewhere; skips configured layers.",
    "evaluate": "INT8 vs BF16 on held-out tokens disjoint from calibration: top-1 accuracy, perplexity, greedy "
                "agreement, size, prefill/decode speed; QAT when PTQ misses the gate; the gate registers a version "
                "(alias candidate, champion when better than the current one).",
}


def run_stage_task(stage: str) -> dict:
    """Body of every stage task: Params → config → tasks.pipeline (imports stay inside: parse time stays light)."""
    from airflow.sdk import get_current_context
    from airflow.sdk.exceptions import AirflowFailException

    from tasks.errors import StageError
    from tasks.pipeline import config_for_params, run_for_dag_run

    ctx = get_current_context()
    params, dag_id, run_id, try_number = dict(ctx["params"]), ctx["dag"].dag_id, ctx["run_id"], ctx["ti"].try_number
    try:
        if stage == "train" and config_for_params(params).hardware.launcher == "kubernetes":
            from k8s_launch import run_train_job  # dags/k8s_launch.py: imports the cncf provider itself

            return run_train_job(config_for_params(params), dag_id, run_id, try_number)
        return run_for_dag_run(stage, params, dag_id, run_id, try_number)
    except StageError as e:
        if e.retryable:
            raise  # e.g. a rank died: Airflow's retry resumes training from the last checkpoint
        raise AirflowFailException(str(e)) from None  # bad input: retrying cannot help


def notify_failure(context) -> None:
    """A failed task's notification carries the stage's one-line cause (see tasks/notify.py)."""
    from tasks.notify import record_failure

    ti = context["ti"]
    record_failure(ti.dag_id, context["run_id"], ti.task_id, context.get("exception"))


# The train task retries: a retry resumes from the latest complete checkpoint (a dead rank is retryable).
RETRIES = {"train": dict(retries=2, retry_delay=pendulum.duration(seconds=15))}


def stage_task(stage_id: str):
    """One TaskFlow task per stage, all with the same body; its return value (ids and paths) is the XCom."""
    def body() -> dict:
        return run_stage_task(stage_id)

    body.__name__ = stage_id
    return task(task_id=stage_id, doc_md=DOCS[stage_id], on_failure_callback=notify_failure,
                **RETRIES.get(stage_id, {}))(body)


@dag(
    dag_id="llm_pipeline",
    schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable("0 3 * * 1", timezone="UTC"), assets=SHARD_SET),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    doc_md=__doc__,
    tags=["llm", "ascend", "training"],
    params={name: Param(**schema) for name, schema in param_schemas().items()},
    default_args={"retries": 0},
)
def llm_pipeline():
    @task(task_id="summary", trigger_rule="all_done", doc_md="The one-screen summary of the run (all stages).")
    def summary() -> str:
        from airflow.sdk import get_current_context

        from tasks.pipeline import print_summary

        ctx = get_current_context()
        return print_summary(dict(ctx["params"]), ctx["dag"].dag_id, ctx["run_id"])

    @task(task_id="pipeline_ok", doc_md="Fails unless every stage succeeded, so the run's state tells the truth "
                                        "(the summary task runs either way).")
    def pipeline_ok() -> None:
        return None

    stages = [stage_task(stage_id)() for stage_id in STAGES]
    for upstream, downstream in zip(stages, stages[1:]):
        upstream >> downstream
    stages[-1] >> [summary(), pipeline_ok()]


llm_pipeline()
