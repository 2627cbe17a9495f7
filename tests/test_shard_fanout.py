"""The partitioned build (data_prep.job's steps): the same bytes for any partitioning, any step order and any number
of workers; a step killed mid-way is redone exactly once; the reduce names a bad output and publishes nothing; the
data DAG fans out through real Airflow (LocalExecutor, a worker SIGKILLed mid-partition and retried)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from data_prep.build import build_shard_set, publish
from data_prep.errors import DataPrepError
from data_prep.job import FAULT_ENV, plan_partitions, prepare
from data_prep.layout import ended_line, run_layout
from data_prep.manifest import digest
from data_prep.partition import run_partition
from data_prep.writer import run_write
from tests.helpers.shards import CORPUS, keys_from_manifest, shard_cfg, tree_bytes
from tests.helpers.ports import free_port
from tests.helpers.mlflow_store import fresh_store

REPO = Path(__file__).resolve().parent.parent


SHUTDOWN = "Shutting down LocalExecutor"  # airflow/executors/local_executor.py LocalExecutor.end()'s first line
IDLE = "LocalExecutor: <idle>"  # a worker's process title while it waits on the activity queue (_run_worker)


def _dags_test_with_executor(cmd: str, env: dict, log: Path, timeout: float = 600, grace: float = 30):
    """`airflow dags test --use-executor` in its own process group, output to `log`: (exit code, output, the pids of
    idle workers ended). Airflow 3.3.2's LocalExecutor.end() walks its workers, putting one shutdown message on the
    activity queue for each that is alive, then joins each without a bound. An idle worker takes a message and exits at
    once, so when one worker is still busy (the execution API has marked its task done, its supervisor has not
    returned), a worker that took an earlier message can be gone before the walk reaches it: one message fewer than
    workers, and the busy one, once done, waits on an empty queue for ever (traced: 3 puts for 4 live workers, the third
    gone with the first message before its check; seen in two `make test` runs, and in 2 of 75 runs of this test beside
    a busy loop). A worker still idle `grace` seconds after end() began has no task to lose: it is ended (SIGTERM) so
    the run exits with its own status. Past `timeout` (inside pytest-timeout's 900) the whole group is killed and the
    test fails with the log's tail (no orphan left behind: the worker outlived the 900 s kill)."""
    import psutil

    with open(log, "w") as f:
        proc = subprocess.Popen(
            ["bash", "-c", cmd], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline, shutdown_seen, released = time.monotonic() + timeout, None, []
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"airflow dags test ran past {timeout} s: {log.read_text()[-4000:]}")
            if shutdown_seen is None and SHUTDOWN in log.read_text():
                shutdown_seen = time.monotonic()
            if shutdown_seen is not None and time.monotonic() - shutdown_seen > grace:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        if IDLE in " ".join(child.cmdline()):
                            child.terminate()
                            released.append(child.pid)
                    except psutil.NoSuchProcess:
                        pass
                shutdown_seen = time.monotonic()  # once per grace period
            time.sleep(1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, log.read_text(), released


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The fixture corpus plus a last file repeating the first one: a duplicate across partitions."""
    root = tmp_path_factory.mktemp("corpus")
    for p in CORPUS.iterdir():
        shutil.copy(p, root / p.name)
    shutil.copy(CORPUS / "alpha.txt", root / "zz-copy-of-alpha.txt")
    return root


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One partition, one process: the single-process build every other must equal."""
    return build_shard_set(shard_cfg(tmp_path_factory.mktemp("ref"), [corpus], partitions=1))


def test_partitions_are_contiguous_size_balanced_and_at_most_one_per_file():
    assert plan_partitions([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    assert plan_partitions([30, 1, 1, 1, 27], 2) == [(0, 1), (1, 5)]
    assert plan_partitions([5, 5], 9) == [(0, 1), (1, 2)]
    parts = plan_partitions([1] * 10, 3)
    assert [b - a for a, b in parts] == [4, 3, 3] and parts[0][0] == 0 and parts[-1][1] == 10
    assert plan_partitions([100] * 4, 0) == [(0, 4)]  # derived: one per 128 MB


def test_the_same_bytes_for_any_partitioning(reference, corpus, tmp_path):
    """1, 3 and 8 partitions (at most one per file), with the duplicate in another partition than its original:
    byte-identical shard sets, the same counters, the same version and manifest digest."""
    m = reference.manifest
    assert m["stats"]["duplicates"] == 2 and m["stats"]["documents_out"] == 17  # both copies of alpha dropped
    for n in (3, 8):
        r = build_shard_set(shard_cfg(tmp_path / f"p{n}", [corpus], partitions=n, tokenize_processes=2))
        assert r.partitions == min(n, len(list(corpus.iterdir()))) and not r.cache_hit
        assert r.shard_dir.name == reference.shard_dir.name and r.digest == reference.digest
        assert tree_bytes(r.shard_dir) == tree_bytes(reference.shard_dir)
    keys = keys_from_manifest(reference.shard_dir)
    assert all(len(k) == len(set(k)) for k in keys.values())


def test_max_documents_cuts_the_same_corpus_for_any_partitioning(corpus, tmp_path):
    """The cut after N kept documents lands inside a later partition; counters are a single reader's."""
    one = build_shard_set(shard_cfg(tmp_path / "one", [corpus], partitions=1, max_documents=9))
    many = build_shard_set(shard_cfg(tmp_path / "many", [corpus], partitions=8, max_documents=9))
    assert one.manifest["stats"]["documents_out"] == 9 and many.partitions == 8
    assert many.digest == one.digest and tree_bytes(many.shard_dir) == tree_bytes(one.shard_dir)
    # where the cut fell, recorded: the five one-document files, then records.jsonl's 4th record; tiny.txt and the
    # copy of alpha after it were not read (a cut used to leave no trace of how much of the corpus went unread)
    ended = {"max_documents": 9, "last_file": str(corpus / "records.jsonl"), "files_not_read": 2}
    assert one.manifest["source"]["ended"] == ended
    assert ended_line(ended) == (
        f"data.max_documents=9 ended the corpus at a document of {corpus / 'records.jsonl'}: what follows it there and "
        "the 2 input file(s) after it were not read"
    )
    whole = build_shard_set(shard_cfg(tmp_path / "whole", [corpus], partitions=1, max_documents=10**6))
    assert "ended" not in whole.manifest["source"]  # nothing cut: nothing said


def test_steps_in_any_order_in_fresh_processes_give_the_reference(reference, corpus, tmp_path):
    """The DAG's tasks may run in any order on any worker: each step reads only the build's directory."""
    cfg = shard_cfg(tmp_path, [corpus], partitions=4)
    job = prepare(cfg).job
    for i in reversed(range(len(job.partitions))):
        code = (
            "import sys; from data_prep.job import Job; from data_prep.partition import run_partition; "
            "print(run_partition(Job.load(sys.argv[1]), int(sys.argv[2]))['documents'])"
        )
        subprocess.run([sys.executable, "-c", code, str(job.dir), str(i)], cwd=REPO, check=True, capture_output=True)
    layout = run_layout(job)
    for i in reversed(range(len(layout["writes"]))):
        run_write(job, i)
    result = publish(job)
    assert result.digest == reference.digest and not job.dir.exists()
    assert build_shard_set(cfg).cache_hit  # found by its build key, nothing rebuilt


def shard_cli(corpus: Path, out: Path, fault: str = "", *sets: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "data_prep", "shard", "--input", str(corpus), "--out", str(out), "--set"]
    cmd += ["vocab_size=300", "seq_len=16", "val_fraction=0.2", "shard_size_mb=0.02", "shard_multiple=4"]
    cmd += ["progress=false", *sets]
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**env, FAULT_ENV: fault})


def test_a_partition_or_write_killed_midway_is_redone_exactly_once(reference, corpus, tmp_path):
    """SIGKILL inside partition 1 (its token file half written), then inside write range 0 (a shard half written):
    each rerun resumes, and the set equals the uninterrupted build — every sample exactly once."""
    out = tmp_path / "out"
    killed = shard_cli(corpus, out, "partition:1", "partitions=3")
    assert killed.returncode == -signal.SIGKILL
    assert list(out.glob(".tmp-*/parts/0000/done.json")) and list(out.glob(".tmp-*/parts/0001.partial/*.tokens"))
    killed = shard_cli(corpus, out, "write:0", "partitions=3")
    assert killed.returncode == -signal.SIGKILL and list(out.glob(".tmp-*/set/.train-000000.tar.partial"))
    assert not list(out.glob("shards-*"))  # nothing published yet
    done = shard_cli(corpus, out, "write:0", "partitions=3")  # its partial is there: a retry, not a first attempt
    assert done.returncode == 0, done.stderr
    shard_dir = out / reference.shard_dir.name
    assert digest(shard_dir) == reference.digest and not list(out.glob(".tmp-*"))
    keys, want = keys_from_manifest(shard_dir), keys_from_manifest(reference.shard_dir)
    for split in keys:
        assert len(keys[split]) == len(set(keys[split])) and sorted(keys[split]) == sorted(want[split])


def test_the_reduce_names_a_bad_output_and_publishes_nothing(reference, corpus, tmp_path):
    cfg = shard_cfg(tmp_path, [corpus], partitions=3)
    job = prepare(cfg).job
    run_partition(job, 0)
    with pytest.raises(DataPrepError, match=r"no layout yet"):
        run_write(job, 0)
    with pytest.raises(DataPrepError, match=r"^partition 1 \(.*\) is not complete: its task has not finished$"):
        run_layout(job)
    for i in (1, 2):
        run_partition(job, i)
    (job.part_dir(1) / "val.tokens").write_bytes(b"\0\0")  # altered after its task finished
    with pytest.raises(DataPrepError, match=r"^partition 1 failed verification: val.tokens is 2 bytes, its record"):
        run_layout(job)
    assert not job.part_dir(1).exists()  # never trusted again
    with pytest.raises(DataPrepError, match="the layout step has not run"):
        build_shard_set(cfg, reduce_only=True)  # the DAG's reduce does no missing work itself
    run_partition(job, 1)
    layout = run_layout(job)
    for i in range(len(layout["writes"])):
        run_write(job, i)
    victim = job.set_dir / "train-000001.tar"
    victim.write_bytes(victim.read_bytes()[:1024])
    with pytest.raises(
        DataPrepError, match=r"^write range 0 \(train 0\.\.\d+\) failed verification: train-000001.tar "
    ):
        build_shard_set(cfg, reduce_only=True)
    assert not list(Path(cfg.out_dir).glob("shards-*")) and not victim.exists()  # dropped: a rerun rewrites it
    assert build_shard_set(cfg).digest == reference.digest


def test_a_failing_reduce_with_verify_sha256_names_the_shard(corpus, tmp_path):
    cfg = shard_cfg(tmp_path, [corpus], verify_sha256=True)
    job = prepare(cfg).job
    run_partition(job, 0)
    for i in range(len(run_layout(job)["writes"])):
        run_write(job, i)
    victim = job.set_dir / "val-000000.tar"
    data = bytearray(victim.read_bytes())
    data[700] ^= 0x01  # a payload byte: the size is right
    victim.write_bytes(bytes(data))
    with pytest.raises(DataPrepError, match=r"val-000000.tar has another sha256 than its record; dropped"):
        build_shard_set(cfg, reduce_only=True)


# ---- through real Airflow: LocalExecutor, the execution API, a worker killed mid-partition ------------------------


@pytest.mark.slow
def test_data_dag_fans_out_and_retries_a_killed_partition(tmp_path, airflow_db):
    """`airflow dags test llm_data --use-executor`: the LocalExecutor runs the mapped tasks as separate worker
    processes (talking to a real execution API server). Partition 1's first attempt is SIGKILLed mid-write; Airflow
    retries it; the published set is byte for byte `python -m data_prep shard` with one partition."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
        "MLFLOW_TRACKING_URI": fresh_store(tmp_path / "m.db"),
        "AIRFLOW__API_AUTH__JWT_SECRET": "test-only-secret",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
    }
    env.pop(FAULT_ENV, None)
    api = subprocess.Popen(
        [
            "bash",
            "-c",
            f"source scripts/airflow-env.sh && exec airflow api-server --apps execution -H 127.0.0.1 -p {port} -w 1",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    conf = {"preset": "ci-tiny", "partitions": 3, "max_documents": 60}
    try:
        import urllib.request

        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/execution/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        cmd = f"source scripts/airflow-env.sh && airflow dags test llm_data --use-executor --conf '{json.dumps(conf)}'"
        fault = {**env, FAULT_ENV: "partition:1"}
        returncode, text, released = _dags_test_with_executor(cmd, fault, tmp_path / "dags-test.log")
    finally:
        os.killpg(api.pid, signal.SIGTERM)
        api.wait(timeout=60)
    assert returncode == 0, text[-4000:]
    if released:
        warnings.warn(f"Airflow's LocalExecutor.end() waited on idle worker(s) {released}; ended them", stacklevel=1)
    retried = [line for line in text.splitlines() if "Marking task as UP_FOR_RETRY" in line]
    assert len(retried) == 1 and "task_id=shard_partition" in retried[0] and "map_index=1" in retried[0]
    assert "SIGKILL" in text
    result = json.loads((next((tmp_path / "var" / "runs" / "llm_data").iterdir()) / "shard.json").read_text())
    assert result["status"] in ("ok", "warn") and result["partitions"] == 3 and not result["cache_hit"]
    single = subprocess.run(
        [sys.executable, "-m", "data_prep", "shard", "--config", "configs/ci-tiny.yaml", "--out", str(tmp_path / "one")]
        + ["--set", "partitions=1", "max_documents=60", "shard_multiple=2", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
    )
    assert single.returncode == 0, single.stderr
    assert json.loads(single.stdout)["manifest_digest"] == result["manifest_digest"]
    keys = keys_from_manifest(Path(result["shard_dir"]))
    assert all(len(k) == len(set(k)) for k in keys.values())
