"""Logging for the stages: levels that survive Airflow's task log, the CLI's console, and progress lines.

Airflow 3.3's task supervisor forwards a task process's stdout at INFO and every line of its stderr at ERROR
(`airflow/sdk/execution_time/supervisor.py`, `_register_pipe_readers`: `task.stderr` with `log_level=logging.ERROR`);
only records sent through `logging` keep their level. So inside a DAG task `to_logging()` turns the process's
`sys.stdout`/`sys.stderr` into line writers that log each line at the level it names ("warning: …", "[ok] …",
MLflow's "… INFO mlflow…: …"; plain text is INFO): stage code keeps printing, Airflow's level filter works, and a
successful task's log has no ERROR line. Output written straight to file descriptors 1/2 by C code or by a child
process that inherits them bypasses Python and keeps Airflow's stdout/stderr levels: child processes of the
stages write to their own log files (torchrun) or are captured (npu-smi, probes).

`Progress` prints the progress line of a long loop (every N items or S seconds: done/total, figures, rate, ETA)
and `waiting()` says what a long wait waits for; `relay()` copies a child process's progress lines from its log
file into this process's log (rank 0 of torchrun → the Airflow task log). The CLI calls `console()`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("tasks")
PROGRESS = logging.getLogger("tasks.progress")
PROGRESS_MARK = "progress:"  # every progress line starts with it (relay() and `make run` pick lines by it)

_TAG = re.compile(r"^\s*\[\s*(ok|info|pass|warn|warning|fail|failed|error)\s*\]", re.I)
# A level word first: "warning: …", "ERROR - …", or any case after a timestamp ("2026/12/01 12:00:00 INFO mlflow…")
_WORD = re.compile(
    r"^(?P<ts>\[?[\d\-/:T.,Z ]{8,}\]?\s*)?\[?(?P<word>debug|info|warn|warning|error|critical|fatal)\]?(?P<end>:|\s|$)",
    re.I,
)
_GLOG = re.compile(r"^\[?([IWEF])\d{4} \d\d:\d\d:\d\d")  # c10/glog: "[W1201 12:00:00.123 file.cpp:12] …"
_PYWARN = re.compile(r"^\S+:\d+: \w*Warning: ")  # warnings.showwarning's format
_NAMES = {
    "ok": logging.INFO,
    "pass": logging.INFO,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "w": logging.WARNING,
    "fail": logging.WARNING,  # a failed check is detail: the task's failure is its own one ERROR line
    "failed": logging.WARNING,
    "error": logging.ERROR,
    "e": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
    "f": logging.CRITICAL,
    "i": logging.INFO,
}


def level_of(line: str, previous: int = logging.INFO) -> int:
    """The logging level a printed line names; an indented line continues the record above it (a traceback's
    frames, a check's detail); anything else is INFO. A traceback header is a WARNING: a task that fails says
    so in its own ERROR line, and a handled exception someone printed does not make a success an error."""
    m = _WORD.match(line)  # "Error rate 2%" is no error: a bare word counts in capitals or before a colon
    if m and (m["ts"] or m["end"] == ":" or m["word"].isupper()):
        return _NAMES[m["word"].lower()]
    for pattern in (_TAG, _GLOG):
        m = pattern.match(line)
        if m:
            return _NAMES[m.group(1).lower()]
    if _PYWARN.match(line) or line.startswith("Traceback (most recent call last)"):
        return logging.WARNING
    if line[:1].isspace():
        return previous
    return logging.INFO


class _Active(threading.local):
    writing = False  # this thread is inside logger.log(): a handler printing to sys.std* goes straight through


_ACTIVE = _Active()


class LineLogger(io.TextIOBase):
    """A text stream that logs each complete line at level_of(line) (partial lines wait for their newline)."""

    def __init__(self, logger: logging.Logger, original):
        super().__init__()
        self.logger, self.original = logger, original
        self._buf, self._previous, self._lock = "", logging.INFO, threading.Lock()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self):
        return getattr(self.original, "encoding", "utf-8")

    def fileno(self) -> int:  # a child process given this stream inherits the real descriptor
        return self.original.fileno()

    @property
    def buffer(self):  # bytes written to the binary layer bypass the line logging (Airflow's level for the stream)
        return self.original.buffer

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if _ACTIVE.writing:  # a logging handler writing to this stream: never loop back into logging
            return self.original.write(text)
        with self._lock:
            self._buf += text
            lines = self._buf.split("\n")
            self._buf = lines.pop()
        for line in lines:
            self._emit(line)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self.original.flush()

    def close_line(self) -> None:
        """Log a pending partial line (the stream is being handed back)."""
        with self._lock:
            rest, self._buf = self._buf, ""
        self._emit(rest)

    def _emit(self, line: str) -> None:
        line = line.rstrip().rsplit("\r", 1)[-1]  # a progress bar redrawn with \r: its last state
        if not line.strip():
            return
        self._previous = level = level_of(line, self._previous)
        _ACTIVE.writing = True
        try:
            self.logger.log(level, line)
        finally:
            _ACTIVE.writing = False


@contextlib.contextmanager
def to_logging(name: str = "tasks"):
    """Within the block, sys.stdout and sys.stderr are LineLoggers (`<name>.stdout`, `<name>.stderr`): what the
    stage prints reaches Airflow's task log at the level it names. Restored afterwards, even on failure."""
    saved = sys.stdout, sys.stderr
    out = LineLogger(logging.getLogger(f"{name}.stdout"), sys.stdout)
    err = LineLogger(logging.getLogger(f"{name}.stderr"), sys.stderr)
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        for stream in (out, err):
            stream.close_line()
        sys.stdout, sys.stderr = saved


class _Stderr(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when it writes (not the stream of the moment it was made)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _ConsoleFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING and not msg.lower().startswith(("warning", "error")):
            msg = f"{'error' if record.levelno >= logging.ERROR else 'warning'}: {msg}"
        return msg


def console(level: int = logging.INFO) -> None:
    """The CLI: the `tasks` loggers print their messages to stderr (warnings and errors say so); idempotent. Records
    still propagate (a caller's own handlers, pytest's, see them too)."""
    if any(getattr(h, "_tasks_console", False) for h in log.handlers):
        return
    handler = _Stderr()
    handler.setFormatter(_ConsoleFormat())
    handler._tasks_console = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(level)


def duration(seconds: float) -> str:
    """3725 → '1h02m', 130 → '2m10s', 9.5 → '10s'."""
    s = int(round(max(0.0, seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _human(x: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def figure(name: str, value) -> str:
    """One figure of a progress line: tokens_per_s=5100 → '5.1k tokens/s', mfu=0.31 → 'MFU 31%',
    val_loss=3.4 → 'val loss 3.400', anything else 'name value' (4 significant digits)."""
    if name.endswith("_per_s"):
        return f"{_human(value)} {name[: -len('_per_s')].replace('_', ' ')}/s"
    if name == "mfu":
        return f"MFU {value:.0%}"
    if name.endswith("_pct"):
        return f"{name[:-4].replace('_', ' ')} {value:.1f}%"
    if isinstance(value, float):
        shown = f"{value:.3f}" if "loss" in name else f"{value:.4g}"
    else:
        shown = str(value)
    return f"{name.replace('_', ' ')} {shown}"


class Progress:
    """Progress lines for a loop of `total` items: `update(done, **figures)` logs one (and returns it) on the first
    item, then whenever `every` items (0: never by count) or `seconds` have passed, and on the last item:

        progress: train step 120/300 (40%), loss 3.214, val loss 3.402, 5.1k tokens/s, MFU 31%, ETA 2m10s

    Figures with the value None are left out. The rate (for the ETA) counts from the first update, so a resumed
    loop starting at item 100 estimates from its own speed."""

    def __init__(
        self,
        what: str,
        total: int | None,
        unit: str = "",
        every: int = 0,
        seconds: float = 30.0,
        logger: logging.Logger | None = None,
        clock=time.monotonic,
    ):
        self.what, self.total, self.unit, self.every, self.seconds = what, total, unit, every, seconds
        self.logger, self.clock = logger or PROGRESS, clock
        self._first: tuple[int, float] | None = None
        self._last_done, self._last_t = None, 0.0

    def due(self, done: int) -> bool:
        if self._last_done is None or (self.total is not None and done >= self.total):
            return True
        if self.every and done - self._last_done >= self.every:
            return True
        return self.clock() - self._last_t >= self.seconds

    def update(self, done: int, **figures) -> str | None:
        now = self.clock()
        if self._first is None:
            self._first = (done, now)
        if not self.due(done):
            return None
        self._last_done, self._last_t = done, now
        line = self.line(done, now, figures)
        self.logger.info(line)
        return line

    def line(self, done: int, now: float, figures: dict) -> str:
        head = f"{PROGRESS_MARK} {self.what}{' ' + self.unit if self.unit else ''} {done}"
        if self.total:
            head += f"/{self.total} ({done / self.total:.0%})"
        parts = [head] + [figure(k, v) for k, v in figures.items() if v is not None]
        d0, t0 = self._first or (done, now)
        if self.total and done > d0 and now > t0:
            left = (self.total - done) * (now - t0) / (done - d0)
            parts.append("done" if done >= self.total else f"ETA {duration(left)}")
        return ", ".join(parts)


@contextlib.contextmanager
def waiting(what: str, every_s: float = 30.0, logger: logging.Logger | None = None):
    """Say what a long wait waits for: 'progress: waiting for <what>…', every `every_s` 'progress: still waiting for
    <what> (N s)', and 'progress: <what>: done after N s' (or '… gave up after N s' when the block raises): progress
    lines, which relay() and `make run` pick up."""
    logger = logger or PROGRESS
    start, stop = time.monotonic(), threading.Event()
    logger.info(f"{PROGRESS_MARK} waiting for {what}…")

    def remind() -> None:
        while not stop.wait(every_s):
            logger.info(f"{PROGRESS_MARK} still waiting for {what} ({duration(time.monotonic() - start)})")

    thread = threading.Thread(target=remind, name="waiting", daemon=True)
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        thread.join(1.0)
        took = duration(time.monotonic() - start)
        logger.info(f"{PROGRESS_MARK} {what}: {'done' if ok else 'gave up'} after {took}")


@contextlib.contextmanager
def relay(path: str | Path, mark: str = PROGRESS_MARK, poll_s: float = 1.0, logger: logging.Logger | None = None):
    """While the block runs, copy the lines of `path` (a child process's log, which may not exist yet) that
    contain `mark` into this process's log at INFO, from where the file ends when the block starts; the lines
    written before the block ends are copied before it returns."""
    logger, path, stop = logger or PROGRESS, Path(path), threading.Event()
    offset = path.stat().st_size if path.is_file() else 0

    def copy() -> None:
        nonlocal offset
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        offset += len(complete)
        for raw in complete.decode("utf-8", errors="replace").splitlines():
            at = raw.find(mark)
            if at >= 0:
                logger.info(raw[at:].rstrip())

    def loop() -> None:
        while not stop.wait(poll_s):
            copy()

    thread = threading.Thread(target=loop, name="relay", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(poll_s + 5.0)
        copy()
