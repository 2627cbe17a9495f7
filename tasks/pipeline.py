"""What the orchestrator needs from tasks/, without importing Airflow: trigger-form Params and the stage call.

The DAG turns PARAMS into `airflow.sdk.Param`s (each field's JSON schema — type, enum, minimum/maximum — is the config
model's own, `field_schema()`, so the form refuses exactly what config validation refuses), and calls
`run_for_dag_run()` from each task.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys

from tasks import tracking
from tasks.errors import ConfigError
from tasks.fsutil import atomic_write_json, atomic_write_text, read_json
from tasks.config import CONFIG_DIR, DEFAULT_PRESET, PipelineConfig, get, load_config
from tasks.runner import default_run_dir, run_stage
from tasks.shape import PRESETS as MODEL_PRESETS  # torch-free
from tasks.summary import APPROVAL_FILE

log = logging.getLogger("tasks.pipeline")

# (param name, config key, form section, title, description). The order is the form's order.
PARAMS = [
    (
        "preset",
        None,
        "Hardware",
        "Configuration preset",
        "A YAML preset in configs/ (demo-cpu runs on a laptop). The fields below override it.",
    ),
    ("device", "hardware.device", "Hardware", "Device", "auto picks npu, then cuda, then cpu."),
    (
        "nproc_per_node",
        "hardware.nproc_per_node",
        "Hardware",
        "Processes per node",
        "Training ranks per node: one per NPU/GPU; on CPU the number of gloo ranks; 0 = one per device (2 on CPU).",
    ),
    ("nnodes", "hardware.nnodes", "Hardware", "Nodes", "Nodes in the torchrun c10d rendezvous."),
    (
        "launcher",
        "hardware.launcher",
        "Hardware",
        "Training launcher",
        "local: torchrun on this host; kubernetes: a Job on the Ascend cluster (deploy/k8s).",
    ),
    (
        "data_inputs",
        "data.inputs",
        "Data",
        "Corpus inputs",
        "Files, directories or globs (.txt, .jsonl, .parquet, gzip'd or not); 'stdlib' = Python's own sources.",
    ),
    ("max_documents", "data.max_documents", "Data", "Max documents", "0 = the whole corpus."),
    (
        "tokenizer",
        "data.tokenizer",
        "Data",
        "Tokenizer",
        "train = a byte-level BPE trained on the corpus; or a local tokenizer.json / model directory (e.g. the "
        "checkpoint's own, with Start from HF checkpoint).",
    ),
    (
        "vocab_size",
        "data.vocab_size",
        "Data",
        "Tokenizer vocabulary",
        "Size of the byte-level BPE trained on the corpus (Tokenizer = train; a given tokenizer keeps its own).",
    ),
    ("seq_len", "data.seq_len", "Data", "Sequence length", "Tokens per packed training window."),
    (
        "val_fraction",
        "data.val_fraction",
        "Data",
        "Validation fraction",
        "Share of documents held out (by document hash) for the validation loss and the demo-continuation "
        "evaluation task; a split too small for that task stops the run at shard.",
    ),
    (
        "partitions",
        "data.partitions",
        "Data",
        "Shard partitions",
        "Sharding fans out over this many tasks (files, size-balanced; at most one per input file); 0 = one per "
        "128 MB of corpus. "
        "The shards are the same whatever the number.",
    ),
    (
        "model_preset",
        "model.preset",
        "Model",
        "Model preset",
        "The model's shape: a preset registered in tasks/shape.py (the list); with Start from HF checkpoint the "
        "checkpoint's config.json is the shape.",
    ),
    (
        "hf_path",
        "model.hf_path",
        "Model",
        "Start from HF checkpoint",
        "A local Hugging Face model directory (config.json + safetensors): its shape and weights start training; "
        "shard with its own tokenizer (Tokenizer = the same directory).",
    ),
    (
        "converters",
        "model.converters",
        "Model",
        "Model converters",
        "Applied in this order to the model before any parallelism: npu_fused (the NPU fused kernels; the identity "
        "elsewhere), math_attention (opset-11 attention, as the quantize stage's ONNX export uses), qat_int8 (INT8 "
        "fake quantization of the layers quantize makes INT8: quantization-aware training; not with TP > 1).",
    ),
    ("dp", "parallel.dp", "Parallelism", "Data parallel (DP)", "0 = chosen by the planner."),
    (
        "tp",
        "parallel.tp",
        "Parallelism",
        "Tensor parallel (TP)",
        "Within a node; divides heads and KV heads. 0 = chosen by the planner.",
    ),
    (
        "pp",
        "parallel.pp",
        "Parallelism",
        "Pipeline parallel (PP)",
        "Across nodes; divides the layers. 0 = chosen by the planner.",
    ),
    (
        "ep",
        "parallel.ep",
        "Parallelism",
        "Expert parallel (EP)",
        "MoE models: experts split over EP of the DP ranks; divides DP and the expert count.",
    ),
    (
        "zero",
        "parallel.zero",
        "Parallelism",
        "ZeRO stage",
        "0 replicated, 1 sharded optimizer states, 2/3 FSDP2 (3 reshards after forward unless PP > 1).",
    ),
    ("recompute", "parallel.recompute", "Parallelism", "Activation recompute", "Trade compute for memory."),
    ("pp_schedule", "parallel.pp_schedule", "Parallelism", "Pipeline schedule", "Used when PP > 1."),
    ("steps", "train.steps", "Training", "Optimizer steps", "Length of the training run."),
    ("global_batch", "train.global_batch", "Training", "Global batch (sequences)", "Across all ranks."),
    ("micro_batch", "train.micro_batch", "Training", "Micro-batch (sequences)", "Per rank per forward."),
    ("lr", "train.lr", "Training", "Peak learning rate", "AdamW with warm-up and cosine decay."),
    ("precision", "train.precision", "Training", "Precision", "bf16 autocast on NPU/CPU; fp32 for debugging."),
    ("smoke_steps", "smoke.steps", "Training", "Smoke steps", "Per precision, on one device, before training."),
    (
        "quant_method",
        "quantize.method",
        "Quantization",
        "INT8 method",
        "Weight-only INT8, dynamic W8A8, or SmoothQuant (AMCT on Ascend).",
    ),
    (
        "gate_metric",
        "evaluate.gate_metric",
        "Quantization",
        "Gate metric",
        "What the INT8 model is judged on against the unquantized one.",
    ),
    (
        "eval_tasks",
        "evaluate.tasks",
        "Quantization",
        "Evaluation tasks",
        "What the FP and INT8 models are scored on: lm-eval tasks or groups (mmlu, ceval-valid; from the HF "
        "datasets cache, offline), task YAML paths, or demo-continuation (cut from the shard set's val split).",
    ),
    (
        "max_drop_pct",
        "evaluate.max_drop_pct",
        "Quantization",
        "Max INT8 drop on the gate metric (%)",
        "The gate: how far the INT8 model may fall behind on the gate metric, in percent; more refuses registration.",
    ),
    (
        "registered_model",
        "evaluate.registered_model",
        "Quantization",
        "Registered model name",
        "MLflow Model Registry name; versions get the alias candidate, and champion unless below the champion "
        "by more than evaluate.champion_margin.",
    ),
    (
        "require_approval",
        "evaluate.require_approval",
        "Quantization",
        "Approve the champion in Airflow",
        "A person promotes the new version to champion in the approve task (Required actions) instead of the "
        "evaluation doing it.",
    ),
]

LABELS = {  # readable labels for enum values in the trigger form
    "model.preset": {name: f"{name} (mixture of experts)" for name, shape in MODEL_PRESETS.items() if shape.n_experts},
    "parallel.zero": {
        0: "0 — replicated DP (gradient all-reduce)",
        1: "1 — + AdamW states sharded",
        2: "2 — FSDP2, all shards; parameters gathered forward→backward",
        3: "3 — FSDP2, resharded after forward",
    },
    "quantize.method": {
        "int8_weight_only": "INT8 weight-only",
        "int8_dynamic": "W8A8 dynamic",
        "smoothquant": "SmoothQuant W8A8",
    },
    "train.precision": {"fp32": "FP32", "bf16": "BF16 (autocast)", "fp16": "FP16 (autocast)"},
    "parallel.recompute": {"none": "none", "selective": "selective (keeps matmul/attention outputs)", "full": "full"},
    "evaluate.gate_metric": {
        "task_accuracy_drop_pct": "relative macro task-accuracy drop (evaluate.tasks)",
        "accuracy_drop_pct": "relative next-token top-1 accuracy drop",
        "ppl_drop_pct": "relative perplexity rise",
        "greedy_disagreement_pct": "greedy-continuation disagreement",
    },
}

FROM_PRESET = "from the preset"  # how an empty (null) field reads in the trigger form
FORM_KEYS = ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "items", "minItems")
# Each Param's schema names JSON Schema draft 7 (every key above means the same there as in 2020-12, jsonschema's
# default): Airflow checks each Param's schema against its draft's metaschema on every validation — about 5,200 times
# in one `airflow dags test` (DAG serialization compares and prints ParamsDicts) — and draft 7's check costs 0.05 ms
# where 2020-12's costs 0.19 (measured here, jsonschema.validate).
DRAFT = {"$schema": "http://json-schema.org/draft-07/schema#"}


@functools.lru_cache(maxsize=None)
def field_schema(key: str) -> dict:
    """The config model's JSON schema of one dotted key (pydantic's: the field's type, Literal, Field(ge/le…))."""
    section, _, name = key.partition(".")
    return PipelineConfig.model_fields[section].annotation.model_json_schema()["properties"][name]


