"""Exec a command with SIGINT at its default disposition.

A job started with `&` from a non-interactive shell inherits SIGINT *ignored*, and Python then never installs its
KeyboardInterrupt handler, so `airflow standalone` could not be stopped cleanly (SIGTERM orphans its components).
Restoring the default before exec lets `kill -INT` reach standalone's own shutdown path.
Usage: python scripts/sigint-exec.py airflow standalone
"""

import os
import signal
import sys

if len(sys.argv) < 2:
    sys.exit("usage: sigint-exec.py COMMAND [ARGS...]")
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])
