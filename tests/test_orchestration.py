"""Orchestration through real Airflow and MLflow: Params that mean what the user set, parent runs that end with the
DAG run's outcome, bounded waits, and retraining on exactly the shard set an asset event published."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

REPO = Path(__file__).resolve().parent.parent


def dags_test(dag_id: str, conf: dict, tmp_path: Path, extra_env: dict | None = None, timeout: int = 600):
    env = {**os.environ, "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}", **(extra_env or {})}
    cmd = f"source scripts/airflow-env.sh && airflow dags test {dag_id} --conf '{json.dumps(conf)}'"
    return subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def parent_runs(tmp_path: Path, dag_id: str):
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.get_experiment_by_name("llm-pipeline")
    runs = client.search_runs([exp.experiment_id], f"tags.`pipeline.kind` = 'parent' and "
                                                   f"tags.`airflow.dag_id` = '{dag_id}'")
    return client, runs


# ---- 5. Params: null = "from the preset", any explicit value wins ---------------------------------------------------

@pytest.fixture(scope="module")
def pipeline_dag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags")).dags["llm_pipeline"]


def test_form_json_explicit_values_win_even_when_equal_to_a_preset_default(pipeline_dag):
    from tasks.config import load_config
    from tasks.pipeline import config_for_params

    demo, tiny = load_config("demo-cpu"), load_config("ci-tiny")
    assert demo.train.steps != tiny.train.steps and demo.data.seq_len != tiny.data.seq_len
    # The JSON the trigger form submits: every field at its default (null = from the preset) plus what was set.
    form = {name: pipeline_dag.params[name] for name in pipeline_dag.params}
    assert form["preset"] == "demo-cpu" and form["steps"] is None and form["precision"] is None
    for conf, expect in [
        ({"preset": "ci-tiny", "steps": demo.train.steps}, (demo.train.steps, tiny.data.seq_len)),  # = demo's default
        ({"preset": "ci-tiny"}, (tiny.train.steps, tiny.data.seq_len)),                           # untouched
        ({"preset": "demo-cpu", "seq_len": tiny.data.seq_len}, (demo.train.steps, tiny.data.seq_len)),
        ({"preset": "ci-tiny", "steps": tiny.train.steps}, (tiny.train.steps, tiny.data.seq_len)),  # = its own
    ]:
        submitted = {**form, **conf}
        for name, value in submitted.items():  # Airflow's own validation of each field (null passes)
            assert pipeline_dag.params.get_param(name).resolve(value) == value
        cfg = config_for_params(submitted)
        assert (cfg.train.steps, cfg.data.seq_len) == expect, conf
    # An enum field: null is "from the preset", shown as such; a value is taken as is.
    prec = pipeline_dag.params.get_param("precision").schema
    assert None in prec["enum"] and prec["values_display"]["null"] == "from the preset"
    assert config_for_params({**form, "preset": "ci-tiny", "precision": "fp32"}).train.precision == "fp32"


@pytest.mark.slow
def test_conf_value_equal_to_another_presets_default_is_used_and_parent_run_ends(tmp_path, airflow_db):
    """`airflow dags test llm_data --conf` with ci-tiny and seq_len 128 (demo-cpu's default): the shard set has
    seq_len 128; the DAG run's MLflow parent run ends FINISHED with its duration and the shard set as its input."""
    from tasks.config import load_config

    assert load_config("demo-cpu").data.seq_len == 128 != load_config("ci-tiny").data.seq_len
    out = dags_test("llm_data", {"preset": "ci-tiny", "seq_len": 128}, tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    run_dir = next((tmp_path / "var" / "runs" / "llm_data").iterdir())
    shard = json.loads((run_dir / "shard.json").read_text())
    manifest = json.loads(Path(shard["manifest"]).read_text())
    assert shard["seq_len"] == manifest["seq_len"] == 128

    client, parents = parent_runs(tmp_path, "llm_data")
    assert len(parents) == 1
    parent = client.get_run(parents[0].info.run_id)
    assert parent.info.status == "FINISHED" and parent.info.end_time >= parent.info.start_time
    assert parent.data.tags["pipeline.outcome"] == "success"
    assert 0 < parent.data.metrics["pipeline.duration_s"] < 600
    inputs = parent.inputs.dataset_inputs
    assert [d.dataset.digest for d in inputs] == [shard["manifest_digest"][:32]]
    assert {t.key: t.value for t in inputs[0].tags}["manifest_sha256"] == shard["manifest_digest"]


@pytest.mark.slow
def test_failed_dag_run_ends_its_parent_run_failed(tmp_path, airflow_db):
    out = dags_test("llm_data", {"preset": "ci-tiny", "data_inputs": [str(tmp_path / "no-such-corpus")]}, tmp_path)
    assert "no-such-corpus" in out.stdout + out.stderr
    client, parents = parent_runs(tmp_path, "llm_data")
    assert len(parents) == 1
    parent = client.get_run(parents[0].info.run_id)
    assert parent.info.status == "FAILED" and parent.data.tags["pipeline.outcome"] == "failed"
    assert parent.info.end_time is not None and "pipeline.duration_s" in parent.data.metrics


# ---- 3. Bounded waits ----------------------------------------------------------------------------------------------

def test_train_bound_from_steps_planner_estimate_and_margin(cfg, tmp_path):
    from tasks.bounds import GRACE_S, stage_timeout, task_timeout_s

    cfg.train.steps, cfg.timeouts.train_margin, cfg.timeouts.train_overhead_s = 300, 4.0, 100
    (tmp_path / "plan.json").write_text(json.dumps({"best": {"step_s": 0.5}}))
    seconds, how = stage_timeout("train", cfg, tmp_path)
    assert seconds == 300 * 0.5 * 4 + 100 and "planner" in how and "timeouts.train_margin" in how
    assert task_timeout_s("train", cfg, tmp_path) == seconds + GRACE_S
    cfg.timeouts.train_s = 77  # overridable
    assert stage_timeout("train", cfg, tmp_path) == (77, "timeouts.train_s")
    cfg.timeouts.train_s = 0
    assert "no planner estimate" in stage_timeout("train", cfg, tmp_path / "no-plan")[1]
    cfg.timeouts.smoke_s = 33
    assert stage_timeout("smoke", cfg) == (33, "timeouts.smoke_s")
    cfg.hardware.launcher = "kubernetes"  # a Job may first wait to be scheduled
    assert task_timeout_s("smoke", cfg) == 33 + GRACE_S + cfg.timeouts.k8s_pending_s


def test_every_task_has_an_execution_timeout_set_again_from_the_runs_config(tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    from tasks.bounds import task_timeout_s
    from tasks.config import load_config
    from tasks.runner import default_run_dir
    from tasks.stages import STAGES

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["llm_pipeline"]
    for stage in STAGES:
        assert dag.get_task(stage).execution_timeout.total_seconds() == task_timeout_s(stage, load_config())
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path))
    run_dir = default_run_dir("llm_pipeline", "manual__1")
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps({"best": {"step_s": 2.0}}))
    task = dag.get_task("train")
    params = {name: dag.params[name] for name in dag.params}
    # The task's pre_execute hook, as Airflow's task runner calls it before it reads execution_timeout.
    task._pre_execute_hook({"task": task, "dag": dag, "run_id": "manual__1",
                                        "params": {**params, "preset": "ci-tiny", "steps": 50}})
    tiny = load_config("ci-tiny")
    expect = 50 * 2.0 * tiny.timeouts.train_margin + tiny.timeouts.train_overhead_s
    assert task.execution_timeout.total_seconds() == int(expect) + 120


def test_torchrun_past_its_bound_is_killed_with_every_rank_and_the_cause(tmp_path):
    """A hung torchrun job (ranks that never return) ends at the bound: agent and ranks killed, one-line cause."""
    from tasks.bounds import run_bounded
    from tasks.errors import StageError

    script = tmp_path / "hang.py"
    script.write_text("import os, pathlib, time\n"
                      f"pathlib.Path(r'{tmp_path}', 'pid' + os.environ['RANK']).write_text(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    started = time.monotonic()
    with pytest.raises(StageError) as err:
        run_bounded(argv, env=dict(os.environ), cwd=tmp_path, log_path=tmp_path / "torchrun.log", timeout_s=20,
                    what="torchrun", how="timeouts.train_s")
    assert time.monotonic() - started < 60
    msg = str(err.value)
    assert "torchrun did not finish within 20 s (timeouts.train_s)" in msg and "torchrun.log" in msg
    assert "\n" not in msg
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2) if (tmp_path / f"pid{r}").exists()]
    assert pids, "the ranks never started within the bound"
    time.sleep(0.5)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
