"""Per-step metrics: `<run-dir>/metrics.jsonl` (one JSON object per optimizer step) and the stage's MLflow run,
both written by rank 0 only; per-rank heartbeats that let the launcher name ranks that fell behind."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tasks.fsutil import atomic_write_text

# bf16 dense peak FLOP/s per device, used for MFU when hardware.peak_tflops is not set.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "910B": 313.0, "910C": 376.0}


def peak_flops(device, configured_tflops: float) -> float | None:
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cpu":
        return None
    from tasks.device import device_module

    name = device_module(device.type).get_device_name(device)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def truncate_after(path: Path, step: int) -> None:
    """On resume: drop lines of steps the previous attempt ran past its last checkpoint (they are redone)."""
    if not path.is_file():
        return
    kept = [ln for ln in path.read_text(encoding="utf-8").splitlines()
            if ln.strip() and json.loads(ln)["step"] <= step]
    atomic_write_text(path, "".join(ln + "\n" for ln in kept))


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(ln) for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]


class MetricsLog:
    """Rank 0's sink. MLflow is used when the launcher handed over a run (MLFLOW_RUN_ID)."""

    def __init__(self, path: Path, start_step: int, use_mlflow: bool):
        self.path = Path(path)
        truncate_after(self.path, start_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self.mlflow = None
        if use_mlflow and os.environ.get("MLFLOW_RUN_ID"):
            import mlflow

            mlflow.start_run()  # resumes the run named by MLFLOW_RUN_ID (the stage's child run)
            self.mlflow = mlflow

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.mlflow is not None:
            values = {f"train.{k}": float(v) for k, v in record.items()
                      if k != "step" and isinstance(v, (int, float)) and v is not None}
            self.mlflow.log_metrics(values, step=record["step"])

    def close(self) -> None:
        self._file.close()


class Heartbeat:
    """`<dir>/rank-K.json`: pid, step and phase of one rank, rewritten as it advances (plain writes: a torn read
    is tolerated by the reader)."""

    def __init__(self, directory: Path, rank: int):
        self.path = Path(directory) / f"rank-{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank

    def beat(self, step: int, phase: str) -> None:
        self.path.write_text(json.dumps({"rank": self.rank, "pid": os.getpid(), "step": step, "phase": phase,
                                         "time": time.time()}))


def read_heartbeats(directory: Path) -> dict[int, dict]:
    beats = {}
    for p in Path(directory).glob("rank-*.json"):
        try:
            b = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        beats[int(b["rank"])] = b
    return beats


class PhasePeaks:
    """This rank's memory peak per phase (init, train, checkpoint, export): the peak counter is reset when a phase
    starts and read when it ends (on CPU the RSS high-water mark, VmHWM, reset through /proc/self/clear_refs), so
    each figure is that phase's own; a phase entered again keeps its maximum. `base_bytes` is what the process
    held before the model existed (imports, process group): on CPU the estimate is compared with peak − base."""

    def __init__(self, device):
        from tasks.device import memory_stats

        self.device, self.peaks, self.current = device, {}, None
        self.base_bytes = memory_stats(device)["allocated_bytes"]

    def enter(self, phase: str) -> None:
        from tasks.device import reset_peak

        self.close()
        reset_peak(self.device)
        self.current = phase

    def close(self) -> None:
        from tasks.device import memory_stats

        if self.current:
            peak = memory_stats(self.device)["peak_bytes"]
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak)
            self.current = None

    def result(self) -> dict:
        self.close()
        return {**self.peaks, "base": self.base_bytes}
