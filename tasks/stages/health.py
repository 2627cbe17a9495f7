"""Hourly health check (dags/llm_health.py): light environment validation and device sampling, logged to MLflow.

It raises an alarm (StageError: the Airflow task fails with a one-line cause) on the signs that precede failed
Ascend jobs: a chip in alarm or too hot, a dropped device (fewer chips than expected or than this host had before;
chips, not cards: an A3/910C card holds two, and a lost die is a lost device; an npu-smi/nvidia-smi that fails or is
gone on a host that has had devices is an alarm too, not a CPU host),
HBM full with no process on the chip (memory a crashed job left behind: the next job OOMs), a clock off NTP
(HCCL link set-up times out across nodes), and too little disk or host memory. Warnings are logged, not raised.

`collect()` does the I/O (npu-smi, nvidia-smi, host memory/disk, chrony) and never creates a device context: the
chips may be running a training job, so only the vendors' management tools are asked (no torch, no mem_get_info).
`assess()` turns a sample into checks and is pure, so the alarm logic is tested on npu-smi/nvidia-smi fixture files.

It is a stage like the pipeline's (tasks.stages.OWN_SCHEDULE) and runs through `tasks.runner.run_stage`: the result
file `<run-dir>/health.json` (the failure record with the one-line cause on an alarm), its own MLflow run with
`pipeline.error`, the run-directory lock. `python -m tasks health` runs it from the CLI.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import NamedTuple

from tasks import device, npu_smi, tracking
from tasks.config import PipelineConfig, repo_path, var_dir
from tasks.envcheck import check, npu_health, system, versions, worst
from tasks.errors import StageError
from tasks.fsutil import atomic_write_json, read_json

EXPERIMENT_SUFFIX = "-health"  # runner: health runs go to their own experiment, <tracking.experiment>-health
RUN_TAGS = {"pipeline.kind": "health"}


def state_path() -> Path:
    """The most chips (NPU dies / GPUs) this host has shown: how a card that dropped off the bus is noticed without
    configuration."""
    return var_dir() / "health" / f"{socket.gethostname()}.json"


def collect(cfg: PipelineConfig) -> dict:
    """One sample of this host: versions, devices (npu-smi / nvidia-smi only), host memory, disk, clock."""
    from tasks import nvidia_smi

    sample = {
        "time": time.time(),
        "host": system.host_facts(),
        "versions": {
            "torch": device.package_version("torch"),
            "torch_npu": device.package_version("torch-npu"),
            "cann": (versions.find_cann(home=os.environ.get("ASCEND_HOME_PATH")) or {}).get("version"),
        },
        "clock": system.clock_status(),
        "npu_smi": None,
        "nvidia_smi": None,
        "disk_paths": {"var": str(var_dir()), "data": str(repo_path(cfg.data.out_dir))},
    }
    text, npu_error = npu_smi.query()
    if text:
        sample["npu_smi"] = npu_smi.parse(text)
    sample["nvidia_smi"], nvidia_error = nvidia_smi.query()
    # a tool that is installed but fails (driver not loaded, device hung) is not a host without devices
    sample["tool_errors"] = {t: e for t, e in (("npu-smi", npu_error), ("nvidia-smi", nvidia_error)) if e}
    kind = "npu" if sample["npu_smi"] else "cuda" if sample["nvidia_smi"] else "cpu"
    sample["backend"] = {"kind": kind, "device_count": device_count(sample)}
    if cfg.hardware.device in ("npu", "cuda") and kind != cfg.hardware.device:  # the configured devices are gone
        tool = "npu-smi" if cfg.hardware.device == "npu" else "nvidia-smi"
        failed = sample["tool_errors"].get(tool)
        sample["backend"]["error"] = (
            f"hardware.device is {cfg.hardware.device} but {tool} failed ({failed}): check the driver (dmesg)"
            if failed
            else f"hardware.device is {cfg.hardware.device} but {tool} lists no device "
            "(driver not loaded, tool missing or not mounted)"
        )
    return sample


def _chip_label(c: dict) -> str:
    return f"NPU {c['npu']} chip {c['chip']}"


class Device(NamedTuple):
    label: str
    temp_c: float | None
    used_mb: float | None  # None: not device memory the fill check reads (an NPU's non-HBM memory)
    total_mb: float | None
    in_use: bool  # a process runs on it


def _thermal_and_memory(devices: list[Device], hw, memory: str, unit: str, reset: str) -> list[dict]:
    """The temperature and memory-fill checks, the same for NPU chips and GPUs: a hot device fails; a full one with
    no process on it holds memory a dead job left (fails), one in use only warns."""
    temps = [d.temp_c for d in devices if d.temp_c is not None]
    hot = [f"{d.label} at {d.temp_c:g} C" for d in devices if d.temp_c is not None and d.temp_c >= hw.max_device_temp_c]
    out = [
        check(
            "temperature", "fail", "; ".join(hot) + f" (alarm at hardware.max_device_temp_c {hw.max_device_temp_c:g} C)"
        )
        if hot
        else check("temperature", "ok", f"max {max(temps):g} C" if temps else "not reported")
    ]
    full = [
        d
        for d in devices
        if d.total_mb and d.used_mb is not None and 100 * d.used_mb / d.total_mb >= hw.max_hbm_used_pct
    ]
    leaked = [d for d in full if not d.in_use]
    if leaked:
        held = "; ".join(f"{d.label} {memory} {d.used_mb:g}/{d.total_mb:g} MB with no process on it" for d in leaked)
        out.append(check("hbm", "fail", f"{held}: memory left by a dead job; {reset} or reboot"))
    elif full:
        labels = ", ".join(d.label for d in full)
        out.append(check("hbm", "warn", f"{labels} {memory} ≥ {hw.max_hbm_used_pct:g}% (in use by a running process)"))
    else:
        out.append(check("hbm", "ok", f"below {hw.max_hbm_used_pct:g}% on every {unit}"))
    return out


def device_checks(sample: dict, hw, last_seen: int) -> list[dict]:
    """Temperature, chip health, dropped cards and HBM fill, from npu-smi or nvidia-smi (never a device context)."""
    out = []
    info = sample.get("npu_smi")
    backend = sample.get("backend", {})
    if backend.get("error"):
        out.append(check("backend", "fail", backend["error"]))
    if info:
        out += [c for c in npu_health.checks(info) if c["name"] == "npu-health"]  # busy chips are normal here
        busy = {(p["npu"], p["chip"]) for p in info["processes"]}
        devices = [
            Device(
                _chip_label(c),
                c["temp_c"],
                c["memory_used_mb"] if c["memory_kind"] == "HBM" else None,
                c["memory_total_mb"],
                (c["npu"], c["chip"]) in busy,
            )
            for c in info["chips"]
        ]
        out += _thermal_and_memory(devices, hw, "HBM", "chip", "reset the chip (npu-smi set -t reset)")
        count = device_count(sample)
        kind = "NPU chips (npu-smi)"
    elif sample.get("nvidia_smi"):
        gpus = sample["nvidia_smi"]["gpus"]
        count, kind = len(gpus), "GPUs (nvidia-smi)"
        busy = {p["gpu_uuid"] for p in sample["nvidia_smi"]["processes"]}
        devices = [
            Device(f"GPU {g['index']}", g["temp_c"], g["memory_used_mb"], g["memory_total_mb"], g["uuid"] in busy)
            for g in gpus
        ]
        out += _thermal_and_memory(devices, hw, "memory", "GPU", "reset the GPU (nvidia-smi -r)")
    expected = hw.expected_devices or last_seen
    source = "hardware.expected_devices" if hw.expected_devices else f"seen on this host before, {state_path()}"
    if not info and not sample.get("nvidia_smi"):
        if not expected:
            return out  # CPU host: host memory and disk are the device checks
        if backend.get("error"):
            return out  # already said: hardware.device names devices the tool does not list
        errors = sample.get("tool_errors") or {}
        cause = (
            "; ".join(f"{tool} failed ({why})" for tool, why in errors.items())
            if errors
            else "neither npu-smi nor nvidia-smi is installed"
        )
        out.append(
            check(
                "devices",
                "fail",
                f"{cause}; {expected} devices expected ({source}); check the driver and dmesg "
                "(the tool must run on this host: mounted into the container, on PATH)",
            )
        )
        return out
    if expected and count < expected:
        out.append(
            check(
                "devices",
                "fail",
                f"dropped device: {count} {kind} visible, {expected} expected ({source}); "
                "check `npu-smi info -l` / `nvidia-smi -L` and dmesg, then reseat or "
                "replace",
            )
        )
    else:
        out.append(check("devices", "ok", f"{count} {kind}"))
    return out


def assess(sample: dict, cfg: PipelineConfig, last_seen: int = 0) -> list[dict]:
    """Every check for one sample; pure (no I/O), so the alarm rules are testable on fixture output."""
    hw = cfg.hardware
    host = sample["host"]
    checks = device_checks(sample, hw, last_seen)
    checks.append(system.check_clock(sample["clock"], hw.nnodes, hw.max_clock_offset_ms, hw.warn_clock_offset_ms))
    checks.append(system.check_host_memory(host["memory_available_gb"], host["memory_total_gb"], hw.min_host_memory_gb))
    disk, free = system.check_disk(sample["disk_paths"], hw.min_free_disk_gb)
    sample["disk_free_gb"] = free
    checks.append(disk)
    return checks


def metrics(sample: dict) -> dict[str, float]:
    """What the MLflow health run plots over time."""
    out = {"host.memory_available_gb": sample["host"]["memory_available_gb"]}
    out.update({f"disk.{k}.free_gb": v for k, v in sample.get("disk_free_gb", {}).items()})
    if sample["clock"].get("offset_ms") is not None:
        out["clock.offset_ms"] = sample["clock"]["offset_ms"]
    for c in (sample.get("npu_smi") or {}).get("chips", []):
        key = f"npu{c['npu']}.chip{c['chip']}"
        for name in ("temp_c", "power_w", "aicore_pct"):
            if c[name] is not None:
                out[f"{key}.{name}"] = c[name]
        if c["memory_total_mb"]:
            out[f"{key}.memory_used_pct"] = round(100 * c["memory_used_mb"] / c["memory_total_mb"], 2)
    for g in (sample.get("nvidia_smi") or {}).get("gpus", []):
        for name in ("temp_c", "power_w", "util_pct"):
            if g[name] is not None:
                out[f"gpu{g['index']}.{name}"] = g[name]
        if g["memory_total_mb"] and g["memory_used_mb"] is not None:
            out[f"gpu{g['index']}.memory_used_pct"] = round(100 * g["memory_used_mb"] / g["memory_total_mb"], 2)
    return out


def device_count(sample: dict) -> int:
    """Devices npu-smi / nvidia-smi list: NPU chips ((npu, chip) pairs: an A3/910C card holds two), GPUs."""
    if sample.get("npu_smi"):
        return len({(c["npu"], c["chip"]) for c in sample["npu_smi"]["chips"]})
    return len((sample.get("nvidia_smi") or {}).get("gpus", []))


def run(cfg: PipelineConfig, ctx) -> dict:
    """The stage: sample, assess, log to MLflow, raise the alarms as one line (the runner records it)."""
    path = state_path()
    last_seen = read_json(path).get("max_devices", 0) if path.is_file() else 0
    sample = collect(cfg)
    checks = assess(sample, cfg, last_seen)
    status = worst(checks)
    count = device_count(sample)
    if count > last_seen:
        atomic_write_json(path, {"max_devices": count, "time": sample["time"]})
    tracking.log_metrics(metrics(sample))
    tracking.log_json_artifact({"sample": sample, "checks": checks}, "health.json")
    tracking.set_tags({"health.status": status})
    atomic_write_json(Path(ctx.run_dir) / "health" / "sample.json", {"sample": sample, "checks": checks})
    failed = [f"{c['name']}: {c['detail']}" for c in checks if c["status"] == "fail"]
    if failed:
        raise StageError("health alarm: " + " | ".join(failed))
    warned = [c["name"] for c in checks if c["status"] == "warn"]
    backend = sample.get("backend", {}).get("kind", "?")
    return {
        "status": "warn" if warned else "ok",
        "checks": checks,
        "summary": f"{backend}: {len(checks)} checks, " + (f"warnings: {', '.join(warned)}" if warned else "all ok"),
    }


def run_health(cfg: PipelineConfig, run_dir: str | Path, tags: dict | None = None) -> dict:
    """One health check through the runner, as its own MLflow run (experiment `<tracking.experiment>-health`);
    used by the DAG, `tags` naming its dag and run."""
    from tasks.runner import run_stage

    result = run_stage("health", cfg, run_dir, tags=tags)
    print(json.dumps({k: result[k] for k in ("status", "summary", "mlflow_run_id")}))
    return result
