"""`nvidia-smi` CSV queries → per-GPU facts and the compute processes on them: the health DAG's view of CUDA hosts.

Only the driver's own tool is asked (NVML underneath): no CUDA context is created, so sampling never touches a GPU
a training job is using (torch.cuda.mem_get_info would create a context on every device).
"""

from __future__ import annotations

import shutil
import subprocess

GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "temperature.gpu",
    "memory.used",
    "memory.total",
    "utilization.gpu",
    "power.draw",
)
APP_FIELDS = ("gpu_uuid", "pid", "used_memory")


def _num(token: str):
    try:
        return float(token)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def _query(args: list[str], timeout: float) -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        proc = subprocess.run(
            [exe, *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def parse(gpus_csv: str, apps_csv: str = "") -> dict:
    gpus, processes = [], []
    for line in gpus_csv.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(GPU_FIELDS):
            continue
        row = dict(zip(GPU_FIELDS, cells))
        gpus.append(
            {
                "index": int(row["index"]),
                "uuid": row["uuid"],
                "name": row["name"],
                "temp_c": _num(row["temperature.gpu"]),
                "memory_used_mb": _num(row["memory.used"]),
                "memory_total_mb": _num(row["memory.total"]),
                "util_pct": _num(row["utilization.gpu"]),
                "power_w": _num(row["power.draw"]),
            }
        )
    for line in apps_csv.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == len(APP_FIELDS) and cells[1].isdigit():
            processes.append({"gpu_uuid": cells[0], "pid": int(cells[1]), "used_memory_mb": _num(cells[2])})
    return {"gpus": gpus, "processes": processes}


def run(timeout: float = 30.0) -> dict | None:
    """The parsed query, or None when nvidia-smi is absent or fails."""
    gpus = _query([f"--query-gpu={','.join(GPU_FIELDS)}"], timeout)
    if gpus is None:
        return None
    apps = _query([f"--query-compute-apps={','.join(APP_FIELDS)}"], timeout) or ""
    return parse(gpus, apps)
