"""The one typed pipeline configuration: a pydantic model per section (ranges `Field(ge/le)`, choices `Literal`).

Layers, later wins: the models' defaults → a YAML preset from configs/ (or a file) → overrides (DAG Params, `--conf`,
as a nested dict or dotted keys) → CLI `--set section.key=value`, merged and validated by the one model; every
problem is one line (`train.steps: 0 must be in [1, 1000000000]`). The trigger form's schema is the model's
(tasks.pipeline).

`cfg.explicit` is the set of dotted keys the caller set for this run — overrides and `--set`, not the preset's
values, which are defaults like the models' own. Stages use it where a value can come from elsewhere: a stage
reading a shard set takes data.seq_len from its manifest unless the caller set a different one explicitly.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from data_prep.config import DataConfig, Section, problems, repo_path, rule_error, var_dir, yaml_mapping  # noqa: F401 (repo_path, var_dir: tasks' names for them)
from tasks.errors import ConfigError
from tasks.shape import PRESETS as MODEL_PRESETS, preset_problem  # torch-free

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_PRESET = "demo-cpu"
# Bounds of every count, rate and wait (issue 26): a typo such as steps=1e24 is one line, not an overflow later.
MAX_STEPS = 10**9
MAX_LR = 1e4  # high enough that a diverging lr reaches the trainer's divergence guard, finite for the schedule
MAX_SEED = 2**32 - 1
MAX_TIMEOUT_S = 10**7  # ≈ 116 days

Precision = Literal["fp32", "bf16", "fp16"]
Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved1f1b"]
Zero = Literal[0, 1, 2, 3]  # 0 replicated DP, 1 + sharded AdamW state, 2 FSDP2 (no reshard), 3 FSDP2


class HardwareConfig(Section):
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    nproc_per_node: int = Field(0, ge=0, le=1024)  # processes per node; 0 = one per device (2 on CPU)
    nnodes: int = Field(1, ge=1, le=4096)
    node_rank: int = Field(0, ge=0, le=4095)
    rdzv_endpoint: str = "127.0.0.1:29400"  # rendezvous host:port (multi-node: node 0's address, as all nodes reach it)
    cluster: str = "cpu-laptop"  # planner cluster preset (910b, 910c, a100-80g, h100-80g, cpu-laptop)
    # per device, decimal GB; 0 = the cluster preset's. Never taken from the host: the env stage fails when the measured
    # memory (npu-smi's HBM total, torch's total_memory on CUDA) is below the figure used (device-memory check).
    device_memory_gb: float = Field(0.0, ge=0.0, le=1e5)
    intra_node_gbps: float = Field(0.0, ge=0.0, le=1e6)  # 0 = from the cluster preset
    inter_node_gbps: float = Field(0.0, ge=0.0, le=1e6)
    # One all-to-all call's fixed cost (α) in the MoE planner (tasks/planner/moe.py); the dense plan's collectives are
    # costed by bandwidth alone, so these change no dense plan. 0 = from the cluster preset.
    intra_node_latency_us: float = Field(0.0, ge=0.0, le=1e7)
    inter_node_latency_us: float = Field(0.0, ge=0.0, le=1e7)
    peak_tflops: float = Field(0.0, ge=0.0, le=1e7)
    hccl_connect_timeout: int = Field(120, ge=120, le=7200)  # s, CANN range [120, 7200]
    # s, 0 = never. CANN's A2/A3 default 1836 is fine for training steps; a synchronous checkpoint save longer than
    # that (other ranks wait in the next collective) needs more: raise it above the longest save, e.g. 3600, and keep
    # train.timeout_s above it (CANN 8.5 HCCL env-var docs, hcclug_000074; README "Ascend: thresholds").
    hccl_exec_timeout: int = Field(1836, ge=0, le=2147483647)
    probe_sizes_mb: list[Annotated[float, Field(gt=0.0, le=1e5)]] = Field(
        default_factory=lambda: [1, 4, 16], min_length=1
    )
    # false: the env stage skips its torchrun collective probe (a warning says so), as `python -m tasks env --no-probe`
    # does; for DAG runs on hosts whose links an earlier run already probed
    collective_probe: bool = True
    # the env probe warns below half of it; 0 = the cluster's link figure (intra_node_gbps / the preset's; across
    # nodes inter_node_gbps / the preset's) when hardware.cluster is of the backend's kind, else none (probe.py)
    expected_bus_gbps: float = Field(0.0, ge=0.0, le=1e6)
    # Clock offset to NTP, multi-node: warn above 10 ms (cross-node profile timelines stop lining up), fail above
    # 500 ms (HCCL link set-up times out across nodes) — the field guides' two numbers, README "Ascend: thresholds".
    warn_clock_offset_ms: float = Field(10.0, ge=0.0, le=1e7)
    max_clock_offset_ms: float = Field(500.0, ge=0.0, le=1e7)
    min_free_disk_gb: float = Field(1.0, ge=0.0, le=1e6)
    min_host_memory_gb: float = Field(2.0, ge=0.0, le=1e5)
    # CANN logs for the ranks (tasks.device.cann_log_env): ASCEND_GLOBAL_LOG_LEVEL -1 = leave the environment's,
    # 0 DEBUG, 1 INFO, 2 WARNING, 3 ERROR (CANN's default; the guides: 3 in production, 0/1 only while debugging:
    # DEBUG logging slows the host side), 4 NULL. ascend_log_stdout sets ASCEND_SLOG_PRINT_TO_STDOUT=1 (logs in the
    # rank logs instead of ~/ascend/log). On a failed stage at most cann_log_max_mb of the CANN logs it wrote are
    # copied to <run-dir>/<stage>/cann-logs/ and MLflow (tasks/envcheck/cann_logs.py).
    ascend_log_level: int = Field(-1, ge=-1, le=4)
    ascend_log_stdout: bool = False
    cann_log_max_mb: float = Field(50.0, ge=0.0, le=100_000.0)
    # Health DAG alarms (tasks/stages/health.py).
    max_device_temp_c: float = Field(85.0, ge=0.0, le=150.0)  # a chip at or above this temperature: an alarm
    max_hbm_used_pct: float = Field(95.0, ge=1.0, le=100.0)  # HBM this full with no process on the chip = leaked
    expected_devices: int = Field(0, ge=0, le=1024)  # chips per node; 0 = the most this host has shown
    # How training runs: torchrun on this host, or a Kubernetes Job (deploy/k8s; tasks/launch/).
    # Ranks bound to the cores nearest their device (npu-smi topo / sysfs on NPU, torchrun --numa-binding on CUDA,
    # an even split on CPU; tasks/launch/binding.py). false = let the OS schedule them.
    bind_cpus: bool = True
    launcher: Literal["local", "kubernetes"] = "local"
    # CeleryExecutor: the Celery queue that the device stages (tasks.device.DEVICE_STAGES) go to when they
    # run on the Airflow worker (launcher local), e.g. the queue that only the NPU node's worker consumes
    # (`airflow celery worker --queues npu-node-1`); "" = Airflow's default queue. Read when the DAG file is parsed
    # (the $LLM_PIPELINE_PRESET preset): a run's Params cannot move a task to another queue (docs/scale-out.md).
    device_queue: str = Field("", pattern=r"^[A-Za-z0-9_.@-]*$", max_length=200)
    # launcher kubernetes: the training job's kind: an Indexed Job, a Kubeflow PyTorchJob (training-operator v1)
    # or a Kubeflow TrainJob (Trainer v2) (tasks/launch/k8s_job.py)
    k8s_kind: Literal["job", "pytorchjob", "trainjob"] = "job"
    k8s_namespace: str = "llm"
    k8s_image: str = ""  # the training image (docker/Dockerfile.ascend); required for kubernetes
    # volcano gang-schedules multi-pod stages (PodGroup minMember)
    k8s_scheduler: Literal["default", "volcano"] = "default"


SHAPE_OVERRIDES = (  # ModelConfig's fields that override the preset's TransformerConfig fields of the same name
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "vocab_size",
    "rope_theta",
    "max_seq_len",
    "n_experts",
    "top_k",
    "moe_ffn_dim",
    "shared_ffn_dim",
    "aux_loss_coef",
    "capacity_factor",
)


class ModelConfig(Section):
    """What the user sets about the model; tasks.model.resolve turns it into the one shape type,
    `TransformerConfig.from_preset(preset, **overrides())` or `from_hf_config(hf_path, **overrides())`."""

    # tasks.shape's registered presets (debug, demo, qwen2-0.5b, … llama-13b, moe-demo, …): its JSON schema's enum is
    # the trigger form's dropdown; a name nobody registers is refused (below) unless hf_path gives the shape
    preset: str = Field("demo", json_schema_extra={"enum": list(MODEL_PRESETS)})
    hf_path: str = ""  # initialise from a local HF directory instead of random weights
    # Shape overrides; unset (None) = the preset's (or hf_path's config.json's). vocab_size unset on a CPU-sized
    # preset (debug, demo, moe-demo, which have no vocabulary of their own): the shard set's tokenizer's.
    dim: int | None = Field(None, ge=1, le=1 << 20)
    n_layers: int | None = Field(None, ge=1, le=4096)
    n_heads: int | None = Field(None, ge=1, le=4096)
    n_kv_heads: int | None = Field(None, ge=1, le=4096)
    ffn_dim: int | None = Field(None, ge=1, le=1 << 22)
    vocab_size: int | None = Field(None, ge=1, le=1 << 22)
    rope_theta: float | None = Field(None, gt=0.0, le=1e12)
    max_seq_len: int | None = Field(None, ge=1, le=1 << 24)
    # Mixture of experts (MoE presets: moe-demo, qwen1.5-moe-a2.7b, qwen2-57b-a14b; tasks/model/moe.py)
    n_experts: int | None = Field(None, ge=1, le=4096)
    top_k: int | None = Field(None, ge=1, le=4096)
    moe_ffn_dim: int | None = Field(None, ge=1, le=1 << 22)
    shared_ffn_dim: int | None = Field(None, ge=1, le=1 << 22)  # the shared expert's (shared_expert_intermediate_size)
    aux_loss_coef: float | None = Field(None, ge=0.0, le=100.0)  # router load-balancing loss (0 = off)
    capacity_factor: float | None = Field(None, ge=0.0, le=1000.0)  # 0 = dropless; > 0 drops above it
    # Model converters applied in this order to the built model, before any parallelism (tasks/model/converters.py,
    # docs/trainer.md); npu_fused = the NPU fused kernels below (the identity off an NPU); math_attention = opset-11
    # attention (the quantize stage's ONNX export); qat_int8 = INT8 fake quantization of the layers quantize would
    # make INT8 (quantization-aware training; not with parallel.tp > 1).
    converters: list[str] = Field(default_factory=lambda: ["npu_fused"])
    # npu_fused's kernels (torch_npu.npu_rms_norm / npu_rotary_mul / npu_swiglu): auto = on an NPU, those the
    # installed torch_npu has and the SoC supports; off = plain PyTorch everywhere (tasks/model/npu_kernels.py)
    npu_kernels: Literal["auto", "off"] = "auto"

    @model_validator(mode="after")
    def _registered_preset(self):
        """model.preset must be registered (with hf_path the checkpoint's config.json is the shape: any name)."""
        problem = None if self.hf_path else preset_problem(self.preset)
        if problem:
            raise rule_error([problem.removeprefix("model.")])  # problems() names it model.preset again
        return self

    def overrides(self) -> dict:
        """The shape fields the user set ({name: value}): the `**overrides` of TransformerConfig.from_preset."""
        return {k: v for k, v in self.model_dump(include=set(SHAPE_OVERRIDES)).items() if v is not None}


class ParallelConfig(Section):
    dp: int = Field(0, ge=0, le=1 << 16)  # 0 = chosen by the planner
    tp: int = Field(0, ge=0, le=1024)
    pp: int = Field(0, ge=0, le=1024)
    zero: Zero = 3
    sequence_parallel: bool = True
    recompute: Recompute = "none"
    recompute_every: int = Field(1, ge=1, le=1024)  # checkpoint every k-th layer (full)
    pp_schedule: Schedule = "1f1b"
    microbatches: int = Field(0, ge=0, le=1 << 16)  # 0 = global_batch / micro_batch per DP rank
    virtual_stages: int = Field(2, ge=1, le=64)  # for interleaved1f1b
    ep: int = Field(1, ge=1, le=1024)  # expert parallelism (MoE): experts split over ep of the dp ranks


class TrainConfig(Section):
    steps: int = Field(60, ge=1, le=MAX_STEPS)
    global_batch: int = Field(8, ge=1, le=1 << 24)  # sequences per optimizer step, all ranks
    micro_batch: int = Field(2, ge=1, le=1 << 20)  # sequences per forward on one rank
    lr: float = Field(3e-3, ge=0.0, le=MAX_LR)
    min_lr: float = Field(3e-4, ge=0.0, le=MAX_LR)
    warmup_steps: int = Field(10, ge=0, le=MAX_STEPS)  # linear warm-up; past train.steps: train warns before launch
    weight_decay: float = Field(0.1, ge=0.0, le=10.0)
    # adamw (betas 0.9/0.95) or plain SGD (no momentum: no optimizer state; the layout-parity tests use it, with
    # grad_clip 0, because a wrong gradient scale shows in its update where AdamW normalises it away)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    grad_clip: float = Field(1.0, ge=0.0, le=1e6)
    precision: Precision = "bf16"
    # torch.compile of each transformer block (inductor; on Ascend torch_npu's torchair backend "npu"): faster steps
    # after a one-time compile in the first step (tens of seconds to minutes); docs/stages.md
    compile: bool = False
    seed: int = Field(1234, ge=0, le=MAX_SEED)  # numpy's default_rng takes no negative seed
    checkpoint_every: int = Field(20, ge=0, le=MAX_STEPS)
    # rank 0's progress line (step/total, loss, val loss, tokens/s, MFU, ETA) every log_every steps or 30 s,
    # whichever comes first (0 = every 30 s only): in the train task's log and on `make run`'s screen
    log_every: int = Field(20, ge=0, le=MAX_STEPS)
    keep_checkpoints: int = Field(2, ge=1, le=1000)
    # checkpoints written in the background (DCP async_save): a step waits only for the copy into host memory
    async_checkpoint: bool = True
    # Process-group (torch watchdog) timeout. Must exceed HCCL_EXEC_TIMEOUT (1836 s default) so that on NPU HCCL
    # reports the failing collective first; checked by the config's rules on NPU and by the env stage.
    timeout_s: int = Field(1900, ge=1, le=MAX_TIMEOUT_S)
    # Divergence guard (tasks/parallel/divergence.py): a loss above this × the running median of the last 20, or back
    # at ln(vocabulary) after it had fallen, stops the run (a non-finite or zero gradient norm always does); 0 = off.
    divergence_factor: float = Field(10.0, ge=0.0, le=1e6)
    # Validation loss (tasks/train/validation.py): every eval_every steps (0 = train.steps // 10: ten points a run)
    # and at the last step, the loss on the first eval_samples sequences of the shard set's val split (rounded up to
    # whole global batches; 0 = off). early_stop_patience N > 0: the run ends after N evaluations without a new
    # best, and the best step's checkpoint is the one exported.
    eval_every: int = Field(0, ge=0, le=MAX_STEPS)
    eval_samples: int = Field(64, ge=0, le=1 << 24)
    early_stop_patience: int = Field(0, ge=0, le=MAX_STEPS)
    # The rehearsal (tasks/planner/rehearsal.py): the first rehearsal_steps steps of each launch measure every rank's
    # peak memory and the step time against the plan's estimate; over the device or beyond plan.tolerance the run
    # stops in one line naming the next feasible plan. 0 = off.
    rehearsal_steps: int = Field(3, ge=0, le=1000)


class SmokeConfig(Section):
    steps: int = Field(20, ge=2, le=100_000)  # per precision (FP32, then BF16 — or FP16 where the device has no BF16)
    # AdamW's rate for a model of hidden size <= lr_width; a wider one takes lr × lr_width / hidden (muP's 1/width
    # rule for Adam, Yang et al. 2022, Tensor Programs V): 3e-3 suits the CPU demo models and spikes a 1024-wide
    # sibling. lr_width 0 = no scaling.
    lr: float = Field(3e-3, ge=0.0, le=MAX_LR)
    lr_width: int = Field(256, ge=0, le=1 << 20)
    window: int = Field(5, ge=1, le=10_000)  # k: compare mean of the first k with the last k losses
    min_drop: float = Field(0.05, ge=0.0, le=1.0)  # relative drop required
    # max relative gap between the FP32 curve and the 16-bit one (BF16, or FP16 where it is the one compared)
    bf16_tolerance: float = Field(0.05, ge=0.0, le=10.0)
    micro_batch: int = Field(4, ge=1, le=1 << 20)
    # The model smoke trains (tasks/model/sibling.py): auto = the configured model when its FP32 AdamW estimate fits
    # one device of hardware.cluster (hardware.device_memory_gb when set) with memory_margin to spare and it has at
    # most max_params parameters, else a sibling of it (same family and block structure, the shard set's
    # vocabulary, width and depth halved until it fits); same = the configured model whatever its size; or a
    # tasks.model preset name of the same family and vocabulary.
    model: str = "auto"
    max_params: float = Field(1e9, ge=1e5, le=1e13)
    memory_margin: float = Field(0.25, ge=0.0, le=0.9)  # fraction of one device's memory the estimate leaves free
    # With model.hf_path: the checkpoint's embedding, first hf_layers layers (0 = all, streamed one layer at a time),
    # final norm and head run on the first batch; its loss must be at most hf_max_loss_ratio × ln(vocab) (uniform
    # guessing scores ln(vocab); a trained checkpoint on its own tokenizer scores far below).
    hf_layers: int = Field(0, ge=0, le=100_000)
    hf_max_loss_ratio: float = Field(0.8, ge=0.01, le=10.0)
    # "Accuracy worse than on GPU → compare operator by operator": one forward of the same weights and batch on the
    # device in compare_precision and in FP32 on the CPU; the first layer whose max |diff| / max |FP32 output|
    # exceeds compare_tolerance is named (per-layer table in smoke_report.json and MLflow). On a CPU host it
    # compares CPU BF16 with CPU FP32. BF16 keeps 8 mantissa bits (~0.4 % per rounding): 5 % flags real departures.
    compare_with_cpu: bool = False
    compare_precision: Precision = "bf16"  # autocast on the device
    compare_tolerance: float = Field(0.05, ge=0.0, le=100.0)


class PlanConfig(Section):
    zero_stages: list[Zero] = Field(default_factory=lambda: [0, 1, 2, 3], min_length=1)
    recompute: list[Recompute] = Field(default_factory=lambda: ["none", "selective", "full"], min_length=1)
    schedules: list[Schedule] = Field(default_factory=lambda: ["1f1b", "gpipe", "interleaved1f1b"], min_length=1)
    efficiency: float = Field(0.4, ge=0.01, le=1.0)  # achieved fraction of peak FLOP/s
    runtime_reserve_gb: float = Field(0.0, ge=0.0, le=1e5)  # 0 = backend default (CANN/HCCL ≈ 5 GB on NPU)
    top_k: int = Field(10, ge=1, le=100_000)
    flash_attention: bool = True  # fused SDPA keeps no s×s scores (false: Korthikanti's 5as/h term)
    # How far the rehearsal's measured peak memory and step time may exceed the plan's estimate (an accelerator's
    # allocator peak). On CPU a rank's RSS, less what it held before the model, is judged against cpu_tolerance: it
    # also holds what a device would not (rank 0's MLflow client, malloc arenas, CPU autocast's kernels): measured
    # 1.24-1.93x the estimate for the demo in bf16 and 0.86x for debug in fp32; docs/real-size.md. Step time on CPU
    # is reported, not judged.
    tolerance: float = Field(0.25, ge=0.0, le=100.0)
    cpu_tolerance: float = Field(2.0, ge=0.0, le=100.0)


class ProfileConfig(Section):
    enabled: bool = True
    skip_first: int = Field(1, ge=0, le=MAX_STEPS)
    wait: int = Field(0, ge=0, le=MAX_STEPS)
    warmup: int = Field(1, ge=0, le=MAX_STEPS)
    active: int = Field(2, ge=1, le=100_000)
    record_shapes: bool = False
    profile_memory: bool = True
    with_stack: bool = False
    npu_level: Literal["Level_none", "Level0", "Level1", "Level2"] = "Level1"
    aic_metrics: Literal[
        "PipeUtilization",
        "ArithmeticUtilization",
        "Memory",
        "MemoryL0",
        "MemoryUB",
        "ResourceConflictRatio",
        "L2Cache",
        "MemoryAccess",
        "AiCoreNone",
    ] = "PipeUtilization"  # torch_npu AiCMetrics
    use_msprof: bool = False  # wrap the run in `msprof --application` when msprof is on PATH
    # Step breakdown of Ascend data from msprof-analyze (PyPI msprof-analyze, matching the CANN version) or the
    # built-in readers; auto = msprof-analyze when on PATH, else built-in. Where both run they must agree within 1 %.
    analyzer: Literal["auto", "builtin", "msprof-analyze"] = "auto"
    fail_on_regression: bool = False
    regression_threshold: float = Field(0.10, ge=0.0, le=10.0)

    def steps_needed(self) -> int:
        """Training steps that complete one profiling cycle (the trace is written at the end of the last active
        step): the profile stage's run length and its bound (tasks/bounds.py)."""
        return self.skip_first + self.wait + self.warmup + self.active


class QuantizeConfig(Section):
    # int8_weight_only | int8_dynamic (W8A8, activations per-token dynamic: torchao's Int8DynamicActivation and AMCT's
    # inputs.strategy "token") | smoothquant (W8A8, per-tensor activations, calibrated)
    method: Literal["int8_weight_only", "int8_dynamic", "smoothquant"] = "int8_weight_only"
    # auto = AMCT on an NPU host where it imports, else torchao
    backend: Literal["auto", "amct", "torchao"] = "auto"
    # substrings of layer names (ours or HF)
    skip_layers: list[str] = Field(default_factory=lambda: ["lm_head", "embed"])
    calibration_batches: int = Field(4, ge=1, le=100_000)
    amct_flow: Literal["llm", "ptq"] = "llm"  # llm (quantize/convert) | ptq (ONNX fake-quant + deploy)
    # the unquantized parts (fp32 not with AMCT: INT8 on fp16/bf16 only)
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    qat_on_fail: bool = True  # PTQ misses the gate → quantization-aware fine-tune, then gate again
    qat_steps: int = Field(50, ge=1, le=1_000_000)  # QAT optimizer steps on the training shards (lr: train.min_lr)


class EvaluateConfig(Section):
    max_drop_pct: float = Field(2.0, ge=0.0, le=100.0)  # gate: evaluate.gate_metric may be at most this many percent
    # task_accuracy_drop_pct (relative drop of the macro-average accuracy over evaluate.tasks) | supplementary figures
    # on val tokens: accuracy_drop_pct (relative next-token top-1 drop) | ppl_drop_pct | greedy_disagreement_pct —
    # each INT8 vs the unquantized model in quantize.dtype (quantize runs QAT on the same gate when PTQ misses it)
    gate_metric: Literal["task_accuracy_drop_pct", "accuracy_drop_pct", "ppl_drop_pct", "greedy_disagreement_pct"] = (
        "task_accuracy_drop_pct"
    )
    # lm-eval task/group/tag names (read offline from the HF datasets cache), paths of task YAML files in lm-eval's
    # format, or demo-continuation (written from the val split): docs/evaluation.md
    tasks: list[str] = Field(default_factory=lambda: ["demo-continuation"], min_length=1)
    limit: int | None = Field(None, ge=1, le=1 << 30)  # examples per task at most (None: all)
    # task/group/entry → shots (else the YAML's, or 0); at most the task's few-shot split holds (checked on load)
    num_fewshot: dict[str, int] = Field(default_factory=dict)
    # a task is scored by the first of these it reports (demo-continuation reports acc_mutual_info only)
    task_metrics: list[str] = Field(default_factory=lambda: ["acc", "exact_match", "acc_mutual_info"], min_length=1)
    demo_examples: int = Field(300, ge=10, le=100_000)  # demo-continuation's size
    batch_size: int = Field(16, ge=1, le=4096)  # sequences per forward in the lm-eval wrapper
    # a progress line per model and task every this many requests (0 = by time only) or 30 s, and at the last
    log_every: int = Field(1000, ge=0, le=10_000_000)
    # the candidate becomes champion unless its macro task accuracy is lower than the champion's (same tasks, same
    # run) by more than this many percent (relative)
    champion_margin: float = Field(0.0, ge=0.0, le=100.0)
    eval_batches: int = Field(8, ge=1, le=100_000)
    agreement_windows: int = Field(8, ge=0, le=100_000)  # windows whose greedy continuations INT8 and BF16 must match
    latency_tokens: int = Field(32, ge=1, le=1 << 20)
    prompts: list[str] = Field(default_factory=lambda: ["def ", "import ", "class "])
    max_new_tokens: int = Field(24, ge=1, le=1 << 20)
    registered_model: str = "llm-pipeline-demo"
    fail_on_gate: bool = True
    # a person approves the champion in Airflow (the DAG's `approve` task) instead of evaluate promoting it; the
    # approval task waits at most approval_timeout_h hours (the run's own config), then takes "Reject"
    require_approval: bool = False
    approval_timeout_h: int = Field(72, ge=1, le=24 * 90)

    @model_validator(mode="after")
    def _rules(self):
        """Rules across evaluate's fields, checked once every field is valid (named evaluate.<field> by problems)."""
        lines = [
            f"num_fewshot: {name}: {shots} must be >= 0 (few-shot examples per prompt)"
            for name, shots in self.num_fewshot.items()
            if shots < 0
        ]
        if self.gate_metric == "greedy_disagreement_pct" and not self.agreement_windows and not self.prompts:
            lines.append(
                "gate_metric: greedy_disagreement_pct has nothing to be measured on (evaluate.agreement_windows is 0 "
                "and evaluate.prompts is empty); set one of them, or gate on another metric"
            )
        if lines:
            raise rule_error(lines)
        return self


class TrackingConfig(Section):
    uri: str = ""  # "" = $MLFLOW_TRACKING_URI or sqlite:///<repo>/var/mlflow.db
    experiment: str = "llm-pipeline"
    # "" = <repo>/var/mlartifacts (new experiments only); with an http(s) tracking URI, the server's default
    # (`mlflow server --serve-artifacts`: the server stores them, whichever host logs them)
    artifact_root: str = ""
    ui_url: str = ""  # "" = $MLFLOW_UI_URL or http://127.0.0.1:$MLFLOW_PORT (5000) (tracking.ui_url())
    enabled: bool = True
    # MLflow system metrics (CPU, memory, disk, network, GPU; NPU from npu-smi) on the device stages' runs, sampled
    # every this many seconds; 0 = off
    system_metrics_s: float = Field(5.0, ge=0.0, le=3600.0)


class TimeoutConfig(Section):
    """Bounds on every wait, in seconds (tasks/bounds.py): each DAG task's execution_timeout, the torchrun and
    Kubernetes Job waits inside it, and the cross-node probe's rendezvous."""

    env_s: int = Field(900, ge=1, le=MAX_TIMEOUT_S)
    shard_s: int = Field(3600, ge=1, le=MAX_TIMEOUT_S)
    smoke_s: int = Field(1800, ge=1, le=MAX_TIMEOUT_S)
    plan_s: int = Field(600, ge=1, le=MAX_TIMEOUT_S)
    train_s: int = Field(
        0, ge=0, le=MAX_TIMEOUT_S
    )  # 0 = steps × the planner's step estimate × train_margin + train_overhead_s
    train_margin: float = Field(4.0, ge=1.0, le=1000.0)  # how much slower than the planner's estimate a step may be
    train_overhead_s: int = Field(900, ge=0, le=MAX_TIMEOUT_S)  # start-up, rendezvous, checkpoints, HF export
    profile_s: int = Field(1800, ge=1, le=MAX_TIMEOUT_S)
    quantize_s: int = Field(3600, ge=1, le=MAX_TIMEOUT_S)
    evaluate_s: int = Field(3600, ge=1, le=MAX_TIMEOUT_S)
    rendezvous_s: int = Field(
        300, ge=1, le=MAX_TIMEOUT_S
    )  # the cross-node probe waits this long for every node to arrive
    k8s_pending_s: int = Field(
        900, ge=1, le=MAX_TIMEOUT_S
    )  # a Job's pods may wait this long to be scheduled, on top of the stage's


# (a, b): a may not exceed b
_ORDERED = [
    ("train.micro_batch", "train.global_batch"),
    ("train.min_lr", "train.lr"),
    ("hardware.warn_clock_offset_ms", "hardware.max_clock_offset_ms"),
]


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' → (host, port), IPv6 in brackets ('[::1]:29400' → ('::1', 29400), as torchrun takes it);
    ValueError naming what is wrong (no port, a port outside 1..65535, unbracketed IPv6)."""
    host, sep, port_s = (endpoint or "").strip().rpartition(":")
    if not sep or not host or not port_s:
        raise ValueError("must be host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("an IPv6 address goes in brackets: [addr]:port")
    if not host or not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise ValueError("must be host:port with a port from 1 to 65535")
    return host, int(port_s)


def watchdog_problem(timeout_s: int, exec_timeout: int, source: str = "") -> str | None:
    """The one rule (the env stage's hccl-timeouts check and train's pre-launch check): torch's watchdog
    (train.timeout_s) must outlast HCCL_EXEC_TIMEOUT, or it kills the ranks before HCCL names the failing collective
    (torch_npu's ProcessGroupHCCL waits on HCCL's own timeout). 0 = HCCL never times out: nothing to compare."""
    if exec_timeout == 0 or timeout_s > exec_timeout:
        return None
    return (
        f"train.timeout_s: {timeout_s} must exceed HCCL_EXEC_TIMEOUT={exec_timeout}{f' ({source})' if source else ''} "
        f"so HCCL reports the real error before torch's watchdog fires: set train.timeout_s to {exec_timeout + 64} "
        "or more"
    )


class PipelineConfig(Section):
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    smoke: SmokeConfig = Field(default_factory=SmokeConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    preset: str = ""  # which preset/file this came from (informational)
    # Not a field: not in to_dict()/digest(); copy.deepcopy keeps it.
    _explicit: set[str] = PrivateAttr(default_factory=set)

    @property
    def explicit(self) -> set[str]:
        return self._explicit

    @model_validator(mode="after")
    def _rules(self):
        """Rules across fields, checked once every field is valid."""
        t, hw = self.train, self.hardware
        lines = [f"{a}: {get(self, a)} exceeds {b} {get(self, b)}" for a, b in _ORDERED if get(self, a) > get(self, b)]
        if hw.node_rank >= hw.nnodes:
            lines.append(f"hardware.node_rank: {hw.node_rank} must be < hardware.nnodes {hw.nnodes}")
        try:
            split_endpoint(hw.rdzv_endpoint)
        except ValueError as e:
            lines.append(f"hardware.rdzv_endpoint: {hw.rdzv_endpoint!r} {e} (node 0's address, e.g. 10.0.0.1:29400)")
        if hw.launcher == "kubernetes" and hw.k8s_kind == "trainjob":  # TrainJob: the runtime's (k8s_job.trainjob)
            if hw.k8s_scheduler == "volcano":
                lines.append(
                    "hardware.k8s_scheduler: volcano does not reach a k8s_kind trainjob (a TrainJob has no scheduler "
                    "or PodGroup field: gang scheduling is its ClusterTrainingRuntime's podGroupPolicy); use "
                    "k8s_kind job or pytorchjob with volcano, or k8s_scheduler default"
                )
            if not hw.rdzv_endpoint.strip().endswith(":29400"):
                lines.append(
                    f"hardware.rdzv_endpoint: port of {hw.rdzv_endpoint!r} is not used by a k8s_kind trainjob (its "
                    "runtime sets PET_MASTER_PORT); leave the port at 29400, or use k8s_kind job or pytorchjob"
                )
        if hw.device == "npu":
            line = watchdog_problem(t.timeout_s, hw.hccl_exec_timeout, "hardware.hccl_exec_timeout")
            lines.extend([line] if line else [])
        if t.early_stop_patience and not t.eval_samples:
            lines.append(
                f"train.early_stop_patience: {t.early_stop_patience} needs the validation loss, which "
                "train.eval_samples 0 turns off; set train.eval_samples (e.g. 64) or train.early_stop_patience 0"
            )
        if lines:
            raise rule_error(lines)
        return self

    def to_dict(self) -> dict:
        return self.model_dump()

    def digest(self) -> str:
        body = json.dumps({k: v for k, v in self.to_dict().items() if k != "preset"}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:12]


SECTIONS = [k for k in PipelineConfig.model_fields if k != "preset"]


def _flatten(overrides: dict, prefix: str = "") -> dict[str, Any]:
    """{"data": {"seq_len": 128}} and {"data.seq_len": 128} both become {"data.seq_len": 128}."""
    flat = {}
    for key, value in (overrides or {}).items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and not prefix and key in SECTIONS:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _validated(flat: dict[str, Any]) -> PipelineConfig:
    """The one path into the model: dotted keys nested into sections, validated, problems as ConfigError lines."""
    data: dict[str, Any] = {}
    for dotted, value in flat.items():
        section, dot, key = dotted.partition(".")
        if not dot:
            data[section] = value
        elif isinstance(data.setdefault(section, {}), dict):
            data[section][key] = value
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(problems(e, PipelineConfig, data)) from None


def apply_overrides(cfg: PipelineConfig, overrides: dict, explicit: bool = True) -> PipelineConfig:
    """Set dotted (or nested) keys in place, validated with the rest of cfg; `explicit` records them in
    cfg.explicit (a preset's values are not)."""
    flat = _flatten(overrides)
    new = _validated({**_flatten(cfg.to_dict()), **flat})
    for dotted in flat:
        section, dot, key = dotted.partition(".")
        if dot:
            setattr(getattr(cfg, section), key, getattr(getattr(new, section), key))
        else:
            setattr(cfg, section, getattr(new, section))
    if explicit:
        cfg.explicit.update(flat)
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
        if path.is_dir():
            known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
            raise ConfigError(f"--config {name}: a directory; give a preset file (.yaml) or a preset name ({known})")
        if not path.is_file():
            raise ConfigError(f"config file {name} does not exist")
        if path.suffix not in (".yaml", ".yml"):  # e.g. --config /etc/passwd: not a preset, whatever it parses to
            raise ConfigError(
                f"--config {name}: not a YAML preset (a .yaml/.yml file or a preset name: "
                f"{', '.join(sorted(p.stem for p in CONFIG_DIR.glob('*.yaml')))})"
            )
        return path
    candidate = CONFIG_DIR / f"{name}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        where = " from $LLM_PIPELINE_PRESET" if not preset_or_path and os.environ.get("LLM_PIPELINE_PRESET") else ""
        raise ConfigError(f"unknown preset {name!r}{where} (known: {', '.join(known)})")
    return candidate


def load_yaml(path: Path) -> dict:
    try:
        return yaml_mapping(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_config(preset_or_path: str | None = None, overrides: dict | None = None, sets=()) -> PipelineConfig:
    path = resolve_preset(preset_or_path)
    explicit = {**_flatten(overrides or {}), **parse_sets(sets)}
    preset = load_yaml(path)
    if "preset" in explicit:  # it would be replaced below, silently: the preset is chosen, not set
        raise ConfigError(
            f"preset={explicit['preset']}: the preset is chosen with --config {explicit['preset']} (the DAG's preset "
            "Param), not as a value"
        )
    if "preset" in preset:
        raise ConfigError(f"{path}: a top-level 'preset' key is ignored (the file is the preset); remove it")
    cfg = _validated({**_flatten(preset), **explicit, "preset": str(path.stem if path.parent == CONFIG_DIR else path)})
    cfg.explicit.update(explicit)
    return cfg


def get(cfg: PipelineConfig, dotted: str):
    section, _, key = dotted.partition(".")
    return getattr(getattr(cfg, section), key)


def validate(cfg: PipelineConfig) -> PipelineConfig:
    """Check cfg as it is now (after code changed fields): the same model, the same one-line problems."""
    _validated(_flatten(cfg.to_dict()))
    return cfg
