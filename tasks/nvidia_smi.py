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


def _query(args: list[str], timeout: float) -> tuple[str | None, str | None]:
    """(output, None); (None, None) when nvidia-smi is not installed; (None, why) when it runs and fails."""
    from tasks.npu_smi import failure

    exe = shutil.which("nvidia-smi")
    if not exe:
        return None, None
    try:
        proc = subprocess.run(
            [exe, *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, f"no answer in {timeout:g} s"
    except OSError as e:
        return None, str(e.strerror or e)
    return (proc.stdout, None) if proc.returncode == 0 else (None, failure(proc))


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


def query(timeout: float = 30.0) -> tuple[dict | None, str | None]:
    """(the parsed query, None); (None, None) when nvidia-smi is not installed; (None, why) when it fails."""
    gpus, error = _query([f"--query-gpu={','.join(GPU_FIELDS)}"], timeout)
    if gpus is None:
        return None, error
    apps = _query([f"--query-compute-apps={','.join(APP_FIELDS)}"], timeout)[0] or ""
    return parse(gpus, apps), None


def run(timeout: float = 30.0) -> dict | None:
    """The parsed query, or None when nvidia-smi is absent or fails (`query` tells the two apart)."""
    return query(timeout)[0]
