"""Orchestration through real Airflow and MLflow: Params that mean what the user set, parent runs that end with the
DAG run's outcome, bounded waits, and retraining on exactly the shard set an asset event published."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.dags import LEAN, dags_test, preset_file
from tests.helpers.mlflow_store import fresh_store


def _gone_within(pid: int, bound_s: float) -> bool:
    """`pid` has exited within `bound_s`: no such process, or a zombie (exited, its reaping up to init)."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (ProcessLookupError, FileNotFoundError):
            return True
        if state == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


REPO = Path(__file__).resolve().parent.parent


def parent_runs(tmp_path: Path, dag_id: str):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.get_experiment_by_name("llm-pipeline")
    runs = client.search_runs(
        [exp.experiment_id], f"tags.`pipeline.kind` = 'parent' and tags.`airflow.dag_id` = '{dag_id}'"
    )
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
        ({"preset": "ci-tiny"}, (tiny.train.steps, tiny.data.seq_len)),  # untouched
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
def test_failed_dag_run_ends_its_parent_run_failed(tmp_path, airflow_db):
    out = dags_test("llm_data", {"preset": "ci-tiny", "data_inputs": [str(tmp_path / "no-such-corpus")]}, tmp_path)
    assert "no-such-corpus" in out.stdout + out.stderr
    # The failed stage's one-line cause names the missing corpus in <run-dir>/shard.json (the DAG-level check of a
    # bad input failing the shard stage; test_pipeline_e2e reads its failed-stage claims from a run failing at train).
    shard = json.loads((next((tmp_path / "var" / "runs" / "llm_data").iterdir()) / "shard.json").read_text())
    assert shard["status"] == "failed" and "no-such-corpus" in shard["error"] and "\n" not in shard["error"], shard
    client, parents = parent_runs(tmp_path, "llm_data")
    assert len(parents) == 1
    parent = client.get_run(parents[0].info.run_id)
    assert parent.info.status == "FAILED" and parent.data.tags["pipeline.outcome"] == "failed"
    assert parent.info.end_time is not None and "pipeline.duration_s" in parent.data.metrics


# ---- 3. Bounded waits ----------------------------------------------------------------------------------------------


def test_train_bound_from_steps_planner_estimate_and_margin(cfg, tmp_path):
    from tasks.bounds import GRACE_S, stage_timeout, task_timeout_s
    from tasks.errors import StageError

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
    # A stage added to tasks.stages.STAGES without its bound: the DAG's import error says what to add, in one line.
    with pytest.raises(StageError, match=r"^no timeout for stage 'not_a_stage': give it one in tasks/config.py, "):
        stage_timeout("not_a_stage", cfg)


def _as_run(task):
    """The operator Airflow's task runner executes: a mapped task's unmapped one (its partial kwargs applied)."""
    if not hasattr(task, "partial_kwargs"):
        return task
    return task.unmap({"op_kwargs": dict.fromkeys(task._get_specified_expand_input().value)})  # its map argument


def test_every_task_has_an_execution_timeout_set_again_from_the_runs_config(tmp_path, monkeypatch):
    import datetime

    from airflow.dag_processing.dagbag import DagBag

    from tasks.bounds import GRACE_S, task_timeout_s
    from tasks.config import load_config
    from tasks.runner import default_run_dir
    from tasks.stages import STAGES

    dags = DagBag(dag_folder=str(REPO / "dags")).dags
    dag = dags["llm_pipeline"]
    for stage in STAGES:
        assert dag.get_task(stage).execution_timeout.total_seconds() == task_timeout_s(stage, load_config())
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path))
    run_dir = default_run_dir("llm_pipeline", "manual__1")
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps({"best": {"step_s": 2.0}}))
    task = dag.get_task("train")
    params = {name: dag.params[name] for name in dag.params}
    # The task's pre_execute hook, as Airflow's task runner calls it before it reads execution_timeout.
    task._pre_execute_hook(
        {"task": task, "dag": dag, "run_id": "manual__1", "params": {**params, "preset": "ci-tiny", "steps": 50}}
    )
    tiny = load_config("ci-tiny")
    expect = 50 * 2.0 * tiny.timeouts.train_margin + tiny.timeouts.train_overhead_s
    assert task.execution_timeout.total_seconds() == int(expect) + 120
    # The shard bound holds the tasks that tokenize and write too (the fan-out, mapped or not, in both DAGs) and
    # llm_data's own shard task (check and publish): a run whose preset sets timeouts.shard_s gets that bound.
    default = datetime.timedelta(seconds=task_timeout_s("shard", load_config()))
    preset = preset_file(tmp_path / "slow-shard.yaml", {"timeouts": {"shard_s": 4321}})
    for dag_id in ("llm_pipeline", "llm_data"):
        dag = dags[dag_id]
        params = {name: dag.params[name] for name in dag.params}
        for task_id in ("shard_prepare", "shard_partition", "shard_layout", "shard_write", "shard"):
            task = _as_run(dag.get_task(task_id))
            assert task.execution_timeout == default, (dag_id, task_id, task.execution_timeout)
            assert task._pre_execute_hook is not None, (dag_id, task_id, "no pre_execute: the parse-time bound stays")
            ctx = {"task": task, "dag": dag, "run_id": "manual__2", "params": {**params, "preset": str(preset)}}
            task._pre_execute_hook(ctx)
            assert task.execution_timeout.total_seconds() == 4321 + GRACE_S, (dag_id, task_id)


