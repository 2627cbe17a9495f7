"""Kubernetes leftovers: a stage's result is taken only from the job that this try submitted (an earlier try's job,
still running after this try set its result aside, writes `<stage>.json` too), and a pod's stage run is tagged with
its Airflow task's try, as a stage run on the Airflow worker is. Function level: the rendered manifests (validated
against the API's and the CRDs' schemas), collect_result on the shared volume's file, the CLI stage run as a pod runs
it (a real SQLite MLflow store), and the submit path once over the recorded loopback API (tests/helpers/k8s_api.py)."""

import json

import pytest

from tasks.errors import StageError
from tasks.launch import k8s_job, k8s_submit
from tests.helpers.k8s_api import RecordedApi, connected, on_kubernetes
from tests.helpers.k8s_schema import validate
from tests.helpers.mlflow_store import fresh_store


@pytest.fixture
def k8s_cfg():
    """The demo-cpu config on the Kubernetes launcher (no MLflow store: nothing here tracks)."""
    from tasks.config import load_config

    return on_kubernetes(load_config("demo-cpu"))


def _envs(manifest: dict) -> list[dict]:
    """{name: value} of every pod environment a rendered manifest carries (each replica's, the trainer's)."""
    spec = manifest["spec"]
    if manifest["kind"] == "PyTorchJob":
        pods = [r["template"]["spec"]["containers"][0]["env"] for r in spec["pytorchReplicaSpecs"].values()]
    elif manifest["kind"] == "TrainJob":
        pods = [spec["trainer"]["env"]]
    else:
        pods = [spec["template"]["spec"]["containers"][0]["env"]]
    return [{e["name"]: e.get("value") for e in env} for env in pods]


@pytest.mark.parametrize("kind", ["job", "pytorchjob", "trainjob"])
def test_the_pods_are_told_their_job_and_try(k8s_cfg, tmp_path, kind):
    cfg = k8s_cfg
    cfg.hardware.k8s_kind = kind
    for stage in ("train", "smoke"):  # a torchrun stage (this kind) and a one-pod Job
        name = k8s_job.job_name("llm_pipeline", "r1", 3, stage)
        manifests = k8s_job.render(cfg, tmp_path / "run", name, stage, try_number=3)
        for m in manifests:
            validate(m)
        envs = _envs(manifests[-1])
        assert envs and all(e[k8s_job.JOB_ENV] == name and e[k8s_job.TRY_ENV] == "3" for e in envs), envs


def _result(run_dir, job: str | None, **fields) -> None:
    record = {"stage": "train", "status": "ok", "summary": "trained", **fields}
    if job:
        record["k8s_job"] = job
    (run_dir / "train.json").write_text(json.dumps(record))


def test_a_result_another_job_wrote_is_refused_and_this_jobs_taken(tmp_path):
    """Try 2 set try 1's result aside and submitted its job; try 1's job, still running, then wrote train.json:
    refused in one retryable line naming both jobs (the file stays as it is), and its error is not given as this
    job's cause. The result this job's pods stamped is taken."""
    run = tmp_path / "run"
    run.mkdir()
    old, new = (k8s_job.job_name("llm_pipeline", "r1", t) for t in (1, 2))
    _result(run, old)
    assert k8s_job.set_aside_result(run, new) is not None
    _result(run, old, summary="try 1's")  # written after the set-aside
    before = (run / "train.json").read_bytes()
    with pytest.raises(StageError) as err:
        k8s_job.collect_result(run, new, selector="training.kubeflow.org/job-name")
    line = str(err.value)
    assert line.startswith(f"train job {new} completed, but {run / 'train.json'} was written by job {old} ")
    assert f"`kubectl get pods -l training.kubeflow.org/job-name={old}`" in line and "\n" not in line
    assert err.value.retryable and (run / "train.json").read_bytes() == before

    _result(run, old, status="failed", error="train: try 1's own error")
    cause = k8s_job.failure_cause(run, new, "BackoffLimitExceeded", pods="x-0 Failed (exit 137 OOMKilled)")
    assert "try 1's own error" not in cause and "x-0 Failed (exit 137 OOMKilled)" in cause

    _result(run, new, summary="try 2's")
    result = k8s_job.collect_result(run, new)
    assert result["summary"] == "try 2's" and result["k8s_job"] == new and result["launcher"] == "kubernetes"
    _result(run, new, status="failed", error="train: try 2's own error")
    with pytest.raises(StageError, match="failed \\(stage failed\\): train: try 2's own error"):
        k8s_job.collect_result(run, new)


