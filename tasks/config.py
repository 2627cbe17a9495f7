"""The one typed pipeline configuration.

Layers, later wins: dataclass defaults → a YAML preset from configs/ (or a file) → overrides (DAG Params, `--conf`,
as a nested dict or dotted keys) → CLI `--set section.key=value`. `validate()` reports every problem, one line each.

`cfg.explicit` is the set of dotted keys the caller set for this run — overrides and `--set`, not the preset's
values, which are defaults like the dataclasses' own. Stages use it where a value can come from elsewhere: a stage
reading a shard set takes data.seq_len from its manifest unless the caller set a different one explicitly.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tasks.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_PRESET = "demo-cpu"


@dataclass
class HardwareConfig:
    device: str = "auto"                  # auto | cpu | cuda | npu
    nproc_per_node: int = 0               # processes per node; 0 = one per device (2 on CPU)
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = "127.0.0.1:29400"  # c10d rendezvous host:port (multi-node: the first node's address)
    cluster: str = "cpu-laptop"           # planner cluster preset (910b, 910c, a100-80g, h100-80g, cpu-laptop)
    device_memory_gb: float = 0.0         # 0 = from the cluster preset / measured
    intra_node_gbps: float = 0.0          # 0 = from the cluster preset
    inter_node_gbps: float = 0.0
    intra_node_latency_us: float = 0.0    # one collective call's fixed cost (α); 0 = from the cluster preset
    inter_node_latency_us: float = 0.0
    peak_tflops: float = 0.0
    hccl_connect_timeout: int = 120       # s, CANN range [120, 7200]
    # s, 0 = never. CANN's A2/A3 default 1836 is fine for training steps; a synchronous checkpoint save longer than
    # that (other ranks wait in the next collective) needs more: raise it above the longest save, e.g. 3600, and keep
    # train.timeout_s above it (CANN 8.5 HCCL env-var docs, hcclug_000074; README "Ascend: thresholds").
    hccl_exec_timeout: int = 1836
    probe_sizes_mb: list[float] = field(default_factory=lambda: [1, 4, 16])
    expected_bus_gbps: float = 0.0        # 0 = backend default (HCCS ~50 GB/s on NPU, none on CPU)
    # Clock offset to NTP, multi-node: warn above 10 ms (cross-node profile timelines stop lining up), fail above
    # 500 ms (HCCL link set-up times out across nodes) — the field guides' two numbers, README "Ascend: thresholds".
    warn_clock_offset_ms: float = 10.0
    max_clock_offset_ms: float = 500.0
    min_free_disk_gb: float = 1.0
    min_host_memory_gb: float = 2.0
    # CANN logs for the ranks (tasks/envcheck/cann_logs.py): ASCEND_GLOBAL_LOG_LEVEL -1 = leave the environment's,
    # 0 DEBUG, 1 INFO, 2 WARNING, 3 ERROR (CANN's default; the guides: 3 in production, 0/1 only while debugging:
    # DEBUG logging slows the host side), 4 NULL. ascend_log_stdout sets ASCEND_SLOG_PRINT_TO_STDOUT=1 (logs in the
    # rank logs instead of ~/ascend/log). On a failed stage at most cann_log_max_mb of the CANN logs it wrote are
    # copied to <run-dir>/<stage>/cann-logs/ and MLflow.
    ascend_log_level: int = -1
    ascend_log_stdout: bool = False
    cann_log_max_mb: float = 50.0
    # Health DAG alarms (tasks/health.py).
    max_device_temp_c: float = 85.0       # a chip at or above this temperature raises an alarm
    max_hbm_used_pct: float = 95.0        # HBM this full with no process on the chip = leaked memory
    expected_devices: int = 0             # chips per node; 0 = the most this host has shown before
    # How training runs: torchrun on this host, or a Kubernetes Job (deploy/k8s, requirements-k8s.txt).
    # Ranks bound to the cores nearest their device (npu-smi topo / sysfs on NPU, torchrun --numa-binding on CUDA,
    # an even split on CPU; tasks/parallel/binding.py). false = let the OS schedule them.
    bind_cpus: bool = True
    launcher: str = "local"               # local | kubernetes
    k8s_namespace: str = "llm"
    k8s_image: str = ""                   # the training image (docker/Dockerfile.ascend); required for kubernetes
    k8s_scheduler: str = "default"        # default | volcano (gang-schedules multi-pod stages: PodGroup minMember)


@dataclass
class DataConfig:
    inputs: list[str] = field(default_factory=lambda: ["stdlib"])  # files/dirs/globs; "stdlib" = Python's own sources
    text_field: str = "text"              # .jsonl/.parquet column holding the text
    out_dir: str = "var/data"             # shard sets are versioned directories below it
    max_documents: int = 0                # 0 = all
    min_chars: int = 16
    max_chars: int = 1_000_000
    on_decode_error: str = "replace"      # replace | skip
    tokenizer: str = "train"              # "train" (byte-level BPE on the corpus) or a tokenizer.json / model dir
    vocab_size: int = 4096
    seq_len: int = 256
    val_fraction: float = 0.05
    shard_size_mb: float = 16.0
    tokenize_processes: int = 2
    token_dtype: str = "auto"             # auto (uint16 when the vocabulary fits) | uint16 | uint32
    # "" = tokenizer_config.json's eos_token or a usual name (<|endoftext|>, </s>…)
    eos_token: str = ""
    shard_multiple: int = 0               # shard count is a multiple of this; 0 = world size × max(1, loader_workers)
    loader_workers: int = 1               # loader processes per rank; -1 = from the rank's cores (cores − 1, max 4)
    prefetch_factor: int = 2              # batches each loader worker keeps ready (torch DataLoader prefetch_factor)
    verify_sha256: bool = False           # loader checks every shard's sha256 against the manifest before reading


@dataclass
class ModelConfig:
    preset: str = "demo"                  # tasks.model presets: debug, demo, qwen2-0.5b, … llama-13b, moe-demo, …
    hf_path: str = ""                     # initialise from a local HF directory instead of random weights
    # Shape overrides (0 / "" = the preset's value).
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    ffn_dim: int = 0
    vocab_size: int = 0                   # 0 = preset, or the tokenizer's size when the preset allows
    rope_theta: float = 0.0
    max_seq_len: int = 0
    # Mixture of experts (MoE presets: moe-demo, qwen1.5-moe-a2.7b, qwen2-57b-a14b; tasks/model/moe.py)
    n_experts: int = 0
    top_k: int = 0
    moe_ffn_dim: int = 0
    aux_loss_coef: float = -1.0           # router load-balancing loss weight (-1 = the preset's, 0 = off)
    capacity_factor: float = -1.0         # -1 = the preset's (dropless); > 0 drops tokens above the capacity
    # NPU fused kernels (torch_npu.npu_rms_norm / npu_rotary_mul / npu_swiglu) swapped in after the model is built:
    # auto = on when the device is an NPU and the op exists; off = plain PyTorch everywhere (tasks/model/npu_kernels)
    npu_kernels: str = "auto"


@dataclass
class ParallelConfig:
    dp: int = 0                           # 0 = chosen by the planner
    tp: int = 0
    pp: int = 0
    zero: int = 3                         # 0 replicated DP, 1 + sharded AdamW state, 2 FSDP2 (no reshard), 3 FSDP2
    sequence_parallel: bool = True
    recompute: str = "none"               # none | selective | full
    recompute_every: int = 1              # checkpoint every k-th layer (full)
    pp_schedule: str = "1f1b"             # gpipe | 1f1b | interleaved1f1b
    microbatches: int = 0                 # 0 = global_batch / micro_batch per DP rank
    virtual_stages: int = 2               # for interleaved1f1b
    ep: int = 1                           # expert parallelism (MoE): experts split over ep of the dp ranks


@dataclass
class TrainConfig:
    steps: int = 60
    global_batch: int = 8                 # sequences per optimizer step, all ranks
    micro_batch: int = 2                  # sequences per forward on one rank
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: str = "bf16"               # fp32 | bf16 | fp16
    seed: int = 1234
    checkpoint_every: int = 20
    keep_checkpoints: int = 2
    # Process-group (torch watchdog) timeout. Must exceed HCCL_EXEC_TIMEOUT (1836 s default) so that on NPU HCCL
    # reports the failing collective first; checked by validate() on NPU and by the env stage.
    timeout_s: int = 1900


@dataclass
class SmokeConfig:
    steps: int = 20                       # per precision (FP32 then BF16)
    lr: float = 3e-3
    window: int = 5                       # k: compare mean of the first k with the last k losses
    min_drop: float = 0.05                # relative drop required
    bf16_tolerance: float = 0.05          # max relative gap between the FP32 and BF16 curves
    micro_batch: int = 4
    # "Accuracy worse than on GPU → compare operator by operator": one forward of the same weights and batch on the
    # device in compare_precision and in FP32 on the CPU; the first layer whose max |diff| / max |FP32 output|
    # exceeds compare_tolerance is named (per-layer table in smoke_report.json and MLflow). On a CPU host it
    # compares CPU BF16 with CPU FP32. BF16 keeps 8 mantissa bits (~0.4 % per rounding): 5 % flags real departures.
    compare_with_cpu: bool = False
    compare_precision: str = "bf16"       # fp32 | bf16 | fp16 (autocast on the device)
    compare_tolerance: float = 0.05


@dataclass
class PlanConfig:
    zero_stages: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    recompute: list[str] = field(default_factory=lambda: ["none", "selective", "full"])
    schedules: list[str] = field(default_factory=lambda: ["1f1b", "gpipe", "interleaved1f1b"])
    efficiency: float = 0.4               # achieved fraction of peak FLOP/s
    runtime_reserve_gb: float = 0.0       # 0 = backend default (CANN/HCCL ≈ 5 GB on NPU)
    top_k: int = 10
    flash_attention: bool = True          # fused SDPA keeps no s×s scores (false: Korthikanti's 5as/h term)


@dataclass
class ProfileConfig:
    enabled: bool = True
    skip_first: int = 1
    wait: int = 0
    warmup: int = 1
    active: int = 2
    record_shapes: bool = False
    profile_memory: bool = True
    with_stack: bool = False
    npu_level: str = "Level1"             # Level_none | Level0 | Level1 | Level2
    aic_metrics: str = "PipeUtilization"
    use_msprof: bool = False              # wrap the run in `msprof --application` when msprof is on PATH
    # Step breakdown of Ascend data from msprof-analyze (PyPI msprof-analyze, matching the CANN version) or the
    # built-in readers; auto = msprof-analyze when on PATH, else built-in. Where both run they must agree within 1 %.
    analyzer: str = "auto"                # auto | builtin | msprof-analyze
    fail_on_regression: bool = False
    regression_threshold: float = 0.10


@dataclass
class QuantizeConfig:
    # int8_weight_only | int8_dynamic (W8A8, activations per-token dynamic: torchao's Int8DynamicActivation and AMCT's
    # inputs.strategy "token") | smoothquant (W8A8, per-tensor activations, calibrated)
    method: str = "int8_weight_only"
    backend: str = "auto"                 # auto (AMCT on an NPU host where it imports, else torchao) | amct | torchao
    # substrings of layer names (ours or HF)
    skip_layers: list[str] = field(default_factory=lambda: ["lm_head", "embed"])
    calibration_batches: int = 4
    amct_flow: str = "llm"                # llm (quantize/convert) | ptq (ONNX fake-quant + deploy)
    # bf16 | fp16 | fp32 (not with AMCT: INT8 on fp16/bf16 only): unquantized parts
    dtype: str = "bf16"
    qat_on_fail: bool = True              # PTQ misses the gate → quantization-aware fine-tune, then gate again
    qat_steps: int = 50                   # QAT optimizer steps on the training shards (lr: train.min_lr)


@dataclass
class EvaluateConfig:
    max_drop_pct: float = 2.0             # gate: evaluate.gate_metric may be at most this many percent
    # accuracy_drop_pct (relative next-token top-1 drop) | ppl_drop_pct | greedy_disagreement_pct — each INT8 vs the
    # unquantized model in quantize.dtype
    gate_metric: str = "accuracy_drop_pct"
    eval_batches: int = 8
    agreement_windows: int = 8            # evaluation windows whose greedy continuations INT8 and BF16 must match
    latency_tokens: int = 32
    prompts: list[str] = field(default_factory=lambda: ["def ", "import ", "class "])
    max_new_tokens: int = 24
    registered_model: str = "llm-pipeline-demo"
    fail_on_gate: bool = True


@dataclass
class TrackingConfig:
    uri: str = ""                         # "" = $MLFLOW_TRACKING_URI or sqlite:///<repo>/var/mlflow.db
    experiment: str = "llm-pipeline"
    artifact_root: str = ""               # "" = <repo>/var/mlartifacts (new experiments only)
    ui_url: str = ""                      # "" = $MLFLOW_UI_URL or http://127.0.0.1:5000 (tracking.ui_url())
    enabled: bool = True


@dataclass
class TimeoutConfig:
    """Bounds on every wait, in seconds (tasks/bounds.py): each DAG task's execution_timeout, the torchrun and
    Kubernetes Job waits inside it, and the cross-node probe's rendezvous."""
    env_s: int = 900
    shard_s: int = 3600
    smoke_s: int = 1800
    plan_s: int = 600
    train_s: int = 0                      # 0 = steps × the planner's step estimate × train_margin + train_overhead_s
    train_margin: float = 4.0             # how much slower than the planner's estimate a step may be
    train_overhead_s: int = 900           # start-up, rendezvous, checkpoints, HF export
    profile_s: int = 1800
    quantize_s: int = 3600
    evaluate_s: int = 3600
    rendezvous_s: int = 300               # the cross-node probe waits this long for every node to arrive
    k8s_pending_s: int = 900              # a Job's pods may wait this long to be scheduled, on top of the stage's bound


