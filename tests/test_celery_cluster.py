"""The scale-out profile, all real on this host (tests/celery_cluster.py): PostgreSQL + Redis (Debian packages),
Airflow's api-server, scheduler and dag-processor on the CeleryExecutor, two Celery workers, and an MLflow server
on PostgreSQL serving the artifacts. One cluster is shared by the module's tests; they run in file order:

1. llm_data, 4 partitions: the mapped tasks spread over both workers.
2. llm_pipeline on a shortened ci-tiny preset: it adopts that shard set (a cache hit); the device stages run on w2,
   the only worker of the preset's device queue; MLflow's runs and registry live in PostgreSQL.
3. llm_data on another shard set, 5 partitions: partition 4 stops itself mid-partition (DATA_PREP_FAULT
   "partition:4:stop") and the test SIGKILLs its whole worker; while it is stopped, partition 1's finished output is
   altered. The partition is retried on the other worker; the layout names partition 1 and nothing is published.
   The rerun redoes it and publishes the set `python -m data_prep shard` builds in one process: every sample once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml

from data_prep.job import FAULT_ENV
from data_prep.manifest import load_manifest
from tasks.launch.placement import DEVICE_STAGES
from tasks.config import load_config
from tasks.runner import safe_name
from tasks.stages import STAGES
from tasks.stages.shard import shard_multiple

REPO = Path(__file__).resolve().parent.parent
from tests.helpers.celery_cluster import Cluster, free_port  # noqa: E402
from tests.helpers.shards import keys_from_manifest  # noqa: E402
from tests.helpers.presets import SHORT, short_ci_tiny  # noqa: E402

DEVICE_QUEUE = "npu-node-1"
FAULT = "partition:4:stop"  # in every worker: the first try of a build's partition 4 stops itself mid-partition
DATA_CONF = {"partitions": 4}  # the preset's corpus; no partition 4 (the fault never fires)
KILL_CONF = {"partitions": 5, "max_documents": 120}  # another shard set, whose last partition stops


def check_services(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_services.py")],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_unreachable_broker_and_db_are_named_in_one_line_each():
    """No server needed: nothing listens on these ports. Which service, where (no password), the setting."""
    db, broker = free_port(), free_port()
    out = check_services(
        {
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql+psycopg2://airflow:s3cret@127.0.0.1:{db}/airflow",
            "AIRFLOW__CELERY__BROKER_URL": f"redis://:s3cret@127.0.0.1:{broker}/0",
            "AIRFLOW__CELERY__RESULT_BACKEND": f"db+postgresql+psycopg2://airflow:s3cret@127.0.0.1:{db}/airflow",
        }
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 3, out.stderr
    assert lines[0].startswith(f"metadata DB unreachable at postgresql+psycopg2://airflow@127.0.0.1:{db}/airflow: ")
    assert lines[1].startswith(f"Celery broker unreachable at redis://127.0.0.1:{broker}/0: ")
    assert lines[2].startswith("Celery result backend unreachable at db+postgresql+psycopg2://airflow@127.0.0.1:")
    assert "Connection refused" in lines[0] and "AIRFLOW__CELERY__BROKER_URL" in lines[1]
    assert "s3cret" not in out.stderr
    # a Redis result backend is asked as a Redis server, not as a SQLAlchemy URL ("Can't load plugin … redis")
    out = check_services(
        {
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql+psycopg2://airflow:s3cret@127.0.0.1:{db}/airflow",
            "AIRFLOW__CELERY__BROKER_URL": f"redis://:s3cret@127.0.0.1:{broker}/0",
            "AIRFLOW__CELERY__RESULT_BACKEND": f"redis://:s3cret@127.0.0.1:{broker}/1",
        }
    )
    last = out.stderr.strip().splitlines()[2]
    assert last.startswith(f"Celery result backend unreachable at redis://127.0.0.1:{broker}/1: "), out.stderr
    assert "Connection refused" in last and "plugin" not in last


def test_no_piece_of_a_password_with_url_characters_is_printed():
    """A password holding '@', ':' or '/' typed into the URLs as is: the metadata DB's line was SQLAlchemy's
    `invalid literal for int() with base 10: 'w0rd@127.0.0.1:5999'` with "start it", and the broker's where showed
    `redis://tPW@127.0.0.1` (SQLAlchemy's parse of a Redis URL). Now nothing of a password is printed; a URL its
    parser cannot read is named as such, with the fix; one it reads as meant (kombu and redis-py take the host after
    the last '@') is checked as usual."""
    db, broker = free_port(), free_port()
    out = check_services(  # the user's own settings (docs/scale-out.md walked with such passwords)
        {
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql+psycopg2://airflow:p@ss:w0rd@127.0.0.1:{db}/airflow",
            "AIRFLOW__CELERY__BROKER_URL": f"redis://:s3cr@tPW@127.0.0.1:{broker}/0",
            "AIRFLOW__CELERY__RESULT_BACKEND": "",  # the default: db+ the metadata DB's URL
        }
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 3, out.stderr
    for piece in ("w0rd", "ss:", "s3cr", "tPW"):
        assert piece not in out.stderr, (piece, out.stderr)
    fix = "must be percent-encoded (urllib.parse.quote(password, safe=''))"
    assert lines[0] == (
        f"metadata DB at postgresql+psycopg2://airflow@127.0.0.1:{db}/airflow cannot be used: its user name or "
        f"password cannot be told apart from the host: an '@', ':', '/', '?', '#' or ';' in it {fix}, or choose one "
        "of letters, digits and -._~ (in AIRFLOW__DATABASE__SQL_ALCHEMY_CONN)"
    )
    assert lines[1].startswith(f"Celery broker unreachable at redis://127.0.0.1:{broker}/0: Error 111 "), lines[1]
    assert lines[2].startswith(f"Celery result backend at db+postgresql+psycopg2://airflow@127.0.0.1:{db}/airflow ")
    assert fix in lines[2] and "start it" not in lines[0] + lines[2]
    # distinct pieces, each URL's parser misled in its own way: SQLAlchemy reads the host `Zm9` ('@'), kombu and
    # redis-py end the host at the '/' (`Port could not be cast to integer value as 'Gf6w'`)
    db_pw, redis_pw = "Kx7q@Zm9:Rt4/Wb2", "Gf6w/Yt2"
    env = {
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql+psycopg2://airflow:{db_pw}@127.0.0.1:{db}/airflow",
        "AIRFLOW__CELERY__BROKER_URL": f"redis://:{redis_pw}@127.0.0.1:{broker}/0",
        "AIRFLOW__CELERY__RESULT_BACKEND": f"redis://:{redis_pw}@127.0.0.1:{broker}/1",
    }
    out = check_services(env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 3, out.stderr
    for piece in ("Kx7q", "Zm9", "Rt4", "Wb2", "Gf6w", "Yt2"):
        assert piece not in out.stderr, (piece, out.stderr)
    assert all(fix in line and "start it" not in line for line in lines), out.stderr
    assert lines[1].startswith(f"Celery broker at redis://127.0.0.1:{broker}/0 cannot be used: "), lines[1]
    # percent-encoded as the line says: the URLs are read, the services are down, and no form of a password shows
    encoded = {
        k: v.replace(db_pw, quote(db_pw, safe="")).replace(redis_pw, quote(redis_pw, safe="")) for k, v in env.items()
    }
    out = check_services(encoded)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 3, out.stderr
    assert lines[0].startswith(f"metadata DB unreachable at postgresql+psycopg2://airflow@127.0.0.1:{db}/airflow: ")
    assert all("start it" in line for line in lines), out.stderr
    for piece in ("Kx7q", "Zm9", "Rt4", "Wb2", "Gf6w", "Yt2"):
        assert piece not in out.stderr, (piece, out.stderr)


def test_device_stages_go_to_the_presets_device_queue(tmp_path):
    """The DAG file parsed with a site's preset file ($LLM_PIPELINE_PRESET, a path outside configs/) that names a
    device queue: the device stages carry it, the rest stay on Airflow's default queue; without it, none moves."""
    preset = yaml.safe_load((REPO / "configs" / "ci-tiny.yaml").read_text())
    preset["hardware"]["device_queue"] = DEVICE_QUEUE
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(preset))
    # Both parses in one process (Airflow imported once: ~3 s of CPU saved): the DAG file is executed afresh by each
    # DagBag and reads $LLM_PIPELINE_PRESET when parsed (load_config reads it on every call), as the dag-processor's
    # parse children do after its pre-imports; a preset remembered from the first parse would fail the second's check.
    code = (
        "import json, os, sys; from airflow.dag_processing.dagbag import DagBag\n"
        "for preset in sys.argv[1:]:\n"
        "    os.environ['LLM_PIPELINE_PRESET'] = preset\n"
        f"    bag = DagBag(dag_folder={str(REPO / 'dags' / 'llm_pipeline.py')!r})\n"
        "    assert not bag.import_errors, bag.import_errors\n"
        "    print('queues', json.dumps({t.task_id: t.queue for t in bag.dags['llm_pipeline'].tasks}))"
    )
    argv = [sys.executable, "-c", code, str(tmp_path / "site.yaml"), "ci-tiny"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    routed, default = (json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("queues {"))
    assert {k for k, q in routed.items() if q == DEVICE_QUEUE} == set(DEVICE_STAGES)
    assert {q for k, q in routed.items() if k not in DEVICE_STAGES} == {"default"}
    assert set(default.values()) == {"default"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("redis-server") is None or not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.fail("PostgreSQL/Redis not installed: run scripts/install-services.sh (make test does)")
    root = tmp_path_factory.mktemp("celery")
    # this module checks where tasks run, not what they compute: ci-tiny shortened (tests/helpers/presets.py)
    short_ci_tiny(root / "ci-tiny-celery.yaml", hardware={**SHORT["hardware"], "device_queue": DEVICE_QUEUE})
    c = Cluster(
        root / "cluster",
        dags=[REPO / "dags" / "llm_pipeline.py", REPO / "dags" / "llm_data.py"],
        extra_env={"LLM_PIPELINE_PRESET": str(root / "ci-tiny-celery.yaml"), FAULT_ENV: FAULT},
    )
    c.preset = root / "ci-tiny-celery.yaml"
    try:
        c.start(workers={"w1": "default", "w2": f"default,{DEVICE_QUEUE}"})
        yield c
    finally:
        c.stop()


def data_dir(cluster) -> Path:
    return cluster.var / "data"  # data.out_dir: var/data, under the cluster's LLM_PIPELINE_VAR_DIR


def published(cluster) -> list[str]:
    return sorted(p.parent.name for p in data_dir(cluster).glob("shards-*/manifest.json"))


def run_record(cluster, dag_id: str, run_id: str, stage: str = "shard") -> dict:
    return json.loads((cluster.var / "runs" / dag_id / safe_name(run_id) / f"{stage}.json").read_text())


def by_task(tis: list[dict]) -> dict[tuple[str, int], dict]:
    return {(t["task_id"], t["map_index"]): t for t in tis}


@pytest.mark.slow
def test_a_down_broker_is_named_while_the_db_is_up(cluster):
    out = check_services({**cluster.env, "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"})
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("Celery broker unreachable at redis://127.0.0.1:")
    assert check_services(cluster.env).returncode == 0  # the cluster's own settings: all reachable


@pytest.fixture(scope="module")
def data_run(cluster):
    run = cluster.trigger("llm_data", DATA_CONF)
    return run, cluster.wait_run("llm_data", run, 900)


@pytest.mark.slow
def test_data_dag_partitions_spread_over_both_workers(cluster, data_run):
    run, state = data_run
    tis = cluster.task_instances("llm_data", run)
    assert state == "success", sorted((t["task_id"], t["map_index"], t["state"]) for t in tis)
    parts = sorted((t["map_index"], t["hostname"]) for t in tis if t["task_id"] == "shard_partition")
    assert [i for i, _ in parts] == list(range(DATA_CONF["partitions"])), parts
    assert {w for _, w in parts} == {"w1", "w2"}, parts  # both workers tokenized some partitions
    result = run_record(cluster, "llm_data", run)
    assert result["partitions"] == DATA_CONF["partitions"] and not result["cache_hit"]
    assert published(cluster) == [Path(result["shard_dir"]).name]
    # bench/bench_fanout.py's reading of a fanned-out run
    spec = importlib.util.spec_from_file_location("bench_fanout", REPO / "bench" / "bench_fanout.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    t = bench.timings(tis, cluster.get(f"/api/v2/dags/llm_data/dagRuns/{run}"))
    assert t["partitions"] == DATA_CONF["partitions"] and t["workers"] == ["w1", "w2"]
    assert 0 < t["reduce_s"] < t["wall_s"]


@pytest.fixture(scope="module")
def pipeline_run(cluster, data_run):
    # the preset: $LLM_PIPELINE_PRESET (shortened ci-tiny + the device queue); the data DAG's set is adopted
    run = cluster.trigger("llm_pipeline", DATA_CONF)
    return run, cluster.wait_run("llm_pipeline", run, 1500)


@pytest.mark.slow
def test_ci_tiny_pipeline_on_celery_with_device_stages_on_the_device_queue(cluster, pipeline_run):
    run, state = pipeline_run
    tis = cluster.task_instances("llm_pipeline", run)
    states = {(t["task_id"], t["map_index"]): t["state"] for t in tis}
    assert state == "success", states
    tis = {t["task_id"]: t for t in tis if t["map_index"] < 0}
    assert {*STAGES, "summary", "pipeline_ok"} <= {k for k, t in tis.items() if t["state"] == "success"}
    # the shard set llm_data published is found by its build key: the fan-out shards nothing
    assert run_record(cluster, "llm_pipeline", run)["cache_hit"] is True
    assert {s for (k, i), s in states.items() if k in ("shard_partition", "shard_write")} <= {"skipped"}
    for stage in DEVICE_STAGES:  # only w2 consumes the device queue
        assert (tis[stage]["queue"], tis[stage]["hostname"]) == (DEVICE_QUEUE, "w2"), stage
    for task_id in set(tis) - set(DEVICE_STAGES):
        assert tis[task_id]["queue"] == "default", task_id


@pytest.mark.slow
def test_mlflow_runs_and_registry_live_in_postgresql_with_served_artifacts(cluster, pipeline_run):
    import mlflow
    import psycopg2

    run, state = pipeline_run
    assert state == "success"
    client = mlflow.MlflowClient(cluster.mlflow_url)
    exp = client.get_experiment_by_name("llm-pipeline")
    assert exp.artifact_location.startswith("mlflow-artifacts:")  # through the server, not a worker's disk

    def parent_run():
        runs = client.search_runs([exp.experiment_id], f"tags.`airflow.run_id` = '{run}'")
        return next(p for p in runs if p.data.tags.get("pipeline.kind") == "parent")

    # The DAG's success callback ends the parent run; Airflow 3 runs DAG callbacks in the dag-processor, after the
    # run's state is already success: wait for it (bounded).
    deadline = time.monotonic() + 180
    while (parent := parent_run()).info.status == "RUNNING" and time.monotonic() < deadline:
        time.sleep(2)
    assert parent.info.status == "FINISHED" and parent.data.tags["pipeline.outcome"] == "success"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["pipeline.stage"] for c in children) == sorted(STAGES)
    ev = json.loads(next((cluster.var / "runs" / "llm_pipeline").glob("*/evaluate.json")).read_text())
    assert ev["passed"] and ev.get("version"), ev
    model = client.get_registered_model(ev["registered_model"])
    assert ev["aliases"] == {"candidate": ev["version"], "champion": ev["version"]}  # the first gated version
    assert {k: str(v) for k, v in model.aliases.items()} == ev["aliases"]
    assert client.get_model_version_by_alias(ev["registered_model"], "champion").status == "READY"

    conn = psycopg2.connect(cluster.mlflow_db_url.replace("postgresql+psycopg2", "postgresql"))
    with conn, conn.cursor() as cur:  # the backend store is PostgreSQL: the same rows, read with SQL
        cur.execute("SELECT count(*) FROM runs WHERE run_uuid = %s AND status = 'FINISHED'", (parent.info.run_id,))
        assert cur.fetchone()[0] == 1
        cur.execute("SELECT alias, version FROM registered_model_aliases WHERE name = %s", (ev["registered_model"],))
        assert sorted(cur.fetchall()) == [("candidate", int(ev["version"])), ("champion", int(ev["version"]))]
    conn.close()
    served = [p for p in cluster.artifacts.rglob("*") if p.is_file()]
    assert any(p.name == "config.json" for p in served), served[:10]  # the parent's config, stored by the server
    assert not (cluster.var / "mlartifacts").exists()


def shard_cli(cluster, out: Path, conf: dict, shard_multiple: int) -> subprocess.Popen:
    """`python -m data_prep shard` of the same corpus and settings, one partition, one process (no fault)."""
    cmd = [sys.executable, "-m", "data_prep", "shard", "--config", str(cluster.preset), "--out", str(out), "--set"]
    cmd += ["partitions=1", f"max_documents={conf['max_documents']}", f"shard_multiple={shard_multiple}", "--json"]
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    return subprocess.Popen(cmd, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def killed_run(cluster, tmp_path_factory):
    """Partition 4's first try stops itself mid-partition (its tokens half written, its lock held); while it is
    stopped every other partition finishes and partition 1's output is altered (one rename after its task, the
    layout cannot have run yet); then the stopped task's worker is SIGKILLed, as a lost host."""
    before = published(cluster)
    run = cluster.trigger("llm_data", KILL_CONF)
    deadline = time.monotonic() + 600
    while (victim := cluster.stopped_task()) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert victim, by_task(cluster.task_instances("llm_data", run))
    (job,) = [p.parent for p in data_dir(cluster).glob(".tmp-*/job.json")]
    assert list((job / "parts" / "0004.partial").glob("*.tokens"))  # killed mid-partition: half its tokens
    done = [job / "parts" / f"{i:04d}" / "done.json" for i in range(4)]
    while not all(p.is_file() for p in done) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(p.is_file() for p in done), by_task(cluster.task_instances("llm_data", run))
    with open(job / "parts" / "0001" / "train.tokens", "ab") as f:  # one more token than its record says
        f.write(b"\0\0")
    cluster.kill_worker(victim)
    survivor = cluster.workers[0]
    # the one-process reference meanwhile (the scheduler waits out the lost worker's heartbeat)
    reference = shard_cli(
        cluster, tmp_path_factory.mktemp("one"), KILL_CONF, shard_multiple(load_config(str(cluster.preset)))
    )
    state = cluster.wait_run("llm_data", run, 900)
    return dict(run=run, state=state, victim=victim, survivor=survivor, before=before, reference=reference)


@pytest.mark.slow
def test_a_killed_workers_partition_is_retried_elsewhere_and_a_bad_partition_is_named(cluster, killed_run):
    run, victim, survivor = killed_run["run"], killed_run["victim"], killed_run["survivor"]
    tis = by_task(cluster.task_instances("llm_data", run))
    assert killed_run["state"] == "failed", {k: t["state"] for k, t in tis.items()}
    tries = {t["try_number"]: t for t in cluster.tries("llm_data", run, "shard_partition", 4)}
    assert (tries[1]["hostname"], tries[1]["state"]) == (victim, "failed")  # its heartbeat stopped with its worker
    assert (tries[2]["hostname"], tries[2]["state"]) == (survivor, "success")
    assert tis[("shard_layout", -1)]["state"] == "failed" and tis[("shard", -1)]["state"] == "upstream_failed"
    record = run_record(cluster, "llm_data", run)
    assert record["status"] == "failed"
    assert record["error"].startswith("shard: partition 1 failed verification: train.tokens is "), record
    log = "".join(p.read_text() for p in (cluster.root / "logs").rglob("*.log") if "task_id=shard_layout" in str(p))
    assert "partition 1 failed verification" in log
    assert published(cluster) == killed_run["before"]  # nothing published


@pytest.mark.slow
def test_the_rerun_publishes_every_sample_exactly_once(cluster, killed_run):
    """The rerun redoes partition 1 (removed by the layout), keeps the rest, partition 4's retry included, and
    publishes the set one process builds from the same corpus: the same manifest digest, every sample once."""
    run = cluster.trigger("llm_data", KILL_CONF)
    state = cluster.wait_run("llm_data", run, 900)
    assert state == "success", by_task(cluster.task_instances("llm_data", run))
    result = run_record(cluster, "llm_data", run)
    out, _ = killed_run["reference"].communicate(timeout=600)
    assert killed_run["reference"].returncode == 0
    assert json.loads(out)["manifest_digest"] == result["manifest_digest"]
    keys = keys_from_manifest(Path(result["shard_dir"]))
    assert all(len(k) == len(set(k)) for k in keys.values())
    assert sum(map(len, keys.values())) == sum(
        s["samples"] for s in load_manifest(result["shard_dir"])["splits"].values()
    )
