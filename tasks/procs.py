"""Child processes that never outlive their launcher, and the run directory's writer lock.

- `run_in_group(argv, …)`: torchrun (or any long child) in its own process group, with PR_SET_PDEATHSIG so a
  kill -9 of the launcher (`python -m tasks train`, an Airflow task) takes it down too; an exception or signal in
  the launcher (KeyboardInterrupt, SIGTERM from Airflow) stops the whole group (SIGTERM, then SIGKILL).
  torchrun starts each rank in a session of its own; the worker calls `die_with_parent()` itself, so a torchrun
  that dies without cleaning up takes its ranks with it.
- `RunDirLock`: an exclusive flock on `<run-dir>/.lock[-nodeN]` for the writing stages; a second writer fails at
  once in one line naming the holder's pid, host and stage. The kernel drops the lock when the holder dies, so a
  killed run never leaves a stale lock.
- `freeze_long_lived()` / `skip_exit_collection()`: the cyclic garbage collector's full passes skip what a stage's
  process keeps to its end (imported modules, Airflow's API models) — while it runs and at its shutdown.
- `full_collections_paused()`: no full collector passes while a block imports what the process keeps (torchrun's
  forking agent).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tasks.errors import StageError

PR_SET_PDEATHSIG = 1
_exit_collection_skipped = False


def freeze_long_lived() -> None:
    """At a point where nothing of the work before is meant to stay (a stage's start; a rank between its specs):
    collect that work's cyclic garbage, then move every object still alive into the permanent generation
    (gc.freeze), which later collections never scan. They scan only what the work after creates — an `airflow dags
    test` process holds ~1M objects by its later stages and a rank ~300k after its imports, and their full passes
    were 15-30 % of their CPU. Objects are still freed by reference count; only one frozen here that later joins
    a garbage cycle stays until the process ends."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def full_collections_paused():
    """No full (oldest-generation) collector passes inside the block; the young generations are still collected.
    For imports of what the process keeps to its end: importing torch, FSDP2, DTensor, DCP and dynamo leaves ~300k
    objects that all stay, and the five full passes CPython ran over them on the way freed nothing (the agent's
    preload: 0.84-0.95x the CPU without them, bench_gc's gc.agent_preload_cpu_ratio_paused_vs_default); the young
    passes free the imports' own short-lived cycles as before (the same RSS after them: without any pass it grew
    5 MB). Follow with freeze_long_lived(), which collects once and freezes."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, 2**31 - 1)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, full)


def skip_exit_collection() -> None:
    """At exit (atexit, before the interpreter tears its modules down): gc.freeze() moves every object into the
    permanent generation, which the full collections of that teardown never scan. A process that ran a stage holds
    ~1M of them (Airflow's execution API models, torch, MLflow); the collections found nothing worth the time — an
    `airflow dags test` stopped at env spent 2.5 of its 13 CPU s there. Objects are still freed by reference count;
    only cyclic garbage is left to the exiting process (CPython never promises `__del__` at exit). Once a process."""
    global _exit_collection_skipped
    if not _exit_collection_skipped:
        atexit.register(gc.freeze)
        _exit_collection_skipped = True


def die_with_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> None:
    """Linux: deliver `sig` to this process when its parent exits; exits now if the parent is already gone."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def run_in_group(
    argv: list[str], *, env: dict, cwd, stdout, grace_s: float = 30.0, timeout_s: float | None = None
) -> int:
    """Run argv to completion in its own process group; returns its exit status. Never leaves the group running:
    on any exception here (KeyboardInterrupt, SIGTERM turned into one, timeout) the group gets SIGTERM, then
    SIGKILL after `grace_s`."""
    parent = os.getpid()
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: die_with_parent(signal.SIGTERM, parent),
    )
    try:
        return proc.wait(timeout=timeout_s)
    except BaseException:
        stop_group(proc, grace_s)
        raise


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class RunDirLock:
    """`with RunDirLock(run_dir, stage, node):` — exclusive while the stage writes into run_dir."""

    def __init__(self, run_dir: Path, stage: str, node: int = 0):
        self.path = Path(run_dir) / (".lock" if node == 0 else f".lock-node{node}")
        self.stage = stage
        self.fd: int | None = None

    def __enter__(self) -> "RunDirLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StageError(
                f"run directory {self.path.parent} is in use by pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')} (stage {holder.get('stage', '?')}, since "
                f"{holder.get('since', '?')}); wait for it to finish, stop it, or use another "
                f"--run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "stage": self.stage,
                    "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                }
            ).encode(),
            0,
        )
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def lock_holder(run_dir, node: int = 0) -> dict | None:
    """The last stage that took the run directory's lock (RunDirLock's `.lock`: pid, host, stage, since) with `held`:
    True while it still holds it (running now), False when it let go, None when this host cannot tell (another
    host's). Read without taking the lock: a reader (the summary) must never make a starting stage fail "in use"."""
    path = Path(run_dir) / (".lock" if node == 0 else f".lock-node{node}")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        holder, st = _holder(fd), os.fstat(fd)
    finally:
        os.close(fd)
    if not holder.get("stage"):
        return None
    if holder.get("host") not in (None, socket.gethostname()):
        return {**holder, "held": None}
    return {**holder, "held": _lock_held(st.st_dev, st.st_ino)}


def _lock_held(dev: int, ino: int) -> bool | None:
    """Whether some process holds a lock on the file (device, inode), from /proc/locks (Linux: `N: FLOCK ADVISORY
    WRITE PID MAJ:MIN:INODE 0 EOF`; POSIX too: NFS emulates flock with POSIX locks), else None (not knowable without
    taking the lock)."""
    try:
        text = Path("/proc/locks").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()
        kind = next((k for k in ("FLOCK", "POSIX") if k in fields), None)
        if kind is None or "->" in fields:  # "->": a process waiting for the lock, not holding it
            continue
        at = fields.index(kind) + 4
        parts = fields[at].split(":") if at < len(fields) else []
        try:
            if len(parts) == 3 and (int(parts[0], 16), int(parts[1], 16), int(parts[2])) == (
                os.major(dev),
                os.minor(dev),
                ino,
            ):
                return True
        except ValueError:
            continue
    return False


def _holder(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}
