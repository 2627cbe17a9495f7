"""Sharding fanned out over Celery workers: the same corpus sharded by the data DAG's mapped partitions with 1 worker,
then with 2, in one run on one real cluster (tests/celery_cluster.py: PostgreSQL, Redis, Airflow on the
CeleryExecutor, solo-pool workers).

- data.fanout_tokens_per_s_1_worker / _2_workers: tokens in the published shard set (manifest: train + val) over the
  DAG run's wall time (its start to its end, as Airflow records them).
- data.fanout_speedup_2_workers: the ratio; expected ≈ the cores the workers get (2 on the CI host, less while the
  host is shared).
- data.fanout_reduce_share_{1,2}_workers: the reduce task's run time (the task after the mapped partitions that
  checks them and writes the manifest) over the DAG run's wall time.

Needs the data DAG with dynamic task mapping (issue 29 item 3, engineer `data`): before it, the DAG has no mapped
task and this bench fails with that cause. Load: a cluster of ~9 processes (~3 GB) and both cores for a few
minutes; run it with `python bench/run_all.py fanout`, not beside other heavy work.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DAG_ID = "llm_data"
DAG_FILE = REPO / "dags" / "llm_data.py"
CONF = {"data_inputs": ["stdlib"], "max_documents": 3000}  # the demo corpus: Python's standard library


def _cluster_module():
    spec = importlib.util.spec_from_file_location("celery_cluster", REPO / "tests" / "celery_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _seconds(ti: dict, key: str) -> float:
    return datetime.fromisoformat(ti[key]).timestamp()


def timings(tis: list[dict], run: dict) -> dict:
    """Wall time of the run, the mapped partitions' and the reduce's: the reduce is the task that starts after
    the last partition ended (the one that checks them all and writes the manifest)."""
    mapped = [t for t in tis if t["map_index"] >= 0]
    if not mapped:
        raise RuntimeError(f"{DAG_ID} ran no mapped task: its shard fan-out (issue 29 item 3) is not there")
    last_partition = max(_seconds(t, "end_date") for t in mapped)
    after = [t for t in tis if t["map_index"] < 0 and t["start_date"] and _seconds(t, "start_date") >= last_partition]
    if not after:
        raise RuntimeError(f"{DAG_ID}: no task after the mapped partitions (the reduce)")
    reduce = min(after, key=lambda t: _seconds(t, "start_date"))
    wall = _seconds(run, "end_date") - _seconds(run, "start_date")
    return {
        "wall_s": wall,
        "reduce_s": _seconds(reduce, "end_date") - _seconds(reduce, "start_date"),
        "partitions": len(mapped),
        "workers": sorted({t["hostname"] for t in mapped}),
    }


def shard_tokens(var: Path) -> int:
    manifests = list(var.rglob("manifest.json"))
    if len(manifests) != 1:
        raise RuntimeError(f"expected one published shard set under {var}, found {len(manifests)}")
    splits = json.loads(manifests[0].read_text())["splits"]
    return sum(s["tokens"] for s in splits.values())


def run() -> dict:
    if ".expand(" not in DAG_FILE.read_text():
        raise RuntimeError(f"{DAG_FILE.name} maps no task (.expand): the shard fan-out (issue 29 item 3) is not there")
    cc = _cluster_module()
    root = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    cluster = cc.Cluster(root, dags=[DAG_FILE], extra_env={"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"})
    out = {}
    try:
        cluster.start(workers={"w1": "default"}, mlflow=False)
        for n in (1, 2):
            if n == 2:
                cluster.start_worker("w2")
            shutil.rmtree(cluster.var, ignore_errors=True)  # the same corpus again: no cache hit
            t0 = time.monotonic()
            run_id = cluster.trigger(DAG_ID, CONF)
            state = cluster.wait_run(DAG_ID, run_id, 3600)
            if state != "success":
                raise RuntimeError(f"{DAG_ID} with {n} worker(s) ended {state} (logs under {root})")
            print(f"  {n} worker(s): {time.monotonic() - t0:.0f} s")
            run = cluster.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")
            t = timings(cluster.task_instances(DAG_ID, run_id), run)
            if n == 2 and t["workers"] != ["w1", "w2"]:
                raise RuntimeError(f"the partitions ran on {t['workers']} only: not a 2-worker figure")
            out[f"data.fanout_tokens_per_s_{n}_worker{'s' if n > 1 else ''}"] = shard_tokens(cluster.var) / t["wall_s"]
            out[f"data.fanout_reduce_share_{n}_worker{'s' if n > 1 else ''}"] = t["reduce_s"] / t["wall_s"]
        out["data.fanout_speedup_2_workers"] = (
            out["data.fanout_tokens_per_s_2_workers"] / out["data.fanout_tokens_per_s_1_worker"]
        )
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
