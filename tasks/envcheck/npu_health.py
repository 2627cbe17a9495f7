"""Checks over `npu-smi info` facts (tasks/npu_smi.py parses them): chip health and chips already busy."""

from __future__ import annotations

from tasks.envcheck import check


def checks(info: dict) -> list[dict]:
    """Chip health (Warning → warn, anything but OK/Warning → fail) and chips already busy with processes."""

    def label(c: dict) -> str:
        return f"NPU {c['npu']} chip {c['chip']} ({c['name']}) is {c['health']}"

    out = []
    bad = [c for c in info["chips"] if c["health"] not in ("OK", "Warning")]
    warned = [c for c in info["chips"] if c["health"] == "Warning"]
    if bad:
        out.append(
            check(
                "npu-health",
                "fail",
                "; ".join(map(label, bad)) + ": see `npu-smi info` and the device logs before training",
            )
        )
    elif warned:
        out.append(check("npu-health", "warn", "; ".join(map(label, warned))))
    else:
        out.append(check("npu-health", "ok", f"{len(info['chips'])} chip(s) OK"))
    if info["processes"]:
        busy = ", ".join(
            f"NPU {p['npu']} chip {p['chip']}: pid {p['pid']} {p['name']} {p['memory_mb']} MB"
            for p in info["processes"]
        )
        out.append(check("npu-idle", "warn", f"processes already hold NPU memory ({busy})"))
    return out
