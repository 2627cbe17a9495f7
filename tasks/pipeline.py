"""What the orchestrator needs from tasks/, without importing Airflow: trigger-form Params and the stage call.

The DAG turns PARAMS into `airflow.sdk.Param`s (each field's JSON schema — type, enum, minimum/maximum — is the config
model's own, `field_schema()`, so the form refuses exactly what config validation refuses), and calls
`run_for_dag_run()` from each task.
"""

from __future__ import annotations

import functools
import json
import os
import sys

from tasks import tracking
from tasks.errors import ConfigError
from tasks.fsutil import atomic_write_text
from tasks.config import CONFIG_DIR, DEFAULT_PRESET, PipelineConfig, get, load_config
from tasks.runner import default_run_dir, run_stage

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
        "Training ranks per node: one per NPU/GPU; on CPU the number of gloo ranks.",
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
    ("vocab_size", "data.vocab_size", "Data", "Tokenizer vocabulary", "Byte-level BPE trained on the corpus."),
    ("seq_len", "data.seq_len", "Data", "Sequence length", "Tokens per packed training window."),
    (
        "partitions",
        "data.partitions",
        "Data",
        "Shard partitions",
        "Sharding fans out over this many tasks (files, size-balanced); 0 = one per 128 MB of corpus. "
        "The shards are the same whatever the number.",
    ),
    (
        "model_preset",
        "model.preset",
        "Model",
        "Model preset",
        "Shapes: debug, demo, qwen2-0.5b/1.5b/7b, llama3-8b/70b, llama-13b; mixture of experts: moe-demo, "
        "qwen1.5-moe-a2.7b, qwen2-57b-a14b.",
    ),
    (
        "hf_path",
        "model.hf_path",
        "Model",
        "Start from HF checkpoint",
        "A local Hugging Face model directory (config.json + safetensors): its shape and weights start training; "
        "shard with its own tokenizer (Tokenizer = the same directory).",
    ),
    ("dp", "parallel.dp", "Parallelism", "Data parallel (DP)", "0 = chosen by the planner."),
    ("tp", "parallel.tp", "Parallelism", "Tensor parallel (TP)", "Within a node; divides heads and KV heads."),
    ("pp", "parallel.pp", "Parallelism", "Pipeline parallel (PP)", "Across nodes; divides the layers."),
    (
        "ep",
        "parallel.ep",
        "Parallelism",
        "Expert parallel (EP)",
        "MoE models: experts split over EP of the DP ranks; divides DP and the expert count.",
    ),
    ("zero", "parallel.zero", "Parallelism", "ZeRO stage", "0 replicated, 1/2 sharded states, 3 FSDP."),
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
        "max_drop_pct",
        "evaluate.max_drop_pct",
        "Quantization",
        "Max INT8 accuracy drop (%)",
        "The gate: a larger INT8 drop (default: macro task accuracy vs BF16) means QAT, then no registration.",
    ),
    (
        "registered_model",
        "evaluate.registered_model",
        "Quantization",
        "Registered model name",
        "MLflow Model Registry name; versions get the alias candidate, and champion when better.",
    ),
]

LABELS = {  # readable labels for enum values in the trigger form
    "parallel.zero": {
        0: "0 — replicated DP (gradient all-reduce)",
        1: "1 — + AdamW states sharded",
        2: "2 — FSDP2, all shards; parameters gathered forward→backward",
        3: "3 — FSDP2, resharded after forward",
    },
    "quantize.method": {
        "int8_weight_only": "INT8 weight-only",
        "int8_dynamic": "W8A8 dynamic",
        "smoothquant": "SmoothQuant W8A8 (AMCT)",
    },
    "train.precision": {"fp32": "FP32", "bf16": "BF16 (autocast)", "fp16": "FP16 (autocast)"},
    "parallel.recompute": {"none": "none", "selective": "selective (attention)", "full": "full"},
}

FROM_PRESET = "from the preset"  # how an empty (null) field reads in the trigger form
FORM_KEYS = ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "items", "minItems")


@functools.lru_cache(maxsize=None)
def field_schema(key: str) -> dict:
    """The config model's JSON schema of one dotted key (pydantic's: the field's type, Literal, Field(ge/le…))."""
    section, _, name = key.partition(".")
    return PipelineConfig.model_fields[section].annotation.model_json_schema()["properties"][name]


def param_schemas(cfg: PipelineConfig | None = None) -> dict[str, dict]:
    """name → Param kwargs (default, type, title, description, section, enum/values_display, minimum/maximum).

    The constraints are the config model's (`field_schema`), each made nullable: every field but the preset defaults
    to null, "from the preset": only what the user sets overrides the chosen preset, and an explicit value always
    wins, even one equal to some preset's default. The description names the default preset's value, so the form
    still tells what an empty field means.
    """
    cfg = cfg or load_config()
    preset, out = cfg.preset or DEFAULT_PRESET, {}
    for name, key, section, title, desc in PARAMS:
        if key is None:
            presets = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
            presets += [] if preset in presets else [preset]  # a site's own file ($LLM_PIPELINE_PRESET=/etc/…yaml)
            out[name] = dict(
                default=preset, type="string", enum=presets, title=title, section=section, description=desc
            )
            continue
        model, value = field_schema(key), get(cfg, key)
        shown = ", ".join(map(str, value)) if isinstance(value, list) else value
        schema = {k: model[k] for k in FORM_KEYS if k in model}
        schema.update(default=None, type=[model["type"], "null"], title=title, section=section)
        schema["description"] = f"{desc} Empty = {FROM_PRESET} ({preset}: {shown})."
        if "enum" in model:
            labels = {k if isinstance(k, str) else json.dumps(k): v for k, v in LABELS.get(key, {}).items()}
            schema.update(enum=[*model["enum"], None], values_display={**labels, "null": FROM_PRESET})
        out[name] = schema
    return out