@dataclass
class PipelineConfig:
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    preset: str = ""                      # which preset/file this came from (informational)

    def __post_init__(self):
        # Not a field: not in to_dict()/digest(); copy.deepcopy keeps it, dataclasses.replace starts it empty.
        self.explicit: set[str] = set()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        import hashlib

        body = json.dumps({k: v for k, v in self.to_dict().items() if k != "preset"}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:12]


SECTIONS = [f.name for f in dataclasses.fields(PipelineConfig) if f.name != "preset"]

# Enumerations and ranges: checked by validate(); the DAG's Params mirror them.
CHOICES = {
    "hardware.device": ["auto", "cpu", "cuda", "npu"],
    "hardware.launcher": ["local", "kubernetes"],
    "hardware.k8s_scheduler": ["default", "volcano"],
    "model.npu_kernels": ["auto", "off"],
    "data.on_decode_error": ["replace", "skip"],
    "data.token_dtype": ["auto", "uint16", "uint32"],
    "parallel.recompute": ["none", "selective", "full"],
    "parallel.pp_schedule": ["gpipe", "1f1b", "interleaved1f1b"],
    "parallel.zero": [0, 1, 2, 3],
    "train.precision": ["fp32", "bf16", "fp16"],
    "smoke.compare_precision": ["fp32", "bf16", "fp16"],
    "profile.npu_level": ["Level_none", "Level0", "Level1", "Level2"],
    "profile.aic_metrics": ["PipeUtilization", "ArithmeticUtilization", "Memory", "MemoryL0", "MemoryUB",
                            "ResourceConflictRatio", "L2Cache", "MemoryAccess", "AiCoreNone"],  # torch_npu AiCMetrics
    "profile.analyzer": ["auto", "builtin", "msprof-analyze"],
    "quantize.method": ["int8_weight_only", "int8_dynamic", "smoothquant"],
    "quantize.backend": ["auto", "amct", "torchao"],
    "quantize.amct_flow": ["llm", "ptq"],
    "quantize.dtype": ["bf16", "fp16", "fp32"],
    "evaluate.gate_metric": ["accuracy_drop_pct", "ppl_drop_pct", "greedy_disagreement_pct"],
}
ITEM_CHOICES = {  # lists whose every item must be one of these
    "plan.zero_stages": CHOICES["parallel.zero"], "plan.recompute": CHOICES["parallel.recompute"],
    "plan.schedules": CHOICES["parallel.pp_schedule"],
}
RANGES = {  # inclusive (min, max); None = unbounded
    "hardware.nproc_per_node": (0, 1024), "hardware.nnodes": (1, 4096), "hardware.node_rank": (0, 4095),
    "hardware.max_device_temp_c": (0.0, 150.0), "hardware.max_hbm_used_pct": (1.0, 100.0),
    "hardware.expected_devices": (0, 1024), "hardware.ascend_log_level": (-1, 4),
    "hardware.cann_log_max_mb": (0.0, 100_000.0),
    "hardware.hccl_connect_timeout": (120, 7200), "hardware.hccl_exec_timeout": (0, 2147483647),
    "data.seq_len": (8, 1 << 20), "data.vocab_size": (256, 1 << 22), "data.val_fraction": (0.0, 0.5),
    "data.shard_size_mb": (0.01, 100_000), "data.tokenize_processes": (1, 256), "data.loader_workers": (-1, 64),
    "data.prefetch_factor": (1, 64),
    "data.max_documents": (0, None), "data.min_chars": (0, None), "data.shard_multiple": (0, 1 << 16),
    "parallel.dp": (0, 1 << 16), "parallel.tp": (0, 1024), "parallel.pp": (0, 1024),
    "parallel.ep": (1, 1024), "model.n_experts": (0, 4096), "model.top_k": (0, 4096), "model.moe_ffn_dim": (0, None),
    "model.aux_loss_coef": (-1.0, 100.0), "model.capacity_factor": (-1.0, 1000.0),
    "parallel.recompute_every": (1, 1024), "parallel.microbatches": (0, 1 << 16), "parallel.virtual_stages": (1, 64),
    "train.steps": (1, None), "train.global_batch": (1, None), "train.micro_batch": (1, None),
    "train.lr": (0.0, None), "train.warmup_steps": (0, None), "train.grad_clip": (0.0, None),
    "train.checkpoint_every": (0, None), "train.keep_checkpoints": (1, 1000),
    "smoke.steps": (2, 100_000), "smoke.window": (1, 10_000), "smoke.bf16_tolerance": (0.0, 10.0),
    "smoke.compare_tolerance": (0.0, 100.0),
    "plan.efficiency": (0.01, 1.0),
    "profile.skip_first": (0, None), "profile.wait": (0, None), "profile.warmup": (0, None),
    "profile.active": (1, None), "profile.regression_threshold": (0.0, 10.0),
    "quantize.calibration_batches": (1, 100_000), "quantize.qat_steps": (1, 1_000_000),
    "evaluate.agreement_windows": (0, 100_000),
    "evaluate.max_drop_pct": (0.0, 100.0), "evaluate.eval_batches": (1, 100_000),
    **{f"timeouts.{k}_s": (1, None) for k in ("env", "shard", "smoke", "plan", "profile", "quantize", "evaluate",
                                             "rendezvous", "k8s_pending")},
    "timeouts.train_s": (0, None), "timeouts.train_margin": (1.0, 1000.0), "timeouts.train_overhead_s": (0, None),
}