def _shown(value) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def param_schemas(cfg: PipelineConfig | None = None) -> dict[str, dict]:
    """name → Param kwargs (default, type, title, description, section, enum/values_display, minimum/maximum).

    The constraints are the config model's (`field_schema`), each made nullable: every field but the preset defaults
    to null, "from the preset": only what the user sets overrides the chosen preset, and an explicit value always
    wins, even one equal to some preset's default. A static form cannot change its hints when another preset is
    picked, so each description names every preset's value, the default preset first ("Empty = the chosen
    preset's value (demo-cpu: 300; ci-tiny: 6)").
    """
    cfg = cfg or load_config()
    preset, out = cfg.preset or DEFAULT_PRESET, {}
    presets = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    others = [load_config(p) for p in presets if p != preset]
    presets += [] if preset in presets else [preset]  # a site's own file ($LLM_PIPELINE_PRESET=/etc/…yaml)
    for name, key, section, title, desc in PARAMS:
        if key is None:
            out[name] = dict(
                DRAFT, default=preset, type="string", enum=presets, title=title, section=section, description=desc
            )
            continue
        model = field_schema(key)
        schema = DRAFT | {k: model[k] for k in FORM_KEYS if k in model}
        schema.update(default=None, type=[model["type"], "null"], title=title, section=section)
        values = "; ".join(f"{c.preset or preset}: {_shown(get(c, key))}" for c in [cfg, *others])
        schema["description"] = f"{desc} Empty = the chosen preset's value ({values})."
        if "enum" in model:
            labels = {k if isinstance(k, str) else json.dumps(k): v for k, v in LABELS.get(key, {}).items()}
            schema.update(enum=[*model["enum"], None], values_display={**labels, "null": FROM_PRESET})
        out[name] = schema
    return out


