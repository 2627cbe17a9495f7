"""The CANN command-line tools, used only when they are on PATH: `msprof` to wrap a whole run, `msprof-analyze` to
cross-check Ascend data (its cluster_analysis_output is attached to the report)."""
from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path


def msprof_wrap(cmd: list[str], out_dir: Path, msprof: str | None) -> list[str]:
    """`msprof --application="<cmd>" --output=<dir>` around a launch command (Ascend/msprof quick_start)."""
    if not msprof:
        return list(cmd)
    return [msprof, f"--application={shlex.join(cmd)}", f"--output={out_dir}"]


def find_msprof() -> str | None:
    return shutil.which("msprof")


def run_msprof_analyze(data_dir: Path, out_dir: Path, timeout_s: int = 900) -> dict:
    """`msprof-analyze -m all -d DATA -o OUT` (cluster analysis: step trace, communication matrix/time).

    Returns {"status": "ok"|"failed"|"skipped", …}; a failure is reported, not raised: our own analysis stands.
    """
    exe = shutil.which("msprof-analyze")
    if exe is None:
        return {"status": "skipped", "reason": "msprof-analyze not on PATH (pip install msprof-analyze matching "
                                               "the CANN version to cross-check)"}
    cmd = [exe, "-m", "all", "-d", str(data_dir), "-o", str(out_dir)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"status": "failed", "command": shlex.join(cmd), "reason": f"{type(e).__name__}: {e}"}
    tail = (proc.stdout + proc.stderr)[-4000:]
    if proc.returncode != 0:
        return {"status": "failed", "command": shlex.join(cmd), "returncode": proc.returncode, "log_tail": tail}
    return {"status": "ok", "command": shlex.join(cmd), "output": str(out_dir), "log_tail": tail}
