"""Logic behind the environment stage (tasks/stages/env.py): versions, compatibility, npu-smi, system, collective probe.

Every check is a small dict {"name", "status": ok|warn|fail, "detail"}; a fail stops the pipeline, a warn doesn't.
"""

from __future__ import annotations

STATUSES = ("ok", "warn", "fail")


def check(name: str, status: str, detail: str) -> dict:
    if status not in STATUSES:
        raise ValueError(f"check {name}: status {status!r} is not one of {STATUSES}")
    return {"name": name, "status": status, "detail": " ".join(str(detail).split())}


def worst(checks: list[dict]) -> str:
    """The overall status: the most severe of the checks ("ok" when there are none)."""
    return max((c["status"] for c in checks), key=STATUSES.index, default="ok")