# The Params of a DAG that takes only some of PARAMS (the form's order is PARAMS'). llm_data builds and publishes a
# shard set: the data Params that decide its contents (val_fraction too: "reshard with a larger data.val_fraction"),
# and partitions. Any other DAG takes them all.
DATA_PARAMS = (
    "preset",
    "data_inputs",
    "max_documents",
    "tokenizer",
    "vocab_size",
    "seq_len",
    "val_fraction",
    "partitions",
)
DAG_PARAMS = {"llm_data": DATA_PARAMS}


def param_names(dag_id: str | None = None) -> tuple[str, ...]:
    """The Param names DAG `dag_id` takes (None: llm_pipeline's, all of PARAMS)."""
    return DAG_PARAMS.get(dag_id or "") or tuple(name for name, *_ in PARAMS)


def overrides_from_params(params: dict, dag_id: str | None = None) -> tuple[str | None, dict]:
    """Split trigger Params into (preset, {config.key: value}); an unknown name (a typo in `--conf`, which Airflow
    merges into the Params unchecked, or another DAG's Param: `steps` given to llm_data would be ignored) is refused
    in one line naming it and the known ones.

    null (the form's empty field, or a key left out of `--conf`) means "the chosen preset's value"; any other value
    is the user's and always wins, whatever the preset's default is.
    """
    keys = {name: key for name, key, *_ in PARAMS}
    names = param_names(dag_id)
    unknown = sorted(n for n in params if n not in names)
    if unknown:
        others = [n for n in unknown if n in keys]  # llm_pipeline's, not this DAG's
        whose = f"; {', '.join(map(repr, others))}: llm_pipeline's, not {dag_id}'s" if others else ""
        raise ConfigError(
            f"unknown DAG Param{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"(known: {', '.join(names)}{whose})"
        )
    preset = params.get("preset")
    overrides = {keys[n]: v for n, v in params.items() if keys.get(n) is not None and v is not None}
    return preset, overrides


def early_problems(cfg: PipelineConfig) -> list[str]:
    """What a later stage would refuse, found at the run's first task: a converter name no one registers (smoke,
    plan and train build the model, after env and shard: hours of tokenizing; an unregistered model preset is the
    config's own refusal, ModelConfig._registered_preset), a blank entry in
    evaluate.tasks (the form's text areas send an empty last line as ""; quantize and evaluate, after training,
    found it no lm-eval task)."""
    problems = []
    if any(not str(t).strip() for t in cfg.evaluate.tasks):
        problems.append(
            f"evaluate.tasks: {cfg.evaluate.tasks} has a blank entry (an empty line in Evaluation tasks); remove it"
        )
    if "model.converters" in cfg.explicit:  # a preset's are checked by its tests; the registry imports torch
        from tasks.model.converters import check_names

        try:
            check_names(cfg.model.converters)
        except ConfigError as e:
            problems.append(str(e))
    return [p for p in problems if p]


