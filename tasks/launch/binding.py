"""Host binding, the launcher's side: which CPU cores each local rank gets, nearest its device.

Where the cores come from:
- NPU: the `CPU Affinity` column of `npu-smi info -t topo`; else sysfs (`/sys/bus/pci/devices/<bus-id>/
  local_cpulist`, bus ids from `npu-smi info`, parsed by tasks/npu_smi.py).
- CUDA: torchrun's own `--numa-binding` (torch.distributed.run in torch ≥ 2.9; torch/numa/binding.py computes the
  cores from the GPU's PCI NUMA node, CUDA only) — passed as `--numa-binding=exclusive`, which splits each NUMA
  node's cores evenly among its GPUs; `nvidia-smi topo -m` gives the same split for the per-rank report.
- CPU: the usable cores split evenly among the ranks.
Ranks sharing an affinity set split it evenly. `prepare()` puts the plan into $LLM_PIPELINE_CPU_BINDING for torchrun's
entry point in each rank (tasks/parallel/affinity.py, which binds and then runs the worker);
`hardware.bind_cpus=false` turns it off. The plan is reported per rank (train result, MLflow train/binding.json,
each rank's log).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import tasks.parallel.affinity as rank_entry
from tasks.parallel.affinity import ENV

PLAN_ENV = "LLM_PIPELINE_CPU_BINDING_PLAN"  # the plan for the report (also when torchrun binds itself)
ENTRY = rank_entry.__name__  # torchrun's entry point in each rank when binding
WORKER = "tasks.train.worker"  # what the ranks run
_ANSI = re.compile(r"\x1b\[[0-9;]*m|\[\d+m")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' → [0, 1, 2, 3, 8, 10, 11]."""
    out = []
    for part in (text or "").strip().split(","):
        part = part.strip()
        if re.fullmatch(r"\d+-\d+", part):
            lo, hi = map(int, part.split("-"))
            out += range(lo, hi + 1)
        elif part.isdigit():
            out.append(int(part))
    return out


