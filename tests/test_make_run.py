"""`make run` (real make, real bash, the real Makefile): CONF is data, never shell or make syntax; a bad CONF is one
line before Airflow starts; each invocation has its own log."""
from __future__ import annotations

import os
import subprocess

import pytest

from conftest import REPO

PAYLOADS = [  # each would create `pwned` in the temp dir if it reached a shell or make's expansion
    "x'; touch {d}/pwned; echo '",
    "{{\"preset\": \"x'; touch {d}/pwned; echo '\"}}",
    "$(shell touch {d}/pwned)",
    "`touch {d}/pwned`",
    "$$(touch {d}/pwned)",
    "{{\"preset\": \"$(touch {d}/pwned)\"}}",
]


def make_run(conf: str, tmp_path, timeout: int = 120) -> subprocess.CompletedProcess:
    """`make run CONF=…` without the venv/db prerequisites (-o db: already made), in a temp var dir."""
    env = {**os.environ, "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var")}
    env.pop("MAKEFLAGS", None)
    return subprocess.run(["make", "-s", "-o", "db", "run", f"CONF={conf}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_conf_never_reaches_a_shell(payload, tmp_path):
    out = make_run(payload.format(d=tmp_path), tmp_path)
    assert not (tmp_path / "pwned").exists(), f"CONF {payload!r} ran a command"
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [ln for ln in (out.stdout + out.stderr).strip().splitlines() if not ln.startswith("make: ***")]
    assert len(lines) == 1 and lines[0].startswith("error: CONF "), lines
    assert "is not JSON" in lines[0] or "unknown preset" in lines[0], lines[0]