def config_for_params(params: dict, dag_id: str | None = None) -> PipelineConfig:
    """The DAG's config: Params over the preset, and shards hashed against their manifest wherever they are read
    (data.verify_sha256: a shard with the right size and altered bytes is caught before it is trained on).
    `dag_id`: whose Params (llm_data takes DATA_PARAMS only; None: llm_pipeline's)."""
    preset, overrides = overrides_from_params(params, dag_id)
    try:
        cfg = load_config(preset, overrides=overrides)
    except ConfigError as e:  # a refused registered model name is still named in the same line
        name = overrides.get("evaluate.registered_model")
        problem = tracking.model_name_problem(name) if isinstance(name, str) else None
        raise ConfigError(f"{problem}; {e}" if problem else str(e)) from None
    cfg.data.verify_sha256 = True
    problems = [tracking.model_name_problem(cfg.evaluate.registered_model)]  # refused now, not after the whole run
    problems += early_problems(cfg) if dag_id not in DAG_PARAMS else []  # llm_data builds no model
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


def form_problems(params: dict, dag_id: str | None = None) -> list[str]:
    """What the trigger form, and Airflow's check of `--conf` against the same JSON schemas, refuses before a run
    starts: a value of the wrong JSON type ("2" for an integer, "yes" for a boolean, a text for a list), null for
    the preset, a preset file outside configs/. The config model would coerce some of them (make run's check
    passed, then Airflow refused the run)."""
    import jsonschema

    schemas = param_schemas()
    problems = []
    for name in (n for n in param_names(dag_id) if n in params):
        schema = {k: v for k, v in schemas[name].items() if k not in ("title", "description", "section")}
        try:
            jsonschema.validate(params[name], schema, format_checker=jsonschema.FormatChecker())
        except jsonschema.ValidationError as e:
            problems.append(f"{name}: {e.message} (the trigger form's schema, which Airflow checks)")
    return problems


def check_conf(text: str) -> PipelineConfig:
    """`make run CONF=…`, checked before Airflow starts: a JSON object of known Params, each of the type its form
    field takes, whose config validates."""

    def no_duplicates(pairs: list) -> dict:  # JSON, like YAML, would silently keep the last of two equal keys
        seen = [k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i])]
        if seen:
            raise ConfigError(f"key {seen[0]!r} appears twice; keep one (the last would silently win)")
        return dict(pairs)

    try:
        conf = json.loads(text, object_pairs_hook=no_duplicates)
    except ValueError as e:
        raise ConfigError(f'is not JSON ({e}); e.g. CONF=\'{{"preset": "ci-tiny"}}\'') from None
    if not isinstance(conf, dict):
        raise ConfigError(
            f"must be a JSON object of DAG Params, not {type(conf).__name__} {text.strip()[:60]}; "
            'e.g. CONF=\'{"preset": "ci-tiny", "steps": 20}\''
        )
    cfg = config_for_params(conf)  # its lines name the config keys (train.steps: 0 must be in [1, …])
    problems = form_problems(conf)  # then what the config would coerce but Airflow refuses
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


def config_for_run(params: dict, run_dir, dag_id: str | None = None) -> PipelineConfig:
    """The run's config: Params (`dag_id`'s: config_for_params), and for a run triggered by a published shard set,
    that set's own data shape (seq_len, vocabulary: the shard stage recorded them), so every stage reads exactly what
    was published."""
    from pathlib import Path

    from tasks.fsutil import read_json

    cfg = config_for_params(params, dag_id)
    shard = Path(run_dir) / "shard.json"
    result = read_json(shard) if shard.is_file() else {}
    if result.get("published") and result.get("status") != "failed":
        cfg.data.seq_len, cfg.data.vocab_size = result["seq_len"], result["vocab_size"]
    return cfg


def published_shard_set(events: list[dict]) -> dict | None:
    """The newest shard set an `llm-shard-set` asset event names (events as plain dicts: uri, name, extra,
    source_dag_id, source_run_id, timestamp); None when the run was not triggered by one."""
    events = [e for e in events or () if (e.get("extra") or {}).get("manifest_digest")]
    if not events:
        return None
    newest = max(events, key=lambda e: str(e.get("timestamp") or ""))
    return {**newest, "manifest_digest": newest["extra"]["manifest_digest"]}


