"""Helpers shared by the test modules (a test module never imports another: tests/test_layout.py checks it).

Scripts the tests start as subprocesses (tests/loader_dist_check.py, tests/profiling_gloo_worker.py) stay beside
the tests: they are run by path, not imported."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
