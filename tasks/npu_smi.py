"""`npu-smi info` text → per-chip facts (name, health, power, temperature, memory/HBM) and the processes on them.

The table has two rows per chip and its columns vary by chip generation: 910B/910C show HBM-Usage, 310P/310B
only Memory-Usage; A3 / 910C hosts (and the first-generation 910) list two chips per NPU card with a "Chip Phy-ID"
column (each chip is a device of its own: count (npu, chip) pairs, not cards), 310B a "Chip Device" column.
The device layer's view of Ascend hosts (as tasks/nvidia_smi.py of CUDA ones): the env and health stages and the host
binding read it; the checks over these facts are tasks/envcheck/npu_health.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from tasks.units import GB, MIB

_VERSION = re.compile(r"npu-smi\s+(\S+)\s+Version:\s*(\S+)")
_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")


def _num(token: str, cast=float):
    try:
        return cast(token)
    except (TypeError, ValueError):
        return None  # "NA", "-": not reported by this chip


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse(text: str) -> dict:
    """Parse `npu-smi info`; {"version", "chips": [...], "processes": [...]}. Memory figures are MB."""
    version = _VERSION.search(text)
    chips, processes, has_hbm, section, pending = [], [], False, "chips", None
    for line in text.splitlines():
        if not line.strip().startswith("|"):
            continue
        if "Process id" in line:
            section = "processes"
            continue
        if "HBM-Usage" in line:
            has_hbm = True
        cells = _cells(line)
        tokens = cells[0].split()
        if section == "processes":
            if len(cells) == 4 and len(tokens) == 2 and all(t.isdigit() for t in tokens):
                processes.append(
                    {
                        "npu": int(tokens[0]),
                        "chip": int(tokens[1]),
                        "pid": _num(cells[1], int),
                        "name": cells[2],
                        "memory_mb": _num(cells[3], int),
                    }
                )
            continue
        if len(cells) != 3 or not tokens or not tokens[0].isdigit():
            continue  # header rows
        stats = cells[2].split()
        if len(tokens) == 2 and not tokens[1].isdigit():  # first row: NPU id, name | health | power, temp
            pending = {
                "npu": int(tokens[0]),
                "name": tokens[1],
                "health": cells[1],
                "power_w": _num(stats[0]) if stats else None,
                "temp_c": _num(stats[1], int) if len(stats) > 1 else None,
            }
        elif pending is not None:  # second row: chip [id] | bus id | aicore, memory
            pairs = [(int(a), int(b)) for a, b in _PAIR.findall(cells[2])]
            used, total = pairs[1] if has_hbm and len(pairs) > 1 else (pairs[0] if pairs else (None, None))
            chips.append(
                {
                    **pending,
                    "chip": int(tokens[0]),
                    "device_id": int(tokens[1]) if len(tokens) > 1 else None,
                    "bus_id": cells[1],
                    "aicore_pct": _num(stats[0], int) if stats else None,
                    "memory_kind": "HBM" if has_hbm and len(pairs) > 1 else "DDR",
                    "memory_used_mb": used,
                    "memory_total_mb": total,
                }
            )
            pending = None
    return {"version": version.group(2) if version else None, "chips": chips, "processes": processes}


def failure(proc: subprocess.CompletedProcess) -> str:
    """'exit 1: <first line of stderr>' for a management tool that ran and failed."""
    lines = [ln.strip() for ln in ((proc.stderr or "") + "\n" + (proc.stdout or "")).splitlines() if ln.strip()]
    return f"exit {proc.returncode}: {lines[0] if lines else 'no output'}"


def query(timeout: float = 30.0) -> tuple[str | None, str | None]:
    """(`npu-smi info` output, None); (None, None) when the tool is not installed; (None, why) when it is installed
    but fails ('exit 1: <stderr first line>', a timeout): a broken driver, not a host without NPUs."""
    exe = shutil.which("npu-smi")
    if not exe:
        return None, None
    try:
        proc = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"no answer in {timeout:g} s"
    except OSError as e:
        return None, str(e.strerror or e)
    return (proc.stdout, None) if proc.returncode == 0 else (None, failure(proc))


def run(timeout: float = 30.0) -> str | None:
    """`npu-smi info` output, or None when the tool is absent or fails (`query` tells the two apart)."""
    return query(timeout)[0]


def summary(info: dict) -> str:
    """'2× 910B2C, 64 GB HBM each' style line for the human summary."""
    if not info["chips"]:
        return "npu-smi: no chips"
    names = sorted({c["name"] for c in info["chips"]})
    total = info["chips"][0]["memory_total_mb"] or 0
    return f"{len(info['chips'])}× {'/'.join(names)}, {total * MIB / GB:.0f} GB {info['chips'][0]['memory_kind']} each"