def test_torchrun_past_its_bound_is_killed_with_every_rank_and_the_cause(tmp_path):
    """A hung torchrun job (ranks that never return) ends at the bound: agent and ranks killed, one-line cause.
    The bound is short (10 s: torchrun's agent is up in ~3 s on a quiet host); on a host so loaded that the ranks
    were not up within it (nothing to check them against), the same run is repeated with 30 s."""
    from tasks.bounds import run_bounded
    from tasks.errors import StageError

    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    for bound in (10, 30):
        run = tmp_path / f"bound-{bound}"
        run.mkdir()
        script = run / "hang.py"
        script.write_text(
            "import os, pathlib, time\n"
            f"pathlib.Path(r'{run}', 'pid' + os.environ['RANK']).write_text(str(os.getpid()))\n"
            "time.sleep(600)\n"
        )
        started = time.monotonic()
        with pytest.raises(StageError) as err:
            run_bounded(
                [*argv, str(script)],
                env=dict(os.environ),
                cwd=run,
                log_path=run / "torchrun.log",
                timeout_s=bound,
                what="torchrun",
                how="timeouts.train_s",
            )
        assert time.monotonic() - started < bound + 40
        msg = str(err.value)
        assert f"torchrun did not finish within {bound} s (timeouts.train_s)" in msg and "torchrun.log" in msg
        assert "\n" not in msg
        pids = [int((run / f"pid{r}").read_text()) for r in range(2) if (run / f"pid{r}").exists()]
        if len(pids) == 2:
            break
    assert pids, "the ranks never started within the bound"
    for pid in pids:  # gone (a zombie init has not reaped yet counts as gone), within a bound, not a fixed sleep
        assert _gone_within(pid, 10.0), f"rank pid {pid} still runs after torchrun was killed"


# ---- 4. Retraining on the published data ---------------------------------------------------------------------------