# The llm_data DAG's shard task: publish what its fan-out built, for any consumer (a pipeline run that adopts the set
# makes its own checks on it then: tasks/stages/shard.py check_evaluation_data).
DATA_DAG_SHARD_ARGS = {"reduce": True, "publish_only": True}


def stage_args(stage: str, published: dict | None = None, extra: dict | None = None):
    """The stage's flags at their defaults (and `extra`, e.g. the shard stage's reduce=True after its fan-out); the
    shard stage of an asset-triggered run adopts the published set (reduce off: its fan-out was skipped)."""
    import argparse

    from tasks.runner import default_args

    args = argparse.Namespace(**{**vars(default_args(stage)), **(extra or {})})
    if stage == "shard" and published:
        from urllib.parse import unquote, urlparse

        args = argparse.Namespace(
            **{
                **vars(args),
                "shard_dir": unquote(urlparse(published["uri"]).path),
                "manifest_digest": published["manifest_digest"],
                "reduce": False,  # the fan-out was skipped: nothing to reduce, the set is adopted as it is
            }
        )
    return args


def run_for_dag_run(
    stage: str,
    params: dict,
    dag_id: str,
    run_id: str,
    try_number: int = 1,
    published: dict | None = None,
    args: dict | None = None,
) -> dict:
    """One Airflow task: config from Params, the DAG run's MLflow parent run, the stage in the run's directory.

    `published` (tasks.pipeline.published_shard_set) is the asset event that triggered the run: the shard stage
    then adopts that exact shard set (manifest digest checked) instead of re-sharding, and the event is recorded on
    the MLflow parent run. `args`: stage flags to set (dest → value), e.g. the shard stage's reduce=True.
    `try_number`: the Airflow task's try (ctx["ti"].try_number), tagged on the stage's child run."""
    run_dir = default_run_dir(dag_id, run_id)
    report = os.environ.get("LLM_PIPELINE_RUN_DIR_FILE")  # set by `make run`: which run directory is its own
    if report:
        atomic_write_text(report, f"{run_dir}\n")
    cfg = config_for_run(params, run_dir, dag_id)
    parent = join_dag_run(cfg, dag_id, run_id, try_number)
    if parent and published and stage == "shard":
        tracking.record_asset_event(cfg, parent, published)
    # The task's own try on its child run (the parent's airflow.try_number is the try of the task that created it):
    # a retried or cleared stage's runs sit side by side under one parent, told apart by this tag.
    tries = {"airflow.try_number": str(try_number)}
    result = run_stage(stage, cfg, run_dir, args=stage_args(stage, published, args), parent_run_id=parent, tags=tries)
    result["run_dir"] = str(run_dir)
    return result


def finish_dag_run(
    params: dict, dag_id: str, run_id: str, success: bool, started_at=None, ended_at=None, reason: str = ""
) -> str | None:
    """End the DAG run's MLflow parent run with the run's outcome, duration and shard set (DAG callbacks)."""
    from tasks.fsutil import read_json

    run_dir = default_run_dir(dag_id, run_id)
    cfg = config_for_params(params, dag_id)
    if not cfg.tracking.enabled:
        return None
    shard = run_dir / "shard.json"
    shard_result = read_json(shard) if shard.is_file() else {}
    return tracking.finish_parent_run(
        cfg,
        dag_id,
        run_id,
        success,
        started_at=started_at,
        ended_at=ended_at,
        reason=reason,
        shard_dir=shard_result.get("shard_dir"),
    )


def end_parent_run(success: bool):
    """A DAG on_success/on_failure callback (Airflow passes the context dict) ending the run's MLflow parent run."""

    def callback(context) -> None:
        dag, dag_run = context["dag"], context.get("dag_run")
        params = dict(context.get("params") or {}) or {**dag.params.dump(), **(getattr(dag_run, "conf", None) or {})}
        from tasks.errors import StageError

        try:
            finish_dag_run(
                params,
                dag.dag_id,
                context["run_id"],
                success,
                started_at=getattr(dag_run, "start_date", None),
                ended_at=getattr(dag_run, "end_date", None),
                reason=str(context.get("reason") or ""),
            )
        except StageError as e:  # Params the first task refused in its one line: no parent run was started
            log.warning(f"no MLflow parent run to end: {e}")

    callback.__name__ = f"end_parent_run_{'success' if success else 'failure'}"
    return callback


