"""What a user reviews in MLflow, under faults: a tracking URI MLflow cannot use is one line (not a traceback, not
~100 s of SQLite retries), a password in tracking.uri never reaches the runs, and MLflow failing while a stage works
is a warning whose values wait in tracking-pending.json, never the stage's failure."""

import json
import sys
import types
from pathlib import Path

import pytest

from tasks import runner, tracking
from tasks.errors import StageError
from tasks.stages import STAGES
from tests.helpers.mlflow_store import fresh_store


@pytest.mark.parametrize(
    "uri, says",
    [
        ("sqllite:///tmp/x.db", r"is unusable \(an unknown scheme; MLflow takes sqlite:///<file>"),
        ("http://127.0.0.1:5000x", r"is unreachable \(nonnumeric port: '5000x'\)"),
        ("file:///tmp/tracking-audit-fs", r"is unusable \(a file store .* use sqlite:///<path>/mlflow.db\)"),
    ],
)
def test_a_tracking_uri_mlflow_cannot_use_is_one_line(cfg, uri, says):
    import mlflow

    cfg.tracking.uri = uri
    with pytest.raises(StageError, match=says) as e:
        tracking._configure(cfg)
    assert "\n" not in str(e.value)
    assert mlflow.get_tracking_uri() != uri  # a refused URI is not left behind for the process's later calls


@pytest.mark.parametrize("kind", ["directory", "garbage"])
def test_an_sqlite_store_that_cannot_be_opened_is_one_line_at_once(cfg, tmp_path, kind):
    """A directory (or a file that is no database) where the store should be: said before MLflow, which retries an
    unopenable SQLite file for ~100 s and then raises SQLAlchemy's error."""
    db = tmp_path / "store.db"
    db.mkdir() if kind == "directory" else db.write_text("not a database\n")
    cfg.tracking.uri = f"sqlite:///{db}"
    why = "is a directory, not an SQLite file" if kind == "directory" else "file is not a database"
    with pytest.raises(StageError, match=rf"^MLflow tracking store sqlite:///{db} is unusable \(.*{why}\); fix "):
        tracking._configure(cfg)


def test_a_deleted_experiment_is_one_line_naming_the_restore(cfg, tmp_path):
    import mlflow

    cfg.tracking.uri = fresh_store(tmp_path / "m.db")
    client = mlflow.MlflowClient(cfg.tracking.uri)
    exp = client.create_experiment(cfg.tracking.experiment)
    client.delete_experiment(exp)
    with pytest.raises(StageError, match=rf"is deleted: restore it .*mlflow experiments restore --experiment-id {exp}"):
        tracking._configure(cfg)


def test_a_password_in_tracking_uri_is_never_logged(cfg):
    cfg.tracking.uri = "postgresql://mlflow:s3cret@db-host:5432/mlflow"
    params = tracking.config_params(cfg)
    assert params["tracking.uri"] == "postgresql://mlflow:***@db-host:5432/mlflow"
    assert "s3cret" not in json.dumps(tracking.shown_config(cfg))  # the parent's config.json
    assert tracking.redact("http://h:5000/a@b") == "http://h:5000/a@b"  # no userinfo: unchanged


@pytest.fixture
def breaking_stage(monkeypatch):
    """A stage whose MLflow store breaks while it works (the SQLite file's header overwritten: every MLflow call
    fails as against a dead server), then logs like a real stage mid-work."""
    mod = types.ModuleType("tests_breaking_stage")

    def run(cfg, ctx):
        db = Path(cfg.tracking.uri[len("sqlite:///") :])
        ctx.args.saved = db.read_bytes()
        db.write_bytes(b"\0" * 100 + ctx.args.saved[100:])  # SQLite's header gone: "file is not a database"
        tracking.log_metrics({"toy.loss": 1.5}, step=7)
        tracking.log_params({"toy.p": 1})
        tracking.log_json_artifact({"a": 1}, "toy/report.json")
        tracking.set_tags({"toy.tag": "x"})
        return {"summary": "worked through the outage"}

    mod.run = run
    monkeypatch.setitem(sys.modules, "tests_breaking_stage", mod)
    monkeypatch.setitem(STAGES, "breaking", "tests_breaking_stage")
    return "breaking"


def test_mlflow_failing_mid_stage_is_a_warning_and_its_values_wait(cfg, tmp_path, breaking_stage, caplog):
    import mlflow

    db = tmp_path / "m.db"
    cfg.tracking.uri = fresh_store(db)
    args = types.SimpleNamespace()
    result = runner.run_stage("breaking", cfg, tmp_path / "run", args=args)  # not a failure
    assert result["status"] == "ok" and json.loads((tmp_path / "run" / "breaking.json").read_text())["status"] == "ok"
    assert "MLflow failed during the stage" in caplog.text
    db.write_bytes(args.saved)  # MLflow back
    tracking.flush_pending(tmp_path / "run")
    assert not (tmp_path / "run" / tracking.PENDING).exists()
    client = mlflow.MlflowClient(cfg.tracking.uri)
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["pipeline.status"] == "ok"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "toy.loss")] == [(7, 1.5)]
    assert run.data.params["toy.p"] == "1" and run.data.tags["toy.tag"] == "x"
    assert [a.path for a in client.list_artifacts(run.info.run_id, "toy")] == ["toy/report.json"]


@pytest.fixture
def refused_stage(monkeypatch):
    """A stage logging one key three times with three values: MLflow keeps the first, `.resolved` the second and
    refuses the third (params never change)."""
    mod = types.ModuleType("tests_refused_stage")

    def run(cfg, ctx):
        for value in (1, 2, 3):
            tracking.log_params({"toy.k": value})
        tracking.log_metrics({"toy.after": 1.0}, step=1)
        return {"summary": "ok"}

    mod.run = run
    monkeypatch.setitem(sys.modules, "tests_refused_stage", mod)
    monkeypatch.setitem(STAGES, "refused", "tests_refused_stage")
    return "refused"


def test_a_value_mlflow_refuses_is_a_warning_not_an_outage(cfg, tmp_path, refused_stage, caplog):
    """A refusal is MLflow's answer, not an outage: one warning, the stage goes on logging directly, and nothing is
    kept pending that would be refused again (and hold the run's status back) at every later flush."""
    import mlflow

    result = runner.run_stage("refused", cfg, tmp_path)
    assert result["status"] == "ok" and not (tmp_path / tracking.PENDING).exists()
    assert "MLflow refused the stage's params" in caplog.text
    run = mlflow.MlflowClient(cfg.tracking.uri).get_run(result["mlflow_run_id"])
    assert (run.data.params["toy.k"], run.data.params["toy.k.resolved"]) == ("1", "2")
    assert run.data.metrics["toy.after"] == 1.0 and run.info.status == "FINISHED"


def test_a_pending_entry_mlflow_refuses_is_dropped_not_kept_for_ever(cfg, tmp_path, caplog):
    gone = "0" * 32  # a run MLflow does not have (deleted since): every replay would be refused
    tracking.defer(tmp_path, {"uri": cfg.tracking.uri, "run_id": gone, "final": {"x": 1.0}})
    tracking.defer(tmp_path, {"uri": cfg.tracking.uri, "run_id": gone, "status": "FINISHED", "end_ms": 1})
    tracking.flush_pending(tmp_path)
    assert not (tmp_path / tracking.PENDING).exists() and "dropped" in caplog.text
