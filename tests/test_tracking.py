"""MLflow hierarchy read back from a real SQLite store; runner results and failures; unreachable servers."""

import json
import sys
import types

import pytest

from tasks import runner, tracking
from tasks.errors import StageError
from tasks.stages import STAGES


@pytest.fixture
def toy_stage(monkeypatch):
    """A stage module of our own, registered for the test, that logs like a real stage."""
    mod = types.ModuleType("tests_toy_stage")

    def run(cfg, ctx):
        if getattr(ctx.args, "fail", False):
            raise StageError("the input is bad\nsecond line folded")
        if getattr(ctx.args, "own_result", False):  # a newcomer's stage writing <run-dir>/<stage>.json itself
            (ctx.run_dir / "toy.json").write_text(json.dumps({"cards": 3}))
        tracking.log_metrics({"toy.loss(fp32)": 1.5, "nested": {"x": 2}}, step=3)
        tracking.log_params({"p": 1})
        return {"summary": "toy ok", "seen_inputs": sorted(ctx.inputs)}

    mod.run = run
    monkeypatch.setitem(sys.modules, "tests_toy_stage", mod)
    monkeypatch.setitem(STAGES, "toy", "tests_toy_stage")
    return "toy"


def test_parent_and_child_runs_with_tags(cfg, tmp_path, toy_stage):
    import mlflow

    parent = tracking.parent_run(cfg, "llm_pipeline", "manual__t1", 1)
    assert tracking.parent_run(cfg, "llm_pipeline", "manual__t1", 2) == parent  # idempotent on retry
    (tmp_path / "env.json").write_text(json.dumps({"status": "ok"}))
    result = runner.run_stage("toy", cfg, tmp_path, parent_run_id=parent)
    assert result["status"] == "ok" and result["seen_inputs"] == ["env"]
    assert json.loads((tmp_path / "toy.json").read_text())["mlflow_run_id"] == result["mlflow_run_id"]

    client = mlflow.MlflowClient(cfg.tracking.uri)
    p, c = client.get_run(parent), client.get_run(result["mlflow_run_id"])
    assert p.data.tags["airflow.dag_id"] == "llm_pipeline" and p.data.tags["config.hash"] == cfg.digest()
    assert c.data.tags["mlflow.parentRunId"] == parent
    assert c.data.tags["airflow.run_id"] == "manual__t1" and c.data.tags["pipeline.stage"] == "toy"
    assert c.data.metrics["toy.loss_fp32_"] == 1.5 and c.data.metrics["nested.x"] == 2
    assert c.data.params["p"] == "1" and c.info.status == "FINISHED"


def test_failure_is_recorded_as_one_line(cfg, tmp_path, toy_stage):
    import mlflow

    args = types.SimpleNamespace(fail=True)
    with pytest.raises(StageError, match="^the input is bad second line folded$"):
        runner.run_stage("toy", cfg, tmp_path, args=args)
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["status"] == "failed" and saved["error"] == "the input is bad second line folded"
    run = mlflow.MlflowClient(cfg.tracking.uri).get_run(saved["mlflow_run_id"])
    assert run.info.status == "FAILED" and run.data.tags["pipeline.error"] == saved["error"]
    assert run.data.tags["pipeline.status"] == "failed"  # a filter on the status tag finds the failures too


def test_a_stage_stopped_from_outside_leaves_a_record_saying_so(cfg, tmp_path, toy_stage):
    """Ctrl-C, Airflow's timeout (AirflowTaskTimeout) or its SIGTERM handler raise BaseExceptions: the stage left no
    record, and the summary could not tell a stopped stage from one never started. The earlier result is kept."""
    (tmp_path / "toy.json").write_text(json.dumps({"stage": "toy", "status": "ok", "summary": "toy ok"}))

    def interrupted(cfg, ctx):
        raise KeyboardInterrupt

    sys.modules["tests_toy_stage"].run = interrupted
    with pytest.raises(KeyboardInterrupt):
        runner.run_stage("toy", cfg, tmp_path)
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["status"] == "failed", saved
    want = "toy: stopped before it finished (KeyboardInterrupt): killed or interrupted; rerun the stage"
    assert saved["error"] == want, saved["error"]
    assert saved["previous"]["summary"] == "toy ok"  # the completed record kept


def test_a_stage_that_writes_its_own_result_file_is_stopped_not_overwritten_in_silence(cfg, tmp_path, toy_stage):
    """<run-dir>/<stage>.json is the runner's (run()'s return value): a stage's own output written there would be
    replaced without a word. It fails in one line naming the file and where outputs go; a result file left by an
    earlier run of the stage (the rerun case) is not the stage's own writing."""
    cfg.tracking.enabled = False
    runner.run_stage("toy", cfg, tmp_path)
    with pytest.raises(
        StageError,
        match=rf"^toy: the stage wrote {tmp_path}/toy.json, the runner's result file .*"
        rf"write the stage's own outputs under {tmp_path}/toy/$",
    ):
        runner.run_stage("toy", cfg, tmp_path, args=types.SimpleNamespace(own_result=True))
    assert json.loads((tmp_path / "toy.json").read_text())["status"] == "failed"
    assert runner.run_stage("toy", cfg, tmp_path)["status"] == "ok"


def test_unreachable_tracking_server_is_one_line(cfg, tmp_path, toy_stage):
    cfg.tracking.uri = "http://127.0.0.1:9"  # discard port: nothing listens
    with pytest.raises(StageError, match=r"MLflow tracking server http://127.0.0.1:9 is unreachable"):
        runner.run_stage("toy", cfg, tmp_path)


def test_unknown_stage():
    with pytest.raises(StageError, match="unknown stage 'nope'"):
        runner.stage_module("nope")


@pytest.mark.parametrize("raw, clean", [("loss(fp32)@step", "loss_fp32__step"), ("a/b.c-d e", "a/b.c-d e")])
def test_sanitize_key(raw, clean):
    assert tracking.sanitize_key(raw) == clean


def test_non_zero_rank_does_not_log(cfg, monkeypatch, tmp_path, toy_stage):
    monkeypatch.setenv("RANK", "1")
    result = runner.run_stage("toy", cfg, tmp_path)
    assert result["mlflow_run_id"] is None


def test_git_sha_comes_from_the_image_build_arg_first(monkeypatch, tmp_path):
    """An image has no .git (.dockerignore): the Dockerfiles' GIT_SHA build argument (LLM_PIPELINE_GIT_SHA) is the
    commit; outside an image the checkout's; "unknown" when neither says."""
    monkeypatch.setenv("LLM_PIPELINE_GIT_SHA", "0123456789ab")
    assert tracking.git_sha() == "0123456789ab"
    monkeypatch.setattr(tracking, "REPO_ROOT", tmp_path)  # no repository here
    monkeypatch.setenv("LLM_PIPELINE_GIT_SHA", "unknown")  # the Dockerfiles' default when GIT_SHA is not given
    assert tracking.git_sha() == "unknown"
    monkeypatch.delenv("LLM_PIPELINE_GIT_SHA")
    assert tracking.git_sha() == "unknown"