def print_summary(params: dict, dag_id: str, run_id: str, answer: dict | None = None) -> str:
    """Print the end-of-run table (stage, status, key figure, MLflow link) and the model's outcome; return the run
    directory. `answer`: the approve task's response (HITL payload), None when it did not run."""
    from tasks.summary import render

    cfg = config_for_params(params, dag_id)
    run_dir = default_run_dir(dag_id, run_id)
    experiment_id = None
    if cfg.tracking.enabled:
        import mlflow

        exp = mlflow.MlflowClient(tracking.tracking_uri(cfg)).get_experiment_by_name(cfg.tracking.experiment)
        experiment_id = exp.experiment_id if exp else None
    if answer is not None:
        record_answer(run_dir, answer)
    print(render(run_dir, cfg, experiment_id))
    print(f"\nRun directory: {run_dir}\n{tracking.ui_hint(cfg, experiment_id)}")
    return str(run_dir)


# --- A task's end on a known cause --------------------------------------------------------------------------------


class StageFailure(SystemExit):
    """A task's end on a known cause (a StageError), raised by the DAG's task bodies after `failure()` logged the
    cause as the task log's one ERROR line.

    Airflow 3.3's task runner records an exception with its traceback: for AirflowFailException a dozen frames of
    its own machinery under a one-line summary the log panel cuts at its width. A SystemExit is recorded as
    "Task exited exit_code=1" without frames (`task_runner._run_task_and_map_outcome`), so the log shows the cause
    in full, once, and nothing under it. Retries follow the DAG's retry policy: RetryableStageFailure retries (a
    rank killed by a signal, a lost peer), StageFailure fails at once. str() is the cause (failure notifications).
    """

    def __init__(self, cause: str):
        super().__init__(1)
        self.cause = cause

    def __str__(self) -> str:
        return self.cause


class RetryableStageFailure(StageFailure):
    """A cause a retry can fix (StageError.retryable): the train task resumes from its last checkpoint."""


def failure(cause: str, retryable: bool = False) -> StageFailure:
    """Log the cause at ERROR (the task log's failure line) and return the exception that ends the task."""
    log.error(cause)
    return (RetryableStageFailure if retryable else StageFailure)(cause)


# --- Scheduling ---------------------------------------------------------------------------------------------------

SCHEDULE_ENV = "LLM_PIPELINE_SCHEDULE"


def time_schedule(env: str = SCHEDULE_ENV) -> str | None:
    """The cron expression of a DAG's timed runs, read when the DAG is parsed: `$LLM_PIPELINE_SCHEDULE` (e.g.
    "0 3 * * 1"), None when unset, empty or "off". Timed runs are opt-in: with catchup off, Airflow still starts
    the most recent missed time as soon as a DAG is unpaused, so a schedule nobody asked for would start a full
    training run on first use."""
    value = os.environ.get(env, "").strip()
    if value.lower() in ("", "off", "none"):
        return None
    from croniter import croniter

    # CronTriggerTimetable takes Airflow's presets (airflow/sdk/definitions/timetables/_cron.py CRON_PRESETS; croniter
    # lacks @quarterly) or an expression croniter reads: anything else parsed, and failed the scheduler run after run
    expression = {"@quarterly": "0 0 1 */3 *"}.get(value, value)
    if not croniter.is_valid(expression):
        raise ConfigError(f"{env}={value!r} is not a cron expression (e.g. '0 3 * * 1' or @daily); fix it, or unset it")
    return value


# --- The DAG run's directory and the CLI ----------------------------------------------------------------------------

DAG_RUN_FILE = "dag-run.json"


def join_dag_run(cfg: PipelineConfig, dag_id: str, run_id: str, try_number: int = 1) -> str | None:
    """The DAG run's MLflow parent run (get or create; None with tracking off), recorded in its run directory."""
    parent = tracking.parent_run(cfg, dag_id, run_id, try_number) if cfg.tracking.enabled else None
    from tasks.config import get

    # the keys the run set (Params, overrides: cfg.explicit) with their values, JSON-safe (a path as its text)
    overrides = {k: get(cfg, k) for k in sorted(cfg.explicit)}
    config = {"preset": cfg.preset, "overrides": json.loads(json.dumps(overrides, default=str))}
    mark_dag_run(default_run_dir(dag_id, run_id), dag_id, run_id, parent, config)
    return parent


def mark_dag_run(run_dir, dag_id: str, run_id: str, parent_run_id: str | None, config: dict | None = None) -> None:
    """<run-dir>/dag-run.json: which DAG run (and MLflow parent run) this directory belongs to, so a stage run by
    `python -m tasks <stage> --run-dir <it>` (a Kubernetes Job's pod, a rerun by hand) joins that DAG run's MLflow
    parent instead of the CLI's own experiment, and — without --config — runs with that DAG run's config (its
    preset and Params) rather than the default preset's (tasks/cli.py)."""
    from pathlib import Path

    record = {"dag_id": dag_id, "run_id": run_id, "parent_run_id": parent_run_id}
    if config is not None:
        record["config"] = config
    path = Path(run_dir) / DAG_RUN_FILE
    if not path.is_file() or read_json(path) != record:
        atomic_write_json(path, record)


