"""The CANN command-line tools, used only when they are on PATH: `msprof` to wrap a whole run, `msprof-analyze` to
cross-check Ascend data (its cluster_analysis_output is attached to the report)."""

from __future__ import annotations

import re
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


INSTALL = "pip install msprof-analyze==<the version matching your CANN>"
DB_EXPORT = "msprof --export=on --type=db --output=<the PROF_* directory>"  # CANN's parsing guide: db export again
_MSPROF_DB = re.compile(r"^msprof_\d{14}\.db$")  # msprof-analyze ProfDataAllocate.DB_PATTERNS[MSPROF]


def analyze_command(exe: str, data_dir: Path, out_dir: Path) -> list[str]:
    """`msprof-analyze cluster -m all -d DATA -o OUT`: the `cluster` subcommand is required before 8.2.0a1 and still
    accepted after (msprof_analyze/cli/entrance.py inserts it when missing)."""
    return [exe, "cluster", "-m", "all", "-d", str(data_dir), "-o", str(out_dir)]


def msprof_db_files(data_dir: Path) -> list[Path]:
    return [p for p in Path(data_dir).rglob("msprof_*.db") if _MSPROF_DB.match(p.name)]


def run_msprof_analyze(data_dir: Path, out_dir: Path, timeout_s: int = 900, fmt: str = "ascend_pt") -> dict:
    """`msprof-analyze cluster -m all -d DATA -o OUT` (cluster analysis: step trace, communication matrix/time).

    Returns {"status": "ok"|"failed"|"skipped", …} ("fix": the install command, only when the tool is missing); a
    failure is reported, not raised: our own analysis stands.
    msprof's own PROF_* output is read by msprof-analyze only in db format (msprof_<timestamp>.db): without it the
    cross-check is skipped with that reason, not reported as a failure.
    """
    exe = shutil.which("msprof-analyze")
    if exe is None:
        return {
            "status": "skipped",
            "reason": "msprof-analyze not on PATH (pip install msprof-analyze matching "
            "the CANN version to cross-check)",
            "fix": INSTALL,
        }
    if fmt == "msprof" and not msprof_db_files(data_dir):
        return {
            "status": "skipped",
            "reason": "msprof-analyze reads msprof (PROF_*) data only in db format and "
            f"{data_dir} has no msprof_<timestamp>.db (msprof's text export): export it as db with "
            f"`{DB_EXPORT}` to cross-check",
        }
    cmd = analyze_command(exe, data_dir, out_dir)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"status": "failed", "command": shlex.join(cmd), "reason": f"{type(e).__name__}: {e}"}
    tail = (proc.stdout + proc.stderr)[-4000:]
    if proc.returncode != 0:
        return {"status": "failed", "command": shlex.join(cmd), "returncode": proc.returncode, "log_tail": tail}
    # msprof-analyze logs some refusals and still exits 0 (cluster_analysis.py): say which, not "ok"
    for needle, reason in _REFUSALS:
        if needle in tail:
            return {"status": "skipped", "command": shlex.join(cmd), "reason": reason, "log_tail": tail}
    return {"status": "ok", "command": shlex.join(cmd), "output": str(out_dir), "log_tail": tail}


_REFUSALS = (
    (
        "contains both DB and other files",
        "msprof-analyze refuses folders holding both db and text exports: profile "
        "with one export_type (the project collects ExportType.Text)",
    ),
    ("only supports DB as input data", "this msprof-analyze mode reads db exports only"),
    ("Can not get rank info or profiling data", "msprof-analyze found no rank data it can read in this folder"),
)
