"""Host binding: each rank on the CPU cores nearest its device, and the data loader sized from those cores.

Where the cores come from:
- NPU: the `CPU Affinity` column of `npu-smi info -t topo`; else sysfs (`/sys/bus/pci/devices/<bus-id>/
  local_cpulist`, bus ids from `npu-smi info`).
- CUDA: torchrun's own `--numa-binding` (torch.distributed.run in torch ≥ 2.9; torch/numa/binding.py computes the
  cores from the GPU's PCI NUMA node, CUDA only) — passed as `--numa-binding=exclusive`, which splits each NUMA
  node's cores evenly among its GPUs; `nvidia-smi topo -m` gives the same split for the per-rank report.
- CPU: the usable cores split evenly among the ranks.
Ranks sharing an affinity set split it evenly. Applied per rank by this module as torchrun's entry point
(`python -m tasks.parallel.binding <worker args>`): `numactl --physcpubind=… --localalloc` when numactl is on PATH
(exec, same PID), else the taskset equivalent os.sched_setaffinity; then the worker module runs.
`hardware.bind_cpus=false` turns it off. The plan travels in $LLM_PIPELINE_CPU_BINDING (JSON, one entry per local
rank) and is reported per rank (train result, MLflow train/binding.json, each rank's log).
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

ENV = "LLM_PIPELINE_CPU_BINDING"  # the plan the entry shim applies
PLAN_ENV = "LLM_PIPELINE_CPU_BINDING_PLAN"  # the plan for the report (also when torchrun binds itself)
WORKER = "tasks.train.worker"
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
        from tasks.envcheck import npu_smi

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


def entry_module(cfg) -> str:
    return __name__ if cfg.hardware.bind_cpus else WORKER


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
        env.pop(ENV, None)  # torchrun binds; the shim only runs the worker
    else:
        env[ENV] = json.dumps(entries)
    env[PLAN_ENV] = json.dumps(entries)
    return entries


def loader_options(cfg, device) -> dict:
    """ShardLoader keywords for this rank: workers from its cores (after binding), pinned memory on accelerators,
    the configured prefetch factor."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = loader_workers(cfg, cores)
    return {
        "num_workers": workers,
        "pin_memory": device.type != "cpu",
        "prefetch_factor": cfg.data.prefetch_factor if workers > 0 else None,
    }


def loader_workers(cfg, cores_per_rank: int) -> int:
    """data.loader_workers: an explicit value (>= 0) wins; -1 = one worker per spare core of the rank (the rank's
    own thread keeps one), at most 4, at least 0."""
    if cfg.data.loader_workers >= 0:
        return cfg.data.loader_workers
    return max(0, min(4, cores_per_rank - 1))


def apply(entry: dict, argv: list[str], worker: str = WORKER) -> None:
    """Bind this process (numactl exec when available, else sched_setaffinity) and run the worker."""
    if os.environ.get("LLM_PIPELINE_BOUND"):  # already under numactl (this module exec'd itself)
        return
    cpus = entry.get("cpus") or []
    print(
        f"[binding] local rank {entry.get('local_rank')} → CPUs {entry.get('cpulist')} ({entry.get('source')})",
        file=sys.stderr,
        flush=True,
    )
    numactl = shutil.which("numactl")
    if cpus and numactl:
        os.environ["LLM_PIPELINE_BOUND"] = "1"
        os.execv(
            numactl,
            [
                numactl,
                f"--physcpubind={entry['cpulist']}",
                "--localalloc",
                sys.executable,
                "-m",
                __name__,
                "--worker",
                worker,
                *argv,
            ],
        )
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def main(argv: list[str] | None = None, worker: str = WORKER) -> None:
    """torchrun entry point: bind this rank per $LLM_PIPELINE_CPU_BINDING, then run the worker module with argv."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker, argv = argv[1], argv[2:]
    raw = os.environ.get(ENV)
    if raw:
        entries = json.loads(raw)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local < len(entries):
            apply(entries[local], argv, worker)
    sys.argv = [worker, *argv]
    runpy.run_module(worker, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