# --- Approval -------------------------------------------------------------------------------------------------------


def approval_of(result: dict, cfg: PipelineConfig) -> dict:
    """evaluate.json's `approval` contract {"needed": bool, "reason": str, "version": str}, with
    evaluate.require_approval folded in: needed when the config asks for it (the evaluation sets `needed` only
    for the same reason), and only for a registered version that is not already the champion."""
    a = dict(result.get("approval") or {})
    version = str(a.get("version") or result.get("version") or "")
    reason = str(a.get("reason") or "")
    needed = bool(a.get("needed"))
    if cfg.evaluate.require_approval and version and not result.get("champion") and not needed:
        said = reason or result.get("champion_reason")
        needed, reason = True, "evaluate.require_approval is set" + (f"; the comparison says: {said}" if said else "")
    return {"needed": needed and bool(version), "reason": reason, "version": version}


def _evaluation(params: dict, dag_id: str, run_id: str):
    run_dir = default_run_dir(dag_id, run_id)
    cfg = config_for_run(params, run_dir, dag_id)
    path = run_dir / "evaluate.json"
    return run_dir, cfg, (read_json(path) if path.is_file() else {})


def approval_request(params: dict, dag_id: str, run_id: str) -> dict:
    """What the approve task shows: {"subject", "body" (Markdown: the reason, the gate's figures, the comparison
    table), "registered_model", "version", "reason"}; {} when no approval is needed (the task is skipped)."""
    run_dir, cfg, result = _evaluation(params, dag_id, run_id)
    a = approval_of(result, cfg)
    if not a["needed"]:
        log.info(f"no approval needed: {result.get('champion_reason') or 'no version registered'}")
        return {}
    name, version = result.get("registered_model", cfg.evaluate.registered_model), a["version"]
    comparison = run_dir / "evaluate" / "comparison.md"
    body = [
        f"**Why a person decides:** {a['reason']}",
        "",
        f"**Evaluation:** {result.get('summary', '')}",
        "",
        f"**Champion comparison:** {result.get('champion_reason', '(none)')}",
    ]
    if result.get("mlflow_run_id"):
        body += [
            "",
            f"Evaluation run: {tracking.run_url(result['mlflow_run_id'], cfg, result.get('mlflow_experiment_id'))}",
        ]
    if comparison.is_file():
        body += ["", comparison.read_text(encoding="utf-8")]
    body += [
        "",
        f"**Approve** sets the alias `champion` on {name} v{version}; **Reject** leaves the champion as it is.",
    ]
    log.info(f"approval needed for {name} v{version}: {a['reason']}")
    return {
        "subject": f"Promote {name} v{version} to champion?",
        "body": "\n".join(body),
        "registered_model": name,
        "version": version,
        "reason": a["reason"],
    }


def _responder(answer: dict | None) -> str:
    user = (answer or {}).get("responded_by_user") or {}
    return str(user.get("name") or user.get("id") or "?") if isinstance(user, dict) else str(user)


def promote_approved(params: dict, dag_id: str, run_id: str, answer: dict | None) -> dict:
    """The promote task (runs only on "Approve"): the `champion` alias on the approved version
    (quant.registry.promote), and <run-dir>/approval.json recording who approved what and why."""
    run_dir, cfg, result = _evaluation(params, dag_id, run_id)
    a = approval_of(result, cfg)
    name = result.get("registered_model", cfg.evaluate.registered_model)
    if not a["version"]:
        raise ConfigError(f"promote: {run_dir / 'evaluate.json'} names no registered version to promote")
    from tasks.quant import registry

    by = _responder(answer)
    tracking.bound_http()
    registry.promote(tracking.tracking_uri(cfg), name, a["version"], by=by, reason=a["reason"])
    record = {
        "outcome": "approved",
        "by": by,
        "at": str((answer or {}).get("responded_at") or ""),
        "registered_model": name,
        "version": a["version"],
        "reason": a["reason"],
    }
    atomic_write_json(run_dir / APPROVAL_FILE, record)
    log.info(f"{name} v{a['version']} is the champion now (approved by {by})")
    return record


