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
The schedule comes from cfg.profile: skip_first, wait, warmup, active, one cycle (repeat=1, as the Ascend guide
recommends for cluster analysis).
"""
from __future__ import annotations

import os
from pathlib import Path

from tasks.config import ProfileConfig


def steps_needed(pcfg: ProfileConfig) -> int:
    """Training steps that complete one profiling cycle (the trace is written at the end of the last active step)."""
    return pcfg.skip_first + pcfg.wait + pcfg.warmup + pcfg.active


def trace_path(out_dir: str | os.PathLike, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.pt.trace.json"


class _Off:
    """What make_profiler returns without a profile directory: the training loop stays the same, unprofiled."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def step(self) -> None:
        pass


def make_profiler(pcfg: ProfileConfig, backend_kind: str, out_dir: str | os.PathLike | None, rank: int):
    """A started-on-enter profiler with `.step()` (a no-op one when out_dir is None); raises BackendUnavailable
    when NPU profiling can't load."""
    if out_dir is None:
        return _Off()
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
        schedule=tp.schedule(skip_first=pcfg.skip_first, wait=pcfg.wait, warmup=pcfg.warmup, active=pcfg.active,
                             repeat=1),
        on_trace_ready=write_trace, record_shapes=pcfg.record_shapes, profile_memory=pcfg.profile_memory,
        with_stack=pcfg.with_stack)


def _npu_profiler(pcfg: ProfileConfig, out: Path, rank: int):
    from tasks.device import import_torch_npu

    npu_prof = import_torch_npu().profiler
    out.mkdir(parents=True, exist_ok=True)
    experimental = npu_prof._ExperimentalConfig(
        export_type=npu_prof.ExportType.Text,
        profiler_level=getattr(npu_prof.ProfilerLevel, pcfg.npu_level),
        # Level0/Level_none force AiCoreNone (torch_npu warns otherwise); PipeUtilization feeds the cube/vector ratios.
        aic_metrics=getattr(npu_prof.AiCMetrics, pcfg.aic_metrics if pcfg.npu_level in ("Level1", "Level2")
                            else "AiCoreNone"),
        data_simplification=True)
    return npu_prof.profile(
        activities=[npu_prof.ProfilerActivity.CPU, npu_prof.ProfilerActivity.NPU],
        schedule=npu_prof.schedule(skip_first=pcfg.skip_first, wait=pcfg.wait, warmup=pcfg.warmup,
                                   active=pcfg.active, repeat=1),
        on_trace_ready=npu_prof.tensorboard_trace_handler(str(out), worker_name=f"rank{rank}"),
        record_shapes=pcfg.record_shapes, profile_memory=pcfg.profile_memory, with_stack=pcfg.with_stack,
        experimental_config=experimental)
