"""The real cause of a failed rank, and whether a retry can fix it.

Each worker's `main` is wrapped in torch.distributed.elastic's `@record`, so a Python exception lands in the error
file torchrun hands the rank (TORCHELASTIC_ERROR_FILE, under `<run-dir>/logs/torchelastic-node<N>/…/<local_rank>/
error.json`, kept because the launcher passes `--log-dir`). Without an error file (an exception before `@record`
ran, or an older torch) the last exception line the rank wrote to `logs/rank-K.log` in this launch is used.

Classification: a rank that raised a Python exception of its own (bad data, a bug, a config error that only shows
at run time) fails the stage at once — a retry would fail the same way. A rank killed by a signal, a lost peer or a
collective timeout is retryable: the retry resumes from the last verified checkpoint.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path

# The last line of a Python traceback: "pkg.mod.SomeError: message" (or a bare "SomeError").
_EXC_LINE = re.compile(
    r"^(?:\[[^\]]*\]:?\s*)?"  # an optional "[rank]:" prefix
    r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt))(?::\s*(.*))?$"
)
# Errors a rank gets because a *peer* died or the network failed: secondary, and a retry can fix them.
_COLLECTIVE = re.compile(
    r"connection (closed|reset)|closed by peer|broken pipe|timed out|timeout|"
    r"watchdog|nccl|hccl|gloo|socket|connection refused|rendezvous|store",
    re.I,
)


@dataclass
class RankFailure:
    rank: int
    exitcode: int
    exc_type: str = ""  # "" when the rank left no Python exception
    message: str = ""
    source: str = ""  # where the cause was read (error file or rank log)

    @property
    def signal(self) -> str:
        if self.exitcode >= 0:
            return ""
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def collective(self) -> bool:
        """A communication failure: usually the consequence of another rank dying, or the network."""
        return bool(self.exc_type) and (
            self.exc_type.split(".")[-1] in ("DistBackendError", "DistNetworkError", "DistStoreError")
            or (self.exc_type.split(".")[-1] == "RuntimeError" and bool(_COLLECTIVE.search(self.message)))
        )

    @property
    def python_exception(self) -> bool:
        return bool(self.exc_type) and not self.collective


_REPORT = re.compile(r"rank\s*:\s*(\d+)(?:\s*\(local_rank:\s*(\d+)\))?.*?\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_report(log_text: str) -> list[tuple[int, int | None, int]]:
    """[(global rank, local rank or None, exitcode)] of every failed rank in torchrun's end-of-run report, the root
    cause first."""
    if "Root Cause" in log_text:
        root = log_text[log_text.rfind("Root Cause") :]
        rest = log_text[log_text.rfind("Failures:") : log_text.rfind("Root Cause")] if "Failures:" in log_text else ""
    else:
        root, rest = log_text, ""
    out, seen = [], set()
    for r, lr, c in _REPORT.findall(root) + _REPORT.findall(rest):
        if int(r) not in seen:
            seen.add(int(r))
            out.append((int(r), int(lr) if lr else None, int(c)))
    return out


def torchrun_failures(log_text: str) -> list[tuple[int, int]]:
    """[(global rank, exitcode)] of every failed rank in torchrun's end-of-run report, root cause first."""
    return [(r, c) for r, _, c in torchrun_report(log_text)]


def error_file_cause(log_dir: Path, local_rank: int) -> tuple[str, str] | None:
    """(exception type, message) from the rank's @record error file of the newest launch in log_dir."""
    files = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}/error.json"), key=lambda p: p.stat().st_mtime)
    for path in reversed(files):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        msg = data.get("message")
        text = msg.get("message", "") if isinstance(msg, dict) else str(msg or "")
        parsed = _split(text.strip().splitlines()[0] if text.strip() else "")
        if parsed:
            return parsed
    return None


def log_cause(rank_log: Path, offset: int = 0) -> tuple[str, str] | None:
    """(exception type, message) of the last traceback line the rank wrote after `offset` (this launch only)."""
    try:
        with open(rank_log, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last)"):
            for line in lines[i + 1 :]:  # the first unindented line after the frames
                if line and not line[0].isspace():
                    parsed = _split(line)
                    if parsed:
                        return parsed
    return None


def _split(line: str) -> tuple[str, str] | None:
    m = _EXC_LINE.match(line.strip())
    if not m:
        return None
    return m.group(1), " ".join((m.group(2) or "").split())[:400]


def collect(
    torchrun_log: str, logs_dir: Path, node_rank: int, nproc: int, offsets: dict[str, int] | None = None
) -> list[RankFailure]:
    """Every failed rank of this launch with its cause where one was left (error file first, then rank log)."""
    logs_dir = Path(logs_dir)
    out = []
    for rank, local, code in torchrun_report(torchrun_log):
        f = RankFailure(rank, code)
        if local is None:  # an older report format: standalone numbering
            local = rank - node_rank * nproc
        found = error_file_cause(logs_dir / f"torchelastic-node{node_rank}", local) if 0 <= local < nproc else None
        if found:
            f.source = f"error file of rank {rank}"
        else:
            log = logs_dir / f"rank-{rank}.log"
            found = log_cause(log, (offsets or {}).get(log.name, 0))
            f.source = f"logs/rank-{rank}.log" if found else ""
        if found:
            f.exc_type, f.message = found
        out.append(f)
    return out


# An OS error that no retry can fix: the disk is full, read-only or over quota. PyTorch's own writer reports ENOSPC
# as "PytorchStreamWriter failed writing file …: file write failed" (caffe2/serialize/inline_container.cc).
_DISK = re.compile(
    r"No space left on device|Read-only file system|Disk quota exceeded|\[Errno (?:28|30|122)\]|file write failed",
    re.I,
)
PROBE_BYTES = 1 << 20


def disk_fault(run_dir: Path, failures: list[RankFailure]) -> str | None:
    """After a failed launch, before anything is cleaned up: the one-line cause when the run directory's filesystem
    is full or read-only (a probe write of 1 MB fails), or a rank died of ENOSPC/EROFS/EDQUOT. A full disk often
    leaves no error file and no rank log (they live on the same disk), so the probe comes first."""
    import errno
    import os

    from tasks.errors import os_error_cause

    run_dir = Path(run_dir)
    probe = run_dir / f".disk-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES):
            e.filename = str(run_dir)
            return os_error_cause(e)
    finally:
        probe.unlink(missing_ok=True)
    for f in failures:
        if _DISK.search(f.message):
            return f"{run_dir}: rank {f.rank}: {f.exc_type}: {f.message}"
    return None


def log_offsets(logs_dir: Path) -> dict[str, int]:
    """Sizes of the rank logs before a launch (they are appended to): causes are read after these offsets."""
    return {p.name: p.stat().st_size for p in Path(logs_dir).glob("rank-*.log")}


def root_cause(failures: list[RankFailure]) -> RankFailure | None:
    """The failure to report: a rank's own Python exception, else a rank killed by a signal other than the
    SIGTERM torchrun sends to the survivors, else a collective error, else the first failure reported."""
    for pick in (
        lambda f: f.python_exception,
        lambda f: f.exitcode < 0 and f.signal != "SIGTERM",
        lambda f: f.collective,
    ):
        for f in failures:
            if pick(f):
                return f
    return failures[0] if failures else None
