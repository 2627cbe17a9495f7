"""The cyclic garbage collector's full pass in the processes that run our work, against the same pass after
tasks.procs.freeze_long_lived() (what run_stage does at a stage's start and a training rank after its process group
and between specs), in the same process: a fresh interpreter loads what the process holds by then — a rank: torch,
FSDP2, DTensor, dynamo and DCP; a stage process: Airflow's in-process execution API built and answering, torch,
MLflow — then times gc.collect() (the median of RUNS) before and after the freeze. A full pass is what Python runs
each time the objects it tracks grow by a quarter (13 of them in one MoE `airflow dags test`, up to 26 in a rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = 5
LOADS = {
    "rank": (
        "import torch, torch._dynamo\n"
        "import torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.tensor"
    ),
    "stage_process": (
        "from airflow.api_fastapi.execution_api.app import InProcessExecutionAPI\n"
        "from fastapi.testclient import TestClient\n"
        "import mlflow, torch\n"
        "assert TestClient(InProcessExecutionAPI().app).get('/health').status_code == 200"
    ),
}
CHILD = """
import gc, json, statistics, time
{load}
from tasks.procs import freeze_long_lived

def full_pass_ms():
    times = []
    for _ in range({runs}):
        t = time.process_time(); gc.collect(); times.append((time.process_time() - t) * 1000)
    return statistics.median(times)

before, tracked = full_pass_ms(), len(gc.get_objects())
freeze_long_lived()
print(json.dumps({{"plain_ms": before, "frozen_ms": full_pass_ms(), "tracked": tracked}}))
"""


def run() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = {}
    for kind, load in LOADS.items():
        code = CHILD.format(load=load, runs=RUNS)
        res = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True, text=True
        )
        got = json.loads(res.stdout.strip().splitlines()[-1])
        out[f"gc.{kind}_full_pass_ms"] = round(got["plain_ms"], 1)
        out[f"gc.{kind}_full_pass_ms_frozen"] = round(got["frozen_ms"], 4)
        out[f"gc.{kind}_full_pass_ratio_frozen_vs_plain"] = round(got["frozen_ms"] / got["plain_ms"], 6)
        out[f"gc.{kind}_tracked_objects"] = got["tracked"]
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
