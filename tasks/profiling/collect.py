"""Collection: one profiler per rank, driven by the trainer's step loop.

The training worker calls (out_dir None = not profiling: a no-op profiler, same loop):

    with make_profiler(cfg.profile, backend.kind, out_dir, rank) as prof:
        for step in ...:
            train_step()
            prof.step()

- NPU: `torch_npu.profiler.profile` with an `_ExperimentalConfig` (profiler level, AI Core metrics, text export) and
  `tensorboard_trace_handler` → `<out_dir>/rank{r}_<time>_ascend_pt/ASCEND_PROFILER_OUTPUT/` (torch_npu parses on
  the spot). torch_npu is imported through tasks.device only.
- CUDA / CPU: `torch.profiler.profile` → `<out_dir>/rank{r}.pt.trace.json` (Chrome trace, memory when asked).
The schedule comes from cfg.profile: skip_first, wait, warmup, active, one cycle (repeat=1, as Ascend/pytorch's
docs/en/developer_notes/ascend_pytorch_profiler_user_guide.md
recommends for cluster analysis).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tasks.config import ProfileConfig


def trace_path(out_dir: str | os.PathLike, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.pt.trace.json"


def active_steps(pcfg: ProfileConfig) -> range:
    """The training steps (1-based, as metrics.jsonl numbers them) the profiler records: after skip_first, wait and
    warmup, `active` of them (the schedule below, one cycle; prof.step() follows each training step)."""
    first = pcfg.skip_first + pcfg.wait + pcfg.warmup + 1
    return range(first, first + pcfg.active)


class _Off:
    """What make_profiler returns without a profile directory: the training loop stays the same, unprofiled."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def step(self) -> None:
        pass


MSPROF_ENV = "PROFILER_SAMPLECONFIG"  # set by `msprof --application` in the processes it profiles


def under_msprof(env=None) -> bool:
    """torch_npu >= 2.10 disables its own profiler inside msprof ("torch_npu profiler api is not effective"), so
    under msprof the trainer does not start it: msprof's PROF_* output is analysed instead."""
    return bool((env if env is not None else os.environ).get(MSPROF_ENV))


# Profiler options that appeared in later TorchNPU releases (Ascend/pytorch experimental_config.py history).
OPTION_SINCE = {("aic_metrics", "AiCoreNone"): "6.0.rc2", ("aic_metrics", "MemoryAccess"): "7.0.0"}


def release_key(release: str) -> tuple:
    """TorchNPU release → sortable: '6.0.rc2' < '6.0.rc3' < '6.0.0' < '7.0.0' < '26.0.0'."""
    m = re.match(r"(\d+)\.(\d+)\.(rc)?(\d+)", release.lower())
    if not m:
        return (0,)
    return (int(m.group(1)), int(m.group(2)), 0 if m.group(3) else 1, int(m.group(4)))


def npu_option_problems(pcfg: ProfileConfig, torchnpu_release: str | None, env=None) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the NPU profiler options on the installed TorchNPU release, before anything starts."""
    env = env if env is not None else os.environ
    errors, warnings = [], []
    if pcfg.npu_level == "Level_none":
        errors.append(
            "profile.npu_level Level_none collects no step breakdown (no step_trace_time.csv, no "
            "kernels) to analyse: use Level0 (lightest with a breakdown) or Level1"
        )
    if pcfg.npu_level in ("Level1", "Level2") and torchnpu_release:
        since = OPTION_SINCE.get(("aic_metrics", pcfg.aic_metrics))
        if since and release_key(torchnpu_release) < release_key(since):
            errors.append(
                f"profile.aic_metrics {pcfg.aic_metrics} needs TorchNPU {since} or newer; the installed "
                f"torch_npu is TorchNPU {torchnpu_release}: choose another profile.aic_metrics"
            )
    if env.get("ASCEND_RT_VISIBLE_DEVICES"):
        warnings.append(
            "ASCEND_RT_VISIBLE_DEVICES is set: CANN does not support it together with profiling "
            "(CANN env-var docs); prefer selecting devices with hardware.nproc_per_node"
        )
    return errors, warnings


def make_profiler(pcfg: ProfileConfig, backend_kind: str, out_dir: str | os.PathLike | None, rank: int):
    """A started-on-enter profiler with `.step()` (a no-op one when out_dir is None, or under msprof on NPU);
    raises BackendUnavailable when NPU profiling can't load."""
    if out_dir is None:
        return _Off()
    if backend_kind == "npu" and under_msprof():
        return _Off()  # msprof collects; torch_npu.profiler would be disabled by it anyway
    if backend_kind == "npu":
        return _npu_profiler(pcfg, Path(out_dir), rank)
    return _torch_profiler(pcfg, backend_kind, Path(out_dir), rank)