def format_cpulist(cpus: list[int]) -> str:
    cpus, out, i = sorted(set(cpus)), [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def parse_topo(text: str) -> dict[int, list[int]]:
    """`npu-smi info -t topo` / `nvidia-smi topo -m` → {device index: CPU Affinity cores}."""
    lines = [_ANSI.sub("", ln) for ln in (text or "").splitlines()]
    header = next((ln for ln in lines if "CPU Affinity" in ln), None)
    if header is None:
        return {}
    cols = [c.strip() for c in re.split(r"\t| {2,}", header.strip()) if c.strip()]
    idx = cols.index("CPU Affinity") + 1  # rows start with the device name
    out = {}
    for ln in lines:
        m = re.match(r"\s*(?:NPU|GPU)(\d+)\b", ln)
        if not m or ln is header:
            continue
        cells = [c.strip() for c in re.split(r"\t| {2,}", ln.strip())]
        if len(cells) > idx:
            cpus = parse_cpulist(cells[idx])
            if cpus:
                out[int(m.group(1))] = cpus
    return out


def sysfs_affinity(bus_ids: dict[int, str], root: str = "/sys/bus/pci/devices") -> dict[int, list[int]]:
    """{device: cores} from each PCI device's local_cpulist (bus ids as npu-smi prints them, 0000:C1:00.0)."""
    out = {}
    for dev, bus in bus_ids.items():
        p = Path(root) / bus.lower() / "local_cpulist"
        if p.is_file():
            cpus = parse_cpulist(p.read_text())
            if cpus:
                out[dev] = cpus
    return out


def _run(argv: list[str]) -> str | None:
    if not shutil.which(argv[0]):
        return None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def device_affinity(kind: str) -> tuple[dict[int, list[int]], str]:
    """({device: cores}, source) for this host; ({}, why) when nothing says."""
    if kind == "npu":
        text = _run(["npu-smi", "info", "-t", "topo"])
        found = parse_topo(text or "")
        if found:
            return found, "npu-smi info -t topo"
        from tasks import npu_smi

        info = _run(["npu-smi", "info"])
        chips = npu_smi.parse(info).get("chips", []) if info else []
        found = sysfs_affinity({i: c["bus_id"] for i, c in enumerate(chips) if c.get("bus_id")})
        return (found, "sysfs local_cpulist") if found else ({}, "npu-smi not available on this host")
    if kind == "cuda":
        found = parse_topo(_run(["nvidia-smi", "topo", "-m"]) or "")
        return (found, "nvidia-smi topo -m") if found else ({}, "nvidia-smi not available on this host")
    return {}, "even split"


def plan(
    kind: str,
    nproc: int,
    allowed: list[int],
    affinity: dict[int, list[int]],
    source: str,
    visible: list[int] | None = None,
) -> list[dict]:
    """One entry per local rank: {"local_rank", "device", "cpus" (list), "cpulist", "source"}.

    Local rank r uses device visible[r] (physical index, from *_VISIBLE_DEVICES) or r. Ranks whose devices share an
    affinity set split its allowed cores evenly; without affinity the allowed cores are split evenly."""
    allowed_set = set(allowed)
    devices = [(visible[r] if visible and r < len(visible) else r) for r in range(nproc)]
    groups: dict[tuple, list[int]] = {}
    for r, dev in enumerate(devices):
        cores = tuple(c for c in affinity.get(dev, []) if c in allowed_set) if affinity else ()
        groups.setdefault(cores or tuple(allowed), []).append(r)
    out: list[dict] = [{} for _ in range(nproc)]
    for cores, ranks in groups.items():
        share = max(1, len(cores) // len(ranks))
        for i, r in enumerate(ranks):
            mine = list(cores[i * share : (i + 1) * share]) if len(cores) >= len(ranks) else [cores[i % len(cores)]]
            src = (
                source
                if affinity.get(devices[r]) and cores != tuple(allowed)
                else ("even split" if not affinity else f"even split ({source} gave no usable cores)")
            )
            out[r] = {
                "local_rank": r,
                "device": devices[r] if kind != "cpu" else None,
                "cpus": mine,
                "cpulist": format_cpulist(mine),
                "source": src,
            }
    return out


def torchrun_numa_flag() -> bool:
    """Does the installed torch.distributed.run accept --numa-binding? (read from its own argument parser)"""
    try:
        from torch.distributed.run import get_args_parser
    except ImportError:
        return False
    return any("--numa-binding" in a.option_strings for a in get_args_parser()._actions)


def launch_args(cfg, kind: str | None = None) -> list[str]:
    """Extra torchrun options (before the entry point): CUDA uses torchrun's own NUMA binding where it exists."""
    if kind is None:
        import torch

        dev = cfg.hardware.device
        kind = "cuda" if dev == "cuda" or (dev == "auto" and torch.cuda.is_available()) else dev
    if cfg.hardware.bind_cpus and kind == "cuda" and torchrun_numa_flag():
        return ["--numa-binding=exclusive"]
    return []


def entry(cfg) -> list[str]:
    """What torchrun runs in each rank: the worker through the binding entry point, or the worker itself when not
    binding."""
    return ["-m", ENTRY, "--worker", WORKER] if cfg.hardware.bind_cpus else ["-m", WORKER]


def prepare(cfg, kind: str, nproc: int, env: dict) -> list[dict] | None:
    """The binding plan for this node's ranks, put into env[ENV]; None when hardware.bind_cpus is false."""
    if not cfg.hardware.bind_cpus:
        env.pop(ENV, None)
        return None
    affinity, source = device_affinity(kind)
    var = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}.get(kind)
    visible = [int(x) for x in (env.get(var) or "").split(",") if x.strip().isdigit()] if var else None
    entries = plan(kind, nproc, usable_cpus(), affinity, source, visible)
    if kind == "cuda" and torchrun_numa_flag():
        for e in entries:
            e["source"] = f"torchrun --numa-binding=exclusive (report from {e['source']})"
        env.pop(ENV, None)  # torchrun binds; the entry point only runs the worker
    else:
        env[ENV] = json.dumps(entries)
    env[PLAN_ENV] = json.dumps(entries)
    return entries


def record(env: dict, train_dir: Path) -> None:
    """The per-rank plan prepare() made → <train_dir>/binding.json and MLflow (none when not binding)."""
    from tasks import tracking
    from tasks.fsutil import atomic_write_json

    path = Path(train_dir) / "binding.json"
    if env.get(PLAN_ENV):
        atomic_write_json(path, json.loads(env[PLAN_ENV]))
        tracking.log_artifact(path, "train")
    else:
        path.unlink(missing_ok=True)