def test_a_pods_stage_run_is_tagged_with_its_try_and_stamps_its_result(tmp_path, monkeypatch):
    """`python -m tasks <stage> --run-dir <the DAG run's>` as a pod runs it, with the environment its manifest
    sets: its MLflow child run (under the DAG run's parent) is tagged airflow.try_number, and its result file names
    the job, which collect_result then takes as this job's and refuses for any other (a real SQLite store; the shard
    stage fails at once on a missing input, after its run was opened, which keeps this cheap)."""
    import mlflow

    from tasks.cli import main
    from tasks.pipeline import config_for_params, join_dag_run
    from tasks.runner import default_run_dir

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    uri = fresh_store(tmp_path / "m.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    params = {"preset": "ci-tiny", "data_inputs": [str(tmp_path / "missing.txt")], "seq_len": 16, "vocab_size": 300}
    parent = join_dag_run(config_for_params(params), "llm_pipeline", "r1")  # the DAG's first task
    run_dir = default_run_dir("llm_pipeline", "r1")
    name = k8s_job.job_name("llm_pipeline", "r1", 2, "shard")
    monkeypatch.setenv(k8s_job.JOB_ENV, name)
    monkeypatch.setenv(k8s_job.TRY_ENV, "2")
    assert main(["shard", "--run-dir", str(run_dir), "--set", "hardware.node_rank=0"]) == 2
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("llm-pipeline")
    (run,) = client.search_runs([exp.experiment_id], "tags.`pipeline.stage` = 'shard'")
    assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["airflow.try_number"] == "2"
    assert json.loads((run_dir / "shard.json").read_text())["k8s_job"] == name
    with pytest.raises(StageError, match=f"shard job {name} failed \\(stage failed\\): .*missing.txt"):
        k8s_job.collect_result(run_dir, name, stage="shard")
    other = k8s_job.job_name("llm_pipeline", "r1", 3, "shard")
    with pytest.raises(StageError, match=f"was written by job {name} "):
        k8s_job.collect_result(run_dir, other, stage="shard")


def test_the_submitted_try_refuses_an_earlier_tries_late_result(k8s_cfg, tmp_path, monkeypatch):
    """Through the cncf hook and the client against the recorded loopback API: try 2's Job carries try 2 and its
    own name, and when try 1's job writes train.json as try 2's completes, the task fails in one retryable line
    instead of returning try 1's result."""
    cfg = k8s_cfg
    cfg.tracking.enabled = False
    api = connected(RecordedApi(validate, {"job": ["job-running", "job-complete"]}), tmp_path, monkeypatch)
    try:
        from tasks.runner import default_run_dir

        old = k8s_job.job_name("llm_pipeline", "r1", 1)
        api.on_done = lambda obj: _result(default_run_dir("llm_pipeline", "r1"), old, summary="try 1's")
        with pytest.raises(StageError, match=f"was written by job {old} ") as err:
            k8s_submit.run_stage_job("train", cfg, "llm_pipeline", "r1", 2, conn_id="k8s_loopback", poll_s=0.05)
        assert err.value.retryable
        name = k8s_job.job_name("llm_pipeline", "r1", 2)
        (env,) = _envs(api.objects[("jobs", name)])
        assert (env[k8s_job.JOB_ENV], env[k8s_job.TRY_ENV]) == (name, "2")
        assert f"-l job-name={old}`" in str(err.value)
    finally:
        api.close()
