"""The cyclic garbage collector's full pass in the processes that run our work, against the same pass after
tasks.procs.freeze_long_lived() (what run_stage does at a stage's start and a training rank after its process group
and between specs), in the same process: a fresh interpreter loads what the process holds by then — a rank: torch,
FSDP2, DTensor, dynamo and DCP; a stage process: Airflow's in-process execution API built and answering, torch,
MLflow — then times gc.collect() (the median of RUNS) before and after the freeze. A full pass is what Python runs
each time the objects it tracks grow by a quarter (13 of them in one MoE `airflow dags test`, up to 26 in a rank).

Then the collector's settings, each process's CPU from its start to its exit with CPython's defaults and with this
deployment's (median of RUNS each, interleaved): an Airflow process (imports Airflow, builds the in-process
execution API as `airflow dags test` does, parses dags/) without and with plugins/airflow_local_settings.py (full
passes 10x rarer, none at exit); torchrun's forking agent's preload (the ranks' imports, then the collect-and-freeze)
with full passes and without (tasks.launch.agent.preload)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.child_cpu import interleaved_medians

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


AIRFLOW_PROCESS = """
import airflow.settings
from airflow.api_fastapi.execution_api.app import InProcessExecutionAPI
from airflow.dag_processing.dagbag import DagBag
InProcessExecutionAPI().app
assert len(DagBag(dag_folder="dags").dags) >= 3
"""
PRELOAD = {
    "default": """
import importlib
import tasks.launch.agent as agent
from tasks.procs import freeze_long_lived
for name in agent.BASE + agent.LAZY:
    importlib.import_module(name)
agent.resident_file_pages()
freeze_long_lived()
""",
    "paused": "import tasks.launch.agent as agent; agent.preload()",
}


def collector_settings(env: dict) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "plugins"  # the deployment's plugins folder without the collector's hook
        shutil.copytree(
            ROOT / "plugins", plain, ignore=shutil.ignore_patterns("airflow_local_settings.py", "__pycache__")
        )
        af = {**env, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{Path(tmp) / 'airflow.db'}"}
        argv = [sys.executable, "-c", AIRFLOW_PROCESS]
        got = interleaved_medians(
            {
                "default": (argv, {**af, "AIRFLOW__CORE__PLUGINS_FOLDER": str(plain)}),
                "deployment": (argv, {**af, "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins")}),
            },
            RUNS,
        )
    out["gc.airflow_process_cpu_s_default"] = round(got["default"], 3)
    out["gc.airflow_process_cpu_s_deployment"] = round(got["deployment"], 3)
    out["gc.airflow_process_cpu_ratio_deployment_vs_default"] = round(got["deployment"] / got["default"], 3)
    got = interleaved_medians({name: ([sys.executable, "-c", code], env) for name, code in PRELOAD.items()}, RUNS)
    out["gc.agent_preload_cpu_s_default"] = round(got["default"], 3)
    out["gc.agent_preload_cpu_s_paused"] = round(got["paused"], 3)
    out["gc.agent_preload_cpu_ratio_paused_vs_default"] = round(got["paused"] / got["default"], 3)
    return out


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
    return out | collector_settings(env)


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