def _torch_profiler(pcfg: ProfileConfig, backend_kind: str, out: Path, rank: int):
    import torch.profiler as tp

    out.mkdir(parents=True, exist_ok=True)
    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if backend_kind == "cuda" else [])
    final = trace_path(out, rank)

    def write_trace(prof) -> None:
        # Export beside the final name, then rename: a reader never sees half a trace.
        tmp = final.with_name(f".{final.name}.tmp")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, final)

    return tp.profile(
        activities=activities,
        schedule=tp.schedule(
            skip_first=pcfg.skip_first, wait=pcfg.wait, warmup=pcfg.warmup, active=pcfg.active, repeat=1
        ),
        on_trace_ready=write_trace,
        record_shapes=pcfg.record_shapes,
        profile_memory=pcfg.profile_memory,
        with_stack=pcfg.with_stack,
    )


def _npu_profiler(pcfg: ProfileConfig, out: Path, rank: int):
    from tasks.device import import_torch_npu

    npu_prof = import_torch_npu().profiler
    out.mkdir(parents=True, exist_ok=True)
    # Level0/Level_none force AiCoreNone (torch_npu warns otherwise); PipeUtilization feeds the cube/vector ratios.
    metrics = pcfg.aic_metrics if pcfg.npu_level in ("Level1", "Level2") else "AiCoreNone"
    level = getattr(npu_prof.ProfilerLevel, pcfg.npu_level, None)
    aic = getattr(npu_prof.AiCMetrics, metrics, None)
    # An older torch_npu than the option: one line, not an AttributeError (AiCoreNone, which we only choose for
    # Level0, is simply left out before TorchNPU 6.0.rc2: torch_npu then applies its own Level0 default).
    if level is None or (aic is None and metrics != "AiCoreNone"):
        from tasks.device import BackendUnavailable

        what = f"ProfilerLevel.{pcfg.npu_level}" if level is None else f"AiCMetrics.{metrics}"
        raise BackendUnavailable(
            f"the installed torch_npu has no torch_npu.profiler.{what}: choose another "
            "profile.npu_level / profile.aic_metrics or upgrade torch_npu"
        )
    if aic is None:
        experimental = npu_prof._ExperimentalConfig(
            export_type=npu_prof.ExportType.Text, profiler_level=level, data_simplification=True
        )
    else:
        experimental = npu_prof._ExperimentalConfig(
            export_type=npu_prof.ExportType.Text, profiler_level=level, aic_metrics=aic, data_simplification=True
        )
    return npu_prof.profile(
        activities=[npu_prof.ProfilerActivity.CPU, npu_prof.ProfilerActivity.NPU],
        schedule=npu_prof.schedule(
            skip_first=pcfg.skip_first, wait=pcfg.wait, warmup=pcfg.warmup, active=pcfg.active, repeat=1
        ),
        on_trace_ready=npu_prof.tensorboard_trace_handler(str(out), worker_name=f"rank{rank}"),
        record_shapes=pcfg.record_shapes,
        profile_memory=pcfg.profile_memory,
        with_stack=pcfg.with_stack,
        experimental_config=experimental,
    )
