"""A stage process's exit, against the same process's plain exit in the same run: a fresh interpreter loads what an
`airflow dags test` holds when its stages have run (Airflow's in-process execution API, built and answering once;
torch; MLflow) and exits — plainly, or after tasks.procs.skip_exit_collection() (what run_stage registers: the
interpreter's full collections at shutdown skip every object already there). Each variant's median user + sys CPU
over RUNS processes; the ratio is with the skip over without (< 1: cheaper)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.child_cpu import interleaved_medians

ROOT = Path(__file__).resolve().parent.parent
RUNS = 3
CHILD = """
import sys
from airflow.api_fastapi.execution_api.app import InProcessExecutionAPI
from fastapi.testclient import TestClient
import mlflow, torch
api = InProcessExecutionAPI()
assert TestClient(api.app).get("/health").status_code == 200  # the app built (its versioned routers)
if sys.argv[1] == "skip":
    from tasks.procs import skip_exit_collection
    skip_exit_collection()
"""


def run() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = interleaved_medians({v: ([sys.executable, "-c", CHILD, v], env) for v in ("plain", "skip")}, RUNS)
    p, s = got["plain"], got["skip"]
    return {
        "exit.stage_process_cpu_s_plain": round(p, 2),
        "exit.stage_process_cpu_s_skip_collection": round(s, 2),
        "exit.stage_process_cpu_ratio_skip_vs_plain": round(s / p, 3),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
