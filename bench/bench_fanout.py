"""Sharding fanned out over Celery workers: the same corpus sharded by the data DAG (`llm_data`: shard_prepare →
shard_partition.expand → shard_layout → shard_write.expand → shard) with 1 worker, then with 2, in one run on one
real cluster (tests/helpers/celery_cluster.py: PostgreSQL, Redis, Airflow on the CeleryExecutor, solo-pool workers).

- data.fanout_tokens_per_s_1_worker / _2_workers: tokens in the published shard set (manifest: train + val) over the
  DAG run's wall time (its start to its end, as Airflow records them: tokenizer training and the reduce included).
- data.fanout_speedup_2_workers: the ratio; expected ≈ the cores the workers get (2 on the CI host, less while the
  host is shared). Each worker runs one task at a time with one tokenizer thread (data.tokenize_processes: 1), so
  one worker is one core's worth of sharding: the ratio is the fan-out's, not the tokenizer's threads'.
- data.fanout_reduce_share_{1,2}_workers: the reduce steps' run time (shard_layout: every partition checked, global
  de-duplication, the shard plan; shard: every output checked, the manifest, the publish) over the run's wall time.
- data.fanout_host_load_1m: the host's 1-minute load average, the highest seen before and after the runs.

Load: a cluster of ~9 processes (~3 GB) and both cores for a few minutes; run it with
`python bench/run_all.py fanout`, not beside other heavy work.
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
PARTITIONS = 8
CONF = {"data_inputs": ["stdlib"], "max_documents": 3000, "partitions": PARTITIONS}  # the demo corpus
PRESET = {"data": {"tokenize_processes": 1}}  # over demo-cpu: one tokenizer thread per worker


def _cluster_module():
    spec = importlib.util.spec_from_file_location("celery_cluster", REPO / "tests" / "helpers" / "celery_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _seconds(ti: dict, key: str) -> float:
    return datetime.fromisoformat(ti[key]).timestamp()


def _load_1m() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def timings(tis: list[dict], run: dict) -> dict:
    """The run's wall time, its partitions (the mapped shard_partition tasks: how many, which workers ran them)
    and its reduce time (shard_layout + shard, each task's last try)."""
    parts = [t for t in tis if t["task_id"] == "shard_partition" and t["map_index"] >= 0]
    if not parts:
        raise RuntimeError(f"{DAG_ID} ran no mapped shard_partition task (a cache hit, or no fan-out)")
    reduce = [t for t in tis if t["task_id"] in ("shard_layout", "shard")]
    if len(reduce) != 2 or any(t["state"] != "success" for t in reduce):
        raise RuntimeError(
            f"{DAG_ID}: the reduce steps did not both succeed: {[(t['task_id'], t['state']) for t in reduce]}"
        )
    return {
        "wall_s": _seconds(run, "end_date") - _seconds(run, "start_date"),
        "reduce_s": sum(_seconds(t, "end_date") - _seconds(t, "start_date") for t in reduce),
        "partitions": len(parts),
        "workers": sorted({t["hostname"] for t in parts}),
    }


def shard_tokens(var: Path) -> int:
    # the published set: its manifest beside its shards (not a half-built .tmp- set, not the copy MLflow keeps as an
    # artifact of the shard run)
    manifests = [
        p
        for p in var.rglob("manifest.json")
        if not any(part.startswith(".tmp-") for part in p.parts) and any(p.parent.glob("train-*.tar"))
    ]
    if len(manifests) != 1:
        raise RuntimeError(f"expected one published shard set under {var}, found {[str(p) for p in manifests]}")
    splits = json.loads(manifests[0].read_text())["splits"]
    return sum(s["tokens"] for s in splits.values())


def run() -> dict:
    import yaml

    cc = _cluster_module()
    root = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    preset = yaml.safe_load((REPO / "configs" / "demo-cpu.yaml").read_text())
    for section, values in PRESET.items():
        preset[section].update(values)
    (root / "preset.yaml").write_text(yaml.safe_dump(preset))
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "LLM_PIPELINE_PRESET": str(root / "preset.yaml")}
    cluster = cc.Cluster(root / "cluster", dags=[DAG_FILE], extra_env=env)
    out, load = {}, _load_1m()
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
            if t["partitions"] != PARTITIONS or t["workers"] != [f"w{i + 1}" for i in range(n)]:
                raise RuntimeError(f"{t['partitions']} partitions ran on {t['workers']}: not a {n}-worker figure")
            suffix = "worker" if n == 1 else "workers"
            out[f"data.fanout_tokens_per_s_{n}_{suffix}"] = shard_tokens(cluster.var) / t["wall_s"]
            out[f"data.fanout_reduce_share_{n}_{suffix}"] = t["reduce_s"] / t["wall_s"]
        out["data.fanout_speedup_2_workers"] = (
            out["data.fanout_tokens_per_s_2_workers"] / out["data.fanout_tokens_per_s_1_worker"]
        )
        out["data.fanout_host_load_1m"] = max(load, _load_1m())
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