def record_answer(run_dir, answer: dict) -> None:
    """A rejection (or an unanswered request that timed out) into <run-dir>/approval.json for the summary; an
    approval is recorded by the promote task itself."""
    from pathlib import Path

    chosen = (answer or {}).get("chosen_options") or []
    path = Path(run_dir) / APPROVAL_FILE
    if "Approve" in chosen or path.is_file():
        return
    evaluate = Path(run_dir) / "evaluate.json"
    result = read_json(evaluate) if evaluate.is_file() else {}
    atomic_write_json(
        path,
        {
            "outcome": "rejected",
            "by": _responder(answer),
            "at": str(answer.get("responded_at") or ""),
            "registered_model": result.get("registered_model", ""),
            "version": str(result.get("version") or ""),
            "reason": str((result.get("approval") or {}).get("reason") or ""),
        },
    )


def shard_step(step: str, params: dict, dag_id: str, run_id: str, arg=None):
    """One fanned-out shard task of a DAG run: `prepare` → [{job, index}] per partition ([] on a cache hit),
    `partition` ({job, index}) → its summary, `layout` (prepare's list) → [{job, index}] per write range,
    `write` ({job, index}) → its summary. XCom carries only these paths and indices."""
    from data_prep.errors import DataPrepError
    from data_prep.job import Job, prepare
    from data_prep.layout import run_layout
    from data_prep.partition import run_partition
    from data_prep.writer import run_write
    from tasks.errors import StageError
    from tasks.stages.shard import shard_config

    run_dir = default_run_dir(dag_id, run_id)
    cfg = config_for_run(params, run_dir, dag_id)
    threads = cfg.data.tokenize_processes
    try:
        if step == "prepare":
            if cfg.tracking.enabled:  # the DAG run's MLflow parent run starts with its first task (llm_data: this)
                with tracking.best_effort("the MLflow parent run"):
                    tracking.parent_run(cfg, dag_id, run_id)
            job = prepare(shard_config(cfg)).job
            return [{"job": str(job.dir), "index": i} for i in range(len(job.partitions))] if job else []
        if step == "layout":
            if not arg:
                return []
            layout = run_layout(Job.load(arg[0]["job"]))
            writes = [] if layout["published"] else layout["writes"]
            return [{"job": arg[0]["job"], "index": i} for i in range(len(writes))]
        job = Job.load(arg["job"])
        if step == "partition":
            return run_partition(job, arg["index"], threads)
        if step == "write":
            return run_write(job, arg["index"])
    except DataPrepError as e:
        cause = f"shard: {e}"
    else:
        raise StageError(f"shard: unknown step {step!r} (prepare, partition, layout, write)")
    from tasks.errors import os_error_cause
    from tasks.fsutil import atomic_write_json

    try:  # the run summary's line for the stage (the reduce, which would write it, will not run)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            run_dir / "shard.json", {"stage": "shard", "status": "failed", "summary": cause, "error": cause}
        )
    except OSError as e:
        print(f"warning: could not write the failure record ({os_error_cause(e)})", file=sys.stderr)
    raise StageError(cause)


def approval_timeout_from_run_config(context) -> None:
    """pre_execute of the `approve` task: how long it waits for a person, from this run's own config
    (evaluate.approval_timeout_h of the run's preset and Params), replacing the parse-time default preset's. The
    provider's HITLOperator.execute reads response_timeout after pre_execute (operators/hitl.py: the timeout it
    parks the task with). A config the stages refuse leaves the parse-time value (the run has failed before)."""
    import datetime

    from tasks.errors import StageError
    from tasks.runner import default_run_dir

    try:
        run_dir = default_run_dir(context["dag"].dag_id, context["run_id"])
        cfg = config_for_run(dict(context["params"]), run_dir, context["dag"].dag_id)
    except StageError:
        return
    context["task"].response_timeout = datetime.timedelta(hours=cfg.evaluate.approval_timeout_h)


def bound_from_run_config(context, stage: str | None = None) -> None:
    """pre_execute: the task's execution_timeout from this run's own config (Params; train: steps × the planner's
    step estimate × margin), replacing the parse-time bound of the default preset. `stage`: whose bound (default the
    task id; the shard fan-out's tasks: "shard"). Used by dags/llm_pipeline.py, dags/llm_data.py and
    tasks/shard_fanout.py; Airflow's task runner calls it before it reads execution_timeout."""
    import pendulum

    from tasks.bounds import task_timeout_s
    from tasks.errors import StageError
    from tasks.runner import default_run_dir

    task = context["task"]
    try:  # a relative $LLM_PIPELINE_VAR_DIR too: raised here, before the task body, it would be retried
        run_dir = default_run_dir(context["dag"].dag_id, context["run_id"])
        cfg = config_for_run(dict(context["params"]), run_dir, context["dag"].dag_id)
    except StageError:
        return  # the stage itself refuses the config, in one line; the parse-time bound stays
    task.execution_timeout = pendulum.duration(seconds=task_timeout_s(stage or task.task_id, cfg, run_dir))