class _Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where `1e-4` (no dot) is a string; YAML 1.2 and every user read it as a float."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def _section_types(section_cls) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Coerce YAML/JSON/CLI values to the field's declared type; strings from --set are parsed as YAML scalars."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        typ = [t for t in typing.get_args(typ) if t is not type(None)][0]
    if isinstance(value, str) and typ is not str:
        try:
            value = yaml_load(value) if value.strip() else value
        except yaml.YAMLError:
            pass
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or int(value) != value:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if typ is list or origin is list:
        if isinstance(value, str):  # --set plan.zero_stages=0,1
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = (typing.get_args(typ) or (None,))[0]  # list[int]: every item coerced like a scalar field
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)] if item else list(value)
    return value


def _flatten(overrides: dict, prefix: str = "") -> dict[str, Any]:
    """{"data": {"seq_len": 128}} and {"data.seq_len": 128} both become {"data.seq_len": 128}."""
    flat = {}
    for key, value in (overrides or {}).items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted.count(".") == 0 and key in SECTIONS:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def apply_overrides(cfg: PipelineConfig, overrides: dict, explicit: bool = True) -> PipelineConfig:
    """Set dotted (or nested) keys; `explicit` records them in cfg.explicit (a preset's values are not)."""
    problems = []
    for dotted, value in _flatten(overrides).items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS:
            problems.append(f"{dotted}: unknown section {section!r} (known: {', '.join(SECTIONS)})")
            continue
        sec = getattr(cfg, section)
        types_ = _section_types(type(sec))
        if key not in types_:
            problems.append(f"{dotted}: unknown key (known in {section}: {', '.join(types_)})")
            continue
        try:
            setattr(sec, key, _coerce(value, types_[key], dotted))
            if explicit:
                cfg.explicit.add(dotted)
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def parse_sets(sets) -> dict[str, str]:
    out = {}
    for item in sets or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected section.key=value (positional arguments go before --set)")
        out[key.strip()] = value
    return out


