"""CANN logs and error codes: on a failed stage, copy the CANN host/device logs written during it into
<run-dir>/<stage>/cann-logs/ (bounded) and MLflow, and explain any CANN/HCCL error code the failure carries.

Where CANN writes (CANN log reference): $ASCEND_PROCESS_LOG_PATH if set, else ~/ascend/log, with host process logs in
{debug,run}/plog/plog-<pid>_<time>.log and device logs in {debug,run}/device-<id>/. Only files modified since the
stage started are taken, newest first, each capped to its last `per_file` bytes, `max_bytes` in all.
The codes live in cann_error_codes.yaml (data).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import yaml

from tasks.fsutil import atomic_write_json

CODES_FILE = Path(__file__).with_name("cann_error_codes.yaml")
CODE_RE = re.compile(r"(?<![A-Za-z0-9])(E[0-9A-Z]\d{4})(?![A-Za-z0-9])")
PER_FILE_BYTES = 2 * 1024 * 1024


@functools.lru_cache(maxsize=1)
def error_codes() -> dict[str, dict]:
    return yaml.safe_load(CODES_FILE.read_text(encoding="utf-8"))["codes"]


def find_codes(text: str) -> list[str]:
    """CANN codes in order of appearance, known ones (in the table) first."""
    seen = list(dict.fromkeys(CODE_RE.findall(text or "")))
    table = error_codes()
    return [c for c in seen if c in table] + [c for c in seen if c not in table]


def explain(code: str) -> str:
    """'CANN EI0006 (Communication_Error_Get_Socket): <cause>; fix: <fix>' — one line."""
    e = error_codes().get(code)
    if not e:
        return f"CANN {code} (not in tasks/envcheck/cann_error_codes.yaml: look it up in the CANN error-code reference)"
    return " ".join(f"CANN {code} ({e['name']}): {e['cause']}; fix: {e['fix']}".split())


def log_roots(env: dict | None = None) -> list[Path]:
    env = os.environ if env is None else env
    base = env.get("ASCEND_PROCESS_LOG_PATH")
    return [Path(base)] if base else [Path.home() / "ascend" / "log"]


def recent_logs(since: float, env: dict | None = None) -> list[Path]:
    """CANN log files (plog, device logs) under the log roots modified at or after `since`, newest first."""
    found = []
    for root in log_roots(env):
        if not root.is_dir():
            continue
        for p in root.rglob("*"):
            try:
                if p.is_file() and p.stat().st_mtime >= since:
                    found.append(p)
            except OSError:
                continue
    return sorted(found, key=lambda p: -p.stat().st_mtime)


def collect(dest: Path, since: float, max_bytes: int, env: dict | None = None, per_file: int = PER_FILE_BYTES) -> dict:
    """Copy the logs written since `since` into dest (tails of big files), at most max_bytes in all; returns the
    manifest (also written as dest/manifest.json). Nothing is created when there is nothing to copy."""
    logs = recent_logs(since, env)
    manifest = {
        "roots": [str(r) for r in log_roots(env)],
        "since": since,
        "max_bytes": max_bytes,
        "copied": [],
        "skipped": [],
    }
    if not logs:
        return manifest
    dest.mkdir(parents=True, exist_ok=True)
    used = 0
    for p in logs:
        size = p.stat().st_size
        take = min(size, per_file, max_bytes - used)
        if take <= 0:
            manifest["skipped"].append({"path": str(p), "bytes": size})
            continue
        root = next(r for r in log_roots(env) if str(p).startswith(str(r)))
        rel = p.relative_to(root)
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "rb") as f:
            if take < size:
                f.seek(size - take)
            out.write_bytes(f.read(take))
        used += take
        manifest["copied"].append({"path": str(p), "bytes": size, "kept_bytes": take, "truncated": take < size})
    manifest["bytes"] = used
    atomic_write_json(dest / "manifest.json", manifest)
    return manifest


def _texts(cause: str, files: list[Path], limit: int = 4 * 1024 * 1024) -> str:
    parts = [cause]
    for p in files:
        try:
            with open(p, "rb") as f:
                size = p.stat().st_size
                f.seek(max(0, size - limit))
                parts.append(f.read().decode("utf-8", errors="replace"))
        except OSError:
            continue
    return "\n".join(parts)


def on_failure(cfg, stage: str, run_dir: Path, cause: str, started: float, env: dict | None = None) -> tuple[str, dict]:
    """After a stage failed: collect the CANN logs it produced and name the first error code found in the cause,
    the run's rank logs or those CANN logs. Returns (cause with the explanation appended, facts)."""
    run_dir = Path(run_dir)
    dest = run_dir / stage / "cann-logs"
    max_bytes = int(getattr(cfg.hardware, "cann_log_max_mb", 50) * 1024 * 1024)
    manifest = collect(dest, started - 1.0, max_bytes, env)
    rank_logs = [
        p
        for pattern in ("logs/*.log", f"{stage}/logs/*.log", f"{stage}/**/rank-*.log")
        for p in run_dir.glob(pattern)
        if p.is_file() and p.stat().st_mtime >= started - 1.0
    ]
    copied = [
        dest / Path(c["path"]).relative_to(next(r for r in log_roots(env) if c["path"].startswith(str(r))))
        for c in manifest["copied"]
    ]
    codes = find_codes(_texts(cause, sorted(set(rank_logs)) + copied))
    facts = {
        "cann_logs": str(dest) if manifest["copied"] else None,
        "copied": len(manifest["copied"]),
        "bytes": manifest.get("bytes", 0),
        "codes": codes,
    }
    if manifest["copied"]:
        from tasks import tracking

        tracking.log_artifact(dest, f"{stage}/cann-logs")
    if codes and f"CANN {codes[0]}" not in cause:
        cause = f"{cause} — {explain(codes[0])}"
    if manifest["copied"]:
        cause = f"{cause} (CANN logs: {dest})"
    return cause, facts