def airflow_cli(args: str, tmp_path: Path, extra_env: dict, timeout: int = 600):
    env = {
        **os.environ,
        "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
        "MLFLOW_TRACKING_URI": fresh_store(tmp_path / "m.db"),
        **extra_env,
    }
    return subprocess.run(
        ["bash", "-c", f"source scripts/airflow-env.sh && airflow {args}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def serialize_dag(dag_id: str) -> None:
    """dags/<dag_id>.py parsed and written to the metadata DB under the dags-folder bundle (`airflow dags
    reserialize`, for that one file)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    manager = DagBundlesManager()
    manager.sync_bundles_to_db()
    bundle = manager.get_bundle("dags-folder")
    bag = DagBag(REPO / "dags" / f"{dag_id}.py", bundle_path=bundle.path, bundle_name=bundle.name)
    assert dag_id in bag.dags and not bag.import_errors, bag.import_errors
    sync_bag_to_db(bag, bundle.name, None)


def set_paused(dag_id: str, paused: bool) -> None:
    """`airflow dags pause|unpause <dag_id>`."""
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import update

    with create_session() as session:
        assert session.execute(update(DagModel).where(DagModel.dag_id == dag_id).values(is_paused=paused)).rowcount


@pytest.mark.slow
def test_asset_triggered_run_trains_on_exactly_the_published_shard_set(tmp_path, airflow_db, monkeypatch):
    """`airflow dags test llm_data --conf` with ci-tiny and seq_len 128 (demo-cpu's default: the explicit value
    wins) publishes a shard set the pipeline's own Params (ci-tiny, seq_len 64) would never shard; llm_data's
    parent run ends FINISHED with its duration and the set as its input. The scheduler's own code turns the asset
    event into an llm_pipeline run; its shard task adopts that set (digest equal, nothing re-sharded), train trains
    on it, and the run's MLflow parent run records the event. The same llm_data run again is a cache hit that
    publishes nothing."""
    from tasks.config import load_config
    from airflow.jobs.job import Job
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from airflow.models.dag import DagModel
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from airflow.utils.types import DagRunType
    from sqlalchemy import select

    # The asset-triggered run takes the DAG's default Params: ci-tiny (its validation loss on fewer sequences),
    # 2 training steps (ci-tiny's 6 made shorter: the claim is which shard set train reads, not how long it trains).
    steps = 2
    lean = {"train": LEAN["train"] | {"steps": steps}}
    env = {"LLM_PIPELINE_PRESET": str(preset_file(tmp_path / "ci-tiny-lean.yaml", lean))}
    # Airflow queues asset-triggered runs only for unpaused DAGs: llm_pipeline parsed into the metadata DB (the DAG
    # processor's job) and unpaused, here in this process (`airflow dags reserialize` and `airflow dags unpause`
    # did the same in two more Airflow processes).
    monkeypatch.setenv("LLM_PIPELINE_PRESET", env["LLM_PIPELINE_PRESET"])
    serialize_dag("llm_pipeline")
    set_paused("llm_pipeline", False)
    try:
        out = dags_test("llm_data", {"preset": "ci-tiny", "seq_len": 128}, tmp_path, env)
    finally:
        set_paused("llm_pipeline", True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    published = json.loads((next((tmp_path / "var" / "runs" / "llm_data").iterdir()) / "shard.json").read_text())
    assert load_config("demo-cpu").data.seq_len == 128 != load_config("ci-tiny").data.seq_len
    assert not published["cache_hit"] and published["seq_len"] == 128
    assert json.loads(Path(published["manifest"]).read_text())["seq_len"] == 128

    client, parents = parent_runs(tmp_path, "llm_data")  # 6: the data run's parent run ended with its outcome
    assert len(parents) == 1
    parent = client.get_run(parents[0].info.run_id)
    assert parent.info.status == "FINISHED" and parent.info.end_time >= parent.info.start_time
    assert parent.data.tags["pipeline.outcome"] == "success"
    assert 0 < parent.data.metrics["pipeline.duration_s"] < 900
    inputs = parent.inputs.dataset_inputs
    assert [d.dataset.digest for d in inputs] == [published["manifest_digest"][:32]]
    assert {t.key: t.value for t in inputs[0].tags}["manifest_sha256"] == published["manifest_digest"]

    with create_session() as session:  # what the scheduler loop does for asset-scheduled DAGs
        before = set(session.scalars(select(DagRun.run_id).where(DagRun.dag_id == "llm_pipeline")))
        SchedulerJobRunner(job=Job())._create_dag_runs_asset_triggered(
            dag_models=[session.get(DagModel, "llm_pipeline")], session=session
        )
        session.commit()
        run = session.scalars(
            select(DagRun).where(DagRun.dag_id == "llm_pipeline", DagRun.run_type == DagRunType.ASSET_TRIGGERED)
        ).all()
        run = [r for r in run if r.run_id not in before]
        assert len(run) == 1
        run_id = run[0].run_id
        assert published["asset_uri"] in [e.asset.uri for e in run[0].consumed_asset_events]

    for task in ("shard", "train"):
        out = airflow_cli(f"tasks test llm_pipeline {task} '{run_id}'", tmp_path, env)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    from tasks.runner import safe_name

    run_dir = tmp_path / "var" / "runs" / "llm_pipeline" / safe_name(run_id)
    shard = json.loads((run_dir / "shard.json").read_text())
    assert shard["published"] and shard["shard_dir"] == published["shard_dir"]
    assert shard["manifest_digest"] == published["manifest_digest"]
    assert len(list((tmp_path / "var" / "data").glob("shards-*"))) == 1  # nothing re-sharded
    launch = json.loads((run_dir / "train" / "launch.json").read_text())
    assert launch["shard_dir"] == published["shard_dir"] and launch["config"]["data"]["seq_len"] == 128
    train = json.loads((run_dir / "train.json").read_text())
    assert train["status"] == "ok" and train["steps"] == steps

    client, parents = parent_runs(tmp_path, "llm_pipeline")
    tags = parents[0].data.tags
    assert tags["trigger.kind"] == "asset" and tags["trigger.asset_uri"] == published["asset_uri"]
    assert tags["trigger.manifest_digest"] == published["manifest_digest"]
    assert tags["trigger.source_dag_id"] == "llm_data"
    local = client.download_artifacts(parents[0].info.run_id, "trigger/asset_event.json", str(tmp_path))
    event = json.loads(Path(local).read_text())
    assert event["extra"]["manifest_digest"] == published["manifest_digest"]

    # The same llm_data run again: a cache hit publishes nothing, so a re-shard that changed nothing never starts a
    # retraining (the only asset event of this test's data is the first run's).
    from airflow.models.asset import AssetEvent

    out = dags_test("llm_data", {"preset": "ci-tiny", "seq_len": 128}, tmp_path, env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    again = max((tmp_path / "var" / "runs" / "llm_data").iterdir(), key=lambda p: p.stat().st_mtime)
    again = json.loads((again / "shard.json").read_text())
    assert again["cache_hit"] and again["manifest_digest"] == published["manifest_digest"]
    with create_session() as session:
        events = [e for e in session.scalars(select(AssetEvent)) if str(tmp_path) in e.asset.uri]
        assert [(e.asset.uri, e.extra.get("manifest_digest")) for e in events] == [
            (published["asset_uri"], published["manifest_digest"])
        ]
