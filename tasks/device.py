"""Backend layer: the one place that knows npu / cuda / cpu, and the only module that imports torch_npu.

torch_npu is imported lazily and its ImportError/RuntimeError become `BackendUnavailable` with the cause: with
torch_npu installed but CANN missing, even `import torch` fails ("Failed to load the backend extension: torch_npu
… libhccl.so"), so callers that must survive that (the environment stage) probe in a subprocess first.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from dataclasses import dataclass

from tasks.errors import StageError

DIST_BACKEND = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
# Stages that need the accelerator (or, for env, must check the nodes that have it): where the launcher places them
# (tasks.launch.placement) and which stage runs get system metrics (tasks.sysmetrics).
DEVICE_STAGES = ("env", "smoke", "train", "profile", "quantize", "evaluate")


def dist_backend(kind: str) -> str:
    """The process-group backend of a `kind` run (DIST_BACKEND); on CPU under $LLM_PIPELINE_STRICT_COLLECTIVES the
    gloo imitation that checks every collective as HCCL/NCCL would (tasks/collectives.py), registered here."""
    if kind == "cpu":
        from tasks.collectives import dist_backend as cpu_backend

        return cpu_backend(kind)
    return DIST_BACKEND[kind]


class BackendUnavailable(StageError):
    pass


@dataclass(frozen=True)
class Backend:
    kind: str  # npu | cuda | cpu
    dist_backend: str  # hccl | nccl | gloo (gloo_as_hccl / gloo_as_nccl: strict mode on CPU, tasks/collectives.py)
    device_count: int  # accelerators visible; on CPU the usable core count

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"


_torch_npu = None


def import_torch_npu():
    """Import torch_npu once; raise BackendUnavailable naming the cause and the fix."""
    global _torch_npu
    if _torch_npu is not None:
        return _torch_npu
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)
    except (ImportError, RuntimeError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "libhccl" in msg or "libascend" in msg or "backend extension" in msg:
            raise BackendUnavailable(
                f"torch_npu is installed but CANN is not loaded ({msg}); run "
                "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` (or cann/set_env.sh), "
                "or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to run on CPU"
            ) from None
        raise BackendUnavailable(
            f"device npu requested but torch_npu is not importable ({msg}); install "
            "requirements-npu.txt on an Ascend host with CANN"
        ) from None
    _torch_npu = torch_npu
    return torch_npu


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def detect(requested: str = "auto") -> Backend:
    """Pick the backend: the configured one (failing clearly when it is absent) or the best available."""
    import torch

    if requested not in ("auto", "npu", "cuda", "cpu"):
        raise StageError(f"hardware.device: unknown device {requested!r} (npu, cuda, cpu or auto)")
    if requested in ("auto", "npu"):
        try:
            import_torch_npu()
            if torch.npu.is_available() and torch.npu.device_count() > 0:
                return Backend("npu", "hccl", torch.npu.device_count())
            if requested == "npu":
                raise BackendUnavailable(
                    "device npu requested but torch_npu sees no NPU (check npu-smi info and ASCEND_RT_VISIBLE_DEVICES)"
                )
        except BackendUnavailable:
            if requested == "npu":
                raise
    if requested in ("auto", "cuda"):
        if torch.cuda.is_available():
            return Backend("cuda", "nccl", torch.cuda.device_count())
        if requested == "cuda":
            raise BackendUnavailable("device cuda requested but torch.cuda.is_available() is False")
    return Backend("cpu", dist_backend("cpu"), _cpu_count())


def device_module(kind: str):
    """torch.npu / torch.cuda / None for CPU."""
    import torch

    if kind == "npu":
        import_torch_npu()
        return torch.npu
    if kind == "cuda":
        return torch.cuda
    return None


def torch_device(kind: str, local_rank: int = 0):
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    mod = device_module(kind)
    index = local_rank % max(mod.device_count(), 1)
    mod.set_device(index)
    return torch.device(kind, index)


def synchronize(device) -> None:
    mod = device_module(device.type)
    if mod is not None:
        mod.synchronize(device)


def bf16_supported(kind: str) -> bool:
    """Whether the device computes in bfloat16: CUDA and NPU ask the runtime (`torch.npu.is_bf16_supported()`,
    torch_npu/npu/utils.py: False on Ascend 910 (A1) parts, True on 910B/910C); CPU autocast always can."""
    mod = device_module(kind) if kind in ("cuda", "npu") else None
    if mod is None:
        return True
    return bool(mod.is_bf16_supported())


def fp16_supported(kind: str) -> bool:
    """Whether autocast computes in float16 on this backend: one tiny matmul under autocast, whose result dtype says
    (torch disables an autocast dtype a backend lacks with only a warning — "In CPU autocast, but the target dtype is
    not supported. Disabling autocast." — so asking the result is the check that cannot be fooled). Every Ascend
    training SoC (910 A1 included: FP16 is its native format) and CUDA GPU has FP16 kernels; CPU autocast supports
    float16 in the torch this project pins."""
    import torch

    dev = torch.device("cpu") if kind == "cpu" else torch.device(kind, device_module(kind).current_device())
    with torch.autocast(device_type=dev.type, dtype=torch.float16):
        out = torch.ones(2, 2, device=dev) @ torch.ones(2, 2, device=dev)
    return out.dtype == torch.float16


def precision_problem(kind: str, precision: str) -> str | None:
    """One line when `precision` cannot run on this backend (checked before any step, never mid-run); fp16 trains
    with the trainer's dynamic loss scaler (tasks/train/loss_scale.py)."""
    if precision == "bf16" and kind != "cpu" and not bf16_supported(kind):
        what = "this Ascend SoC (910 A1 parts have no bf16; 910B/910C do)" if kind == "npu" else "this GPU"
        return (
            f"train.precision: bf16 is not supported by {what}: set train.precision=fp16 (dynamic loss scaling) or fp32"
        )
    if precision == "fp16" and not fp16_supported(kind):
        return f"train.precision: fp16 is not supported on this {kind} device (no FP16 kernels): use bf16 or fp32"
    return None


# The allocator-configuration variable per backend (PyTorch / torch_npu docs), and PyTorch's generic one.
ALLOC_CONF_ENV = {"npu": "PYTORCH_NPU_ALLOC_CONF", "cuda": "PYTORCH_CUDA_ALLOC_CONF"}
GENERIC_ALLOC_CONF = "PYTORCH_ALLOC_CONF"


def parse_alloc_conf(value: str | None) -> dict[str, str]:
    """'expandable_segments:True,max_split_size_mb:128' → {'expandable_segments': 'True',
    'max_split_size_mb': '128'}."""
    out = {}
    for item in (value or "").split(","):
        key, sep, val = item.partition(":")
        if sep and key.strip():
            out[key.strip()] = val.strip()
    return out


def alloc_conf_var(kind: str, env: dict | None = None) -> str | None:
    """The allocator variable a `kind` worker reads, of those set (else its own name; None on CPU).
    NPU: PYTORCH_NPU_ALLOC_CONF, else PYTORCH_ALLOC_CONF — both set is refused (Ascend/pytorch branches v2.10.0,
    v2.11.0, v2.12.0, master: torch_npu/csrc/core/npu/NPUAllocatorConfig.cpp, NPUAllocatorConfig::instance
    TORCH_CHECK "Both PYTORCH_NPU_ALLOC_CONF and PYTORCH_ALLOC_CONF have been set"). CUDA: PYTORCH_ALLOC_CONF,
    else the older PYTORCH_CUDA_ALLOC_CONF (pytorch c10/cuda/CUDAAllocatorConfig.h)."""
    own = ALLOC_CONF_ENV.get(kind)
    if own is None:
        return None
    env = env if env is not None else os.environ
    if kind == "npu":
        return GENERIC_ALLOC_CONF if own not in env and GENERIC_ALLOC_CONF in env else own
    return GENERIC_ALLOC_CONF if GENERIC_ALLOC_CONF in env else own


def alloc_conf_in_force(kind: str, env: dict | None = None) -> str:
    """The allocator settings a worker of this backend runs with: the launch environment's, else the process's."""
    var = alloc_conf_var(kind, env) or alloc_conf_var(kind)
    if not var:
        return ""
    env = env if env is not None else os.environ
    return env.get(var, os.environ.get(var, ""))


def npu_alloc_env(environ: dict | None = None) -> dict[str, str]:
    """The allocator variable the launcher adds for NPU workers: PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
    (the fragmentation remedy) unless the user set PYTORCH_NPU_ALLOC_CONF or PYTORCH_ALLOC_CONF (theirs is used
    as it is; never both — torch_npu refuses to start then, and so does this, in one line)."""
    environ = environ if environ is not None else os.environ
    npu = ALLOC_CONF_ENV["npu"]
    if npu in environ and GENERIC_ALLOC_CONF in environ:
        raise StageError(
            f"{npu} and {GENERIC_ALLOC_CONF} are both set: torch_npu refuses to start with both "
            "(NPUAllocatorConfig.cpp); unset one of them"
        )
    if GENERIC_ALLOC_CONF in environ:
        return {}
    return {npu: environ.get(npu, "expandable_segments:True")}


def reset_peak(device) -> None:
    mod = device_module(device.type)
    if mod is not None:
        mod.reset_peak_memory_stats(device)
    else:
        _cpu_peak_baseline[0] = _rss_bytes()
        _reset_hwm()


_cpu_peak_baseline = [0]


def _reset_hwm() -> None:
    """Linux: writing 5 to /proc/self/clear_refs resets the RSS high-water mark (VmHWM) to the current RSS, so the
    next peak read is this phase's, not the process lifetime's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    """The RSS high-water mark since the last reset_peak (VmHWM), else the lifetime maximum."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_stats(device) -> dict[str, int]:
    """allocated / reserved / peak bytes on the device; on CPU the process RSS and its peak (what torch can't say)."""
    mod = device_module(device.type)
    if mod is not None:
        return {
            "allocated_bytes": int(mod.memory_allocated(device)),
            "reserved_bytes": int(mod.memory_reserved(device)),
            "peak_bytes": int(mod.max_memory_allocated(device)),
            "peak_reserved_bytes": int(mod.max_memory_reserved(device)),
        }
    rss = _rss_bytes()
    return {
        "allocated_bytes": rss,
        "reserved_bytes": rss,
        "peak_bytes": _peak_rss_bytes(),
        "peak_reserved_bytes": _peak_rss_bytes(),
    }


def hccl_env(hardware) -> dict[str, str]:
    """HCCL variables for NPU jobs, from the hardware config (existing values in the environment win)."""
    env = {
        "HCCL_CONNECT_TIMEOUT": str(hardware.hccl_connect_timeout),
        "HCCL_EXEC_TIMEOUT": str(hardware.hccl_exec_timeout),
    }
    return {k: os.environ.get(k, v) for k, v in env.items()}


def hccl_timeout_problem(kind: str, timeout_s: int, hardware) -> str | None:
    """watchdog_problem on NPU against the HCCL_EXEC_TIMEOUT in force — the environment's when exported, else
    hardware.hccl_exec_timeout (hccl_env): what the ranks will get, for device auto too."""
    value = hccl_env(hardware)["HCCL_EXEC_TIMEOUT"]
    if kind != "npu" or not value.strip().isdigit():
        return None  # not an integer: the env stage's hccl-timeouts check names it
    source = "exported" if "HCCL_EXEC_TIMEOUT" in os.environ else "hardware.hccl_exec_timeout"
    from tasks.config import watchdog_problem

    return watchdog_problem(timeout_s, int(value), source)


def package_version(dist: str) -> str | None:
    """An installed distribution's version from its metadata (torch-npu, amct_pytorch, …), None when absent; never
    imports it (torch_npu without CANN loaded kills the importing process)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cann_log_env(hardware) -> dict[str, str]:
    """ASCEND_GLOBAL_LOG_LEVEL / ASCEND_SLOG_PRINT_TO_STDOUT for the ranks from the config (-1 / false = leave the
    environment alone); an explicit variable in the environment wins. (Collecting and explaining the logs CANN
    wrote is tasks/envcheck/cann_logs.py.)"""
    env = {}
    level = getattr(hardware, "ascend_log_level", -1)
    if level is not None and level >= 0:
        env["ASCEND_GLOBAL_LOG_LEVEL"] = str(level)
    if getattr(hardware, "ascend_log_stdout", False):
        env["ASCEND_SLOG_PRINT_TO_STDOUT"] = "1"
    return {k: os.environ.get(k, v) for k, v in env.items()}


def launch_env(backend: Backend, hardware) -> dict[str, str]:
    """Extra environment for torchrun workers of this backend."""
    env = {}
    if backend.kind == "npu":
        env.update(hccl_env(hardware))
        env.update(cann_log_env(hardware))  # ASCEND_GLOBAL_LOG_LEVEL / ASCEND_SLOG_PRINT_TO_STDOUT from the config
        # Fragmentation is the most common NPU OOM cause in long runs; the seeds' first remedy (or the user's own
        # PYTORCH_NPU_ALLOC_CONF / PYTORCH_ALLOC_CONF, never both).
        env.update(npu_alloc_env())
        # Two-level task queue for operator dispatch (the guides' host-bound remedy); the user's value wins.
        env.setdefault("TASK_QUEUE_ENABLE", os.environ.get("TASK_QUEUE_ENABLE", "2"))
    return env


def visible_devices_env(kind: str) -> str:
    return {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}.get(kind, "")


def autocast(device, dtype_name: str):
    """Autocast context for the precision name (fp32 → a no-op context)."""
    import contextlib

    import torch

    if dtype_name == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    return torch.autocast(device_type=device.type, dtype=dtype)


# SoCs with fused attention behind SDPA (op-plugin: SoC >= Ascend910B1; A3 = Ascend910_93xx; 950).
_FUSED_ATTENTION_SOC = re.compile(r"^(Ascend)?(910B|910_93|910C|950)", re.I)


def fused_attention_available(soc_or_cluster: str) -> bool:
    """Whether SDPA runs as npu_fusion_attention on this SoC ('Ascend910B2', 'Ascend910_9392', '910b', '910c');
    non-Ascend names (CUDA/CPU clusters) are taken as fused (flash/efficient SDPA)."""
    name = soc_or_cluster.strip()
    if not re.match(r"^(Ascend)?910|^(Ascend)?950", name, re.I):
        return True
    return bool(_FUSED_ATTENTION_SOC.match(name))
