"""System metrics on the device stages' MLflow runs: MLflow's own monitor (mlflow.system_metrics: CPU, memory, disk,
network, NVIDIA/AMD GPUs when nvidia-ml-py / pyrsmi are installed) plus Ascend NPUs from `npu-smi info`, which MLflow
does not know, as `system/npu_<i>_utilization_percentage`, `_memory_usage_megabytes`, `_memory_usage_percentage`,
`_temperature_celsius`, `_power_usage_watts` (MLflow's GPU names, gpu → npu; megabytes are 10^6 bytes as MLflow's).

Sampled every tracking.system_metrics_s seconds by MLflow's SystemMetricsMonitor thread in the stage's own process
(the host that runs the stage: the torchrun ranks of train/profile live on it). MLflow drops the samples of the
last, unfinished interval when the run ends; finish() publishes them, so a stage shorter than one interval still
gets one point.
"""

from __future__ import annotations

import logging
import shutil

from tasks.config import PipelineConfig
from tasks.units import MB, MIB

try:  # MLflow's monitor base class; without mlflow the stage runs have no metrics at all
    from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor
except ImportError:  # pragma: no cover
    BaseMetricsMonitor = object  # type: ignore[assignment,misc]


def npu_metrics(info: dict) -> dict[str, float]:
    """One sample from tasks.npu_smi.parse(): per chip, in npu-smi's order; figures it does not report
    ("NA") are left out."""
    out = {}
    for i, c in enumerate(info.get("chips") or []):
        used, total = c.get("memory_used_mb"), c.get("memory_total_mb")
        figures = {
            "utilization_percentage": c.get("aicore_pct"),
            "memory_usage_megabytes": used * MIB / MB if used is not None else None,
            "memory_usage_percentage": used / total * 100 if used is not None and total else None,
            "temperature_celsius": c.get("temp_c"),
            "power_usage_watts": c.get("power_w"),
        }
        out.update({f"npu_{i}_{k}": float(v) for k, v in figures.items() if v is not None})
    return out


class NPUMonitor(BaseMetricsMonitor):
    """An MLflow metrics monitor reading `npu-smi info` (tasks.npu_smi, the health stage's parser)."""

    def __init__(self):
        if shutil.which("npu-smi") is None:
            raise RuntimeError("npu-smi is not on PATH")
        super().__init__()

    def collect_metrics(self) -> None:
        from tasks import npu_smi

        text = npu_smi.run(timeout=10.0)
        for k, v in (npu_metrics(npu_smi.parse(text)) if text else {}).items():
            self._metrics[k].append(v)

    def aggregate_metrics(self) -> dict[str, float]:
        return {k: round(sum(v) / len(v), 1) for k, v in self._metrics.items() if v}


class Monitor:
    """MLflow's SystemMetricsMonitor for one run, with the NPU monitor when npu-smi is there."""

    def __init__(self, run_id: str, uri: str, interval_s: float):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # not its start/stop lines per stage
        self.inner = SystemMetricsMonitor(run_id, sampling_interval=interval_s, tracking_uri=uri)
        try:
            self.inner.monitors.append(NPUMonitor())
        except RuntimeError:
            pass

    def start(self) -> "Monitor":
        self.inner.start()
        return self

    def finish(self) -> None:
        self.inner.finish()  # stops the thread and flushes what it published
        last = self.inner.aggregate_metrics()  # the samples of the unfinished interval, which MLflow drops
        if last:
            self.inner.publish_metrics(last)
            self.inner.mlflow_logger.flush()


def start(cfg: PipelineConfig, stage: str, run_id: str, uri: str) -> Monitor | None:
    """A running monitor for a device stage's run (tasks.device.DEVICE_STAGES), None for the others or with
    tracking.system_metrics_s = 0."""
    from tasks.device import DEVICE_STAGES

    if stage not in DEVICE_STAGES or cfg.tracking.system_metrics_s <= 0:
        return None
    return Monitor(run_id, uri, cfg.tracking.system_metrics_s).start()