def resolve_preset(preset_or_path: str | None) -> Path:
    name = preset_or_path or os.environ.get("LLM_PIPELINE_PRESET") or DEFAULT_PRESET
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {name} does not exist")
        if path.suffix not in (".yaml", ".yml"):  # e.g. --config /etc/passwd: not a preset, whatever it parses to
            raise ConfigError(f"--config {name}: not a YAML preset (a .yaml/.yml file or a preset name: "
                              f"{', '.join(sorted(p.stem for p in CONFIG_DIR.glob('*.yaml')))})")
        return path
    candidate = CONFIG_DIR / f"{name}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(known)})")
    return candidate


def load_yaml(path: Path) -> dict:
    try:
        data = yaml_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def load_config(preset_or_path: str | None = None, overrides: dict | None = None, sets=()) -> PipelineConfig:
    path = resolve_preset(preset_or_path)
    cfg = PipelineConfig(preset=str(path.stem if path.parent == CONFIG_DIR else path))
    apply_overrides(cfg, load_yaml(path), explicit=False)
    apply_overrides(cfg, overrides or {})
    apply_overrides(cfg, parse_sets(sets))
    validate(cfg)
    return cfg


def get(cfg: PipelineConfig, dotted: str):
    section, _, key = dotted.partition(".")
    return getattr(getattr(cfg, section), key)


