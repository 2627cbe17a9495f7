"""`make run CONF=…` as a user types it (the make-run and bad-input tests)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def make_run(conf: str, tmp_path, timeout: int = 120) -> subprocess.CompletedProcess:
    """`make run CONF=…` without the venv/db prerequisites (-o db: already made), in a temp var dir."""
    env = {**os.environ, "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var")}
    for var in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):  # a user's top-level make, even under make test
        env.pop(var, None)
    return subprocess.run(
        ["make", "-s", "-o", "db", "run", f"CONF={conf}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
