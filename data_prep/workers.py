"""Helpers for the tokenizer and shard-writer worker processes (kept import-light: spawned workers import it)."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Linux: a SIGKILLed builder takes its workers with it. Otherwise they would linger, holding the output
    directory's lock (inherited with the fd) so that the rerun that should clean up waits forever."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