def overrides_from_params(params: dict) -> tuple[str | None, dict]:
    """Split trigger Params into (preset, {config.key: value}); an unknown name (a typo in `--conf`, which Airflow
    merges into the Params unchecked) is refused in one line naming it and the known ones.

    null (the form's empty field, or a key left out of `--conf`) means "the chosen preset's value"; any other value
    is the user's and always wins, whatever the preset's default is.
    """
    keys = {name: key for name, key, *_ in PARAMS}
    unknown = sorted(n for n in params if n not in keys)
    if unknown:
        raise ConfigError(
            f"unknown DAG Param{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"(known: {', '.join(keys)})"
        )
    preset = params.get("preset")
    overrides = {keys[n]: v for n, v in params.items() if keys.get(n) is not None and v is not None}
    return preset, overrides


def config_for_params(params: dict) -> PipelineConfig:
    """The DAG's config: Params over the preset, and shards hashed against their manifest wherever they are read
    (data.verify_sha256: a shard with the right size and altered bytes is caught before it is trained on)."""
    preset, overrides = overrides_from_params(params)
    cfg = load_config(preset, overrides=overrides)
    cfg.data.verify_sha256 = True
    problem = tracking.model_name_problem(cfg.evaluate.registered_model)  # refused now, not after the whole run
    if problem:
        raise ConfigError(problem)
    return cfg


def check_conf(text: str) -> PipelineConfig:
    """`make run CONF=…`, checked before Airflow starts: a JSON object of known Params whose config validates."""
    try:
        conf = json.loads(text)
    except ValueError as e:
        raise ConfigError(f'is not JSON ({e}); e.g. CONF=\'{{"preset": "ci-tiny"}}\'') from None
    if not isinstance(conf, dict):
        raise ConfigError(
            f"must be a JSON object of DAG Params, not {type(conf).__name__} {text.strip()[:60]}; "
            'e.g. CONF=\'{"preset": "ci-tiny", "steps": 20}\''
        )
    return config_for_params(conf)


def config_for_run(params: dict, run_dir) -> PipelineConfig:
    """The run's config: Params, and for a run triggered by a published shard set, that set's own data shape
    (seq_len, vocabulary: the shard stage recorded them), so every stage reads exactly what was published."""
    from pathlib import Path

    from tasks.fsutil import read_json

    cfg = config_for_params(params)
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


def stage_args(stage: str, published: dict | None = None, extra: dict | None = None):
    """The stage's flags at their defaults (and `extra`, e.g. the shard stage's reduce=True after its fan-out); the
    shard stage of an asset-triggered run adopts the published set."""
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
    the MLflow parent run. `args`: stage flags to set (dest → value), e.g. the shard stage's reduce=True."""
    run_dir = default_run_dir(dag_id, run_id)
    report = os.environ.get("LLM_PIPELINE_RUN_DIR_FILE")  # set by `make run`: which run directory is its own
    if report:
        atomic_write_text(report, f"{run_dir}\n")
    cfg = config_for_run(params, run_dir)
    parent = tracking.parent_run(cfg, dag_id, run_id, try_number) if cfg.tracking.enabled else None
    if parent and published and stage == "shard":
        tracking.record_asset_event(cfg, parent, published)
    result = run_stage(stage, cfg, run_dir, args=stage_args(stage, published, args), parent_run_id=parent)
    result["run_dir"] = str(run_dir)
    return result


def finish_dag_run(
    params: dict, dag_id: str, run_id: str, success: bool, started_at=None, ended_at=None, reason: str = ""
) -> str | None:
    """End the DAG run's MLflow parent run with the run's outcome, duration and shard set (DAG callbacks)."""
    from tasks.fsutil import read_json

    run_dir = default_run_dir(dag_id, run_id)
    cfg = config_for_params(params)
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
        finish_dag_run(
            params,
            dag.dag_id,
            context["run_id"],
            success,
            started_at=getattr(dag_run, "start_date", None),
            ended_at=getattr(dag_run, "end_date", None),
            reason=str(context.get("reason") or ""),
        )

    callback.__name__ = f"end_parent_run_{'success' if success else 'failure'}"
    return callback


def print_summary(params: dict, dag_id: str, run_id: str) -> str:
    """Print the end-of-run table (stage, status, key figure, MLflow link); return the run directory."""
    from tasks.summary import render

    cfg = config_for_params(params)
    run_dir = default_run_dir(dag_id, run_id)
    experiment_id = None
    if cfg.tracking.enabled:
        import mlflow

        exp = mlflow.MlflowClient(tracking.tracking_uri(cfg)).get_experiment_by_name(cfg.tracking.experiment)
        experiment_id = exp.experiment_id if exp else None
    print(render(run_dir, cfg, experiment_id))
    print(
        f"\nRun directory: {run_dir}\nMLflow UI: mlflow ui --backend-store-uri {tracking.tracking_uri(cfg)} "
        f"--host 127.0.0.1 --port 5000  (then open {tracking.ui_url(cfg)})"
    )
    return str(run_dir)


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
    cfg = config_for_run(params, run_dir)
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
