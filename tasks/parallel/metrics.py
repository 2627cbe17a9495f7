"""Per-step metrics: `<run-dir>/metrics.jsonl` (one JSON object per optimizer step) and the stage's MLflow run,
both written by rank 0 only; per-rank heartbeats that let the launcher name ranks that fell behind."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tasks.fsutil import atomic_write_text

def peak_flops(device, configured_tflops: float) -> float | None:
    """Dense 16-bit peak FLOP/s of one device for MFU: hardware.peak_tflops when set, else the planner's device
    table (tasks.planner.cluster.DEVICES, the same rows as the cluster presets); None on CPU or an unknown device."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cpu":
        return None
    from tasks.device import device_module
    from tasks.planner.cluster import device_peak_tflops

    tflops = device_peak_tflops(device_module(device.type).get_device_name(device))
    return tflops * 1e12 if tflops else None


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
