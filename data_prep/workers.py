"""Helpers for the tokenizer and shard-writer worker processes (kept import-light: spawned workers import it)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import types

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Linux: a SIGKILLed builder takes its workers with it. Otherwise they would linger, holding the output
    directory's lock (inherited with the fd) so that the rerun that should clean up waits forever."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


@contextlib.contextmanager
def spawn_without_main():
    """Spawned children re-import the parent's __main__. Inside an Airflow task that is the `airflow` CLI, which
    cannot start there (the task's DB access is blocked), and the pool respawns its dead workers forever; a bare
    __main__ while workers start (they start on demand, so for the pool's whole life) makes them import nothing."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main