def validate(cfg: PipelineConfig) -> PipelineConfig:
    problems = []
    for dotted, allowed in CHOICES.items():
        if get(cfg, dotted) not in allowed:
            problems.append(f"{dotted}: {get(cfg, dotted)!r} is not one of {', '.join(map(str, allowed))}")
    for dotted, allowed in ITEM_CHOICES.items():
        bad = [v for v in get(cfg, dotted) if v not in allowed]
        if bad or not get(cfg, dotted):
            problems.append(f"{dotted}: {get(cfg, dotted)!r} must be a non-empty list of "
                            f"{', '.join(map(str, allowed))}")
    for dotted, (lo, hi) in RANGES.items():
        v = get(cfg, dotted)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            problems.append(f"{dotted}: {v} must be {bound}")
    t = cfg.train
    if t.micro_batch > t.global_batch:
        problems.append(f"train.micro_batch: {t.micro_batch} exceeds train.global_batch {t.global_batch}")
    if t.min_lr > t.lr:
        problems.append(f"train.min_lr: {t.min_lr} exceeds train.lr {t.lr}")
    if cfg.hardware.node_rank >= cfg.hardware.nnodes:
        problems.append(f"hardware.node_rank: {cfg.hardware.node_rank} must be < hardware.nnodes {cfg.hardware.nnodes}")
    if ":" not in cfg.hardware.rdzv_endpoint:
        problems.append(f"hardware.rdzv_endpoint: {cfg.hardware.rdzv_endpoint!r} must be host:port")
    hw = cfg.hardware
    if hw.device == "npu" and hw.hccl_exec_timeout and t.timeout_s <= hw.hccl_exec_timeout:
        problems.append(f"train.timeout_s: {t.timeout_s} must exceed hardware.hccl_exec_timeout "
                        f"{hw.hccl_exec_timeout} so HCCL reports the real error before torch's watchdog fires")
    if hw.warn_clock_offset_ms > hw.max_clock_offset_ms:
        problems.append(f"hardware.warn_clock_offset_ms: {hw.warn_clock_offset_ms} exceeds "
                        f"hardware.max_clock_offset_ms {hw.max_clock_offset_ms}")
    if not cfg.data.inputs:
        problems.append("data.inputs: at least one input path is required")
    if problems:
        raise ConfigError(problems)
    return cfg


def var_dir() -> Path:
    """Where runs, stores and caches live: <repo>/var, or $LLM_PIPELINE_VAR_DIR (tests, shared disks)."""
    return Path(os.environ.get("LLM_PIPELINE_VAR_DIR") or REPO_ROOT / "var")


def repo_path(p: str | os.PathLike) -> Path:
    """Relative paths in the config are relative to the repository root, whatever the working directory."""
    p = Path(p).expanduser()
    if p.is_absolute():
        return p
    if p.parts and p.parts[0] == "var":  # "var/…" follows var_dir()
        return var_dir().joinpath(*p.parts[1:])
    return REPO_ROOT / p
