"""Operator experience: log levels of printed lines, the one-line failure, progress lines, MLflow conventions (config
as params, system metrics, experiment kind, CLI experiment, metric names), the approval helpers and the summary.
Real MLflow (SQLite), real logging; the browser test checks the same through Airflow's and MLflow's UIs."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from tasks import logs, tracking

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
INFO, WARNING, ERROR = logging.INFO, logging.WARNING, logging.ERROR


def test_printed_lines_keep_the_level_they_name():
    mlflow_line = "2026/12/01 12:50:28 INFO mlflow.tracking.fluent: Experiment with name 'x' does not exist."
    py_warning = warnings.formatwarning("old API", DeprecationWarning, "/x/y.py", 12).rstrip()
    cases = [
        ("[  ok] python-torch: 2.13.0", INFO),
        ("  [warn] clock: offset 40 ms", WARNING),
        ("  [fail] npu-health: NPU 1 chip 0 is Alarm", WARNING),  # detail: the failure is the task's own line
        ("warning: quantize: cache stale; rebuilding it", WARNING),
        ("error: shard: no input files", ERROR),
        ("ERROR - something broke", ERROR),
        (mlflow_line, INFO),
        ("2026/12/01 12:50:28 WARNING mlflow.utils: slow", WARNING),
        (py_warning, WARNING),
        ("[W1201 12:00:00.123 ProcessGroupGloo.cpp:12] Warning: x", WARNING),
        ("Traceback (most recent call last):", WARNING),
        ("Successfully registered model 'llm-pipeline-demo'.", INFO),
        ("Error rate 2% after 3 steps", INFO),  # a word, not a level
        ("🏃 View run train at: http://127.0.0.1:5000/#/experiments/1/runs/abc", INFO),
    ]
    assert [(line, logs.level_of(line)) for line, _ in cases] == cases
    assert logs.level_of('  File "x.py", line 3, in f', WARNING) == WARNING  # continues the record above


def test_to_logging_routes_prints_by_level_and_never_loops(caplog):
    caplog.set_level(logging.DEBUG)
    with logs.to_logging():
        print("[ok] a check passed", file=sys.stderr)
        print("warning: something to know", file=sys.stderr)
        print("plain stdout", end="")
        print(" line")
        # A handler writing to whatever sys.stderr is now (a console handler under `airflow dags test`) receives
        # our own records: its write goes straight through instead of looping back into logging.
        handler = logging.StreamHandler()
        logging.getLogger("tasks").addHandler(handler)
        try:
            print("handled once", file=sys.stderr)
        finally:
            logging.getLogger("tasks").removeHandler(handler)
        sys.stderr.write("tokenise: 0doc\rtokenise: 150doc\n")  # a redrawn progress bar: its last state
        sys.stderr.write("partial line at the end")
    got = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ("tasks.stderr", INFO, "[ok] a check passed") in got
    assert ("tasks.stderr", WARNING, "warning: something to know") in got
    assert ("tasks.stdout", INFO, "plain stdout line") in got
    assert ("tasks.stderr", INFO, "partial line at the end") in got  # flushed when the block ends
    assert ("tasks.stderr", INFO, "tokenise: 150doc") in got
    assert [m for _, _, m in got].count("handled once") == 1
    assert not isinstance(sys.stderr, logs.LineLogger)  # restored


def test_mlflow_own_log_lines_are_not_errors(caplog):
    import mlflow  # noqa: F401 (configures MLflow's handler on its stderr stream)

    caplog.set_level(logging.INFO)
    with logs.to_logging():
        logging.getLogger("mlflow.tracking.fluent").info("Experiment with name 'x' does not exist. Creating it.")
    mine = [r for r in caplog.records if r.name == "tasks.stderr"]
    assert mine and all(r.levelno == INFO for r in mine), [(r.levelno, r.getMessage()) for r in mine]


def test_failure_is_one_error_line_and_a_frameless_exit(caplog):
    from tasks.pipeline import RetryableStageFailure, StageFailure, failure

    caplog.set_level(logging.INFO)
    cause = "shard: no input files match data.inputs ['/nope/*.txt']; point data.inputs at text files " + "x" * 300
    e = failure(cause)
    assert isinstance(e, SystemExit) and e.code == 1 and str(e) == cause and not isinstance(e, RetryableStageFailure)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= ERROR]
    assert errors == [cause]  # in full, once
    assert isinstance(failure("rank 1 killed by SIGKILL", retryable=True), RetryableStageFailure)
    assert issubclass(RetryableStageFailure, StageFailure)


def test_train_retries_only_what_a_retry_can_fix():
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk import RetryAction

    from tasks.pipeline import RetryableStageFailure, StageFailure

    dag = DagBag(dag_folder=str(REPO / "dags" / "llm_pipeline.py")).dags["llm_pipeline"]
    policy = dag.get_task("train").retry_policy
    assert policy.evaluate(RetryableStageFailure("lost peer"), 1, 3).action == RetryAction.RETRY
    assert policy.evaluate(StageFailure("NaN loss at step 4"), 1, 3).action == RetryAction.FAIL


def test_progress_lines_every_n_or_seconds_with_eta(caplog):
    caplog.set_level(logging.INFO)
    now = [0.0]
    p = logs.Progress("train", 300, unit="step", every=50, seconds=30, clock=lambda: now[0])
    lines = []
    for step in range(1, 301):
        now[0] = step * 0.5  # 2 steps/s
        line = p.update(step, loss=3.21456, val_loss=None if step < 200 else 3.4, tokens_per_s=5120.0, mfu=0.31)
        if line:
            lines.append(line)
    assert lines[0].startswith("progress: train step 1/300 (0%), loss 3.215, 5.1k tokens/s, MFU 31%")
    # every 50 steps or 30 s, whichever first: 30 s is 60 steps here, so by count
    assert [int(line.split()[3].split("/")[0]) for line in lines] == [1, 51, 101, 151, 201, 251, 300]
    assert lines[3].endswith(", ETA 1m14s") and "val loss" not in lines[3]  # 149 steps left at 2 steps/s
    assert "val loss 3.400" in lines[4] and lines[-1].endswith(", done")
    assert [r.getMessage() for r in caplog.records if r.name == "tasks.progress"] == lines
    slow = logs.Progress("shard", None, unit="file", seconds=30, clock=lambda: now[0])
    now[0] = 0.0
    assert slow.update(1) == "progress: shard file 1"
    now[0] = 10.0
    assert slow.update(2) is None
    now[0] = 31.0
    assert slow.update(3) == "progress: shard file 3"


def test_waiting_says_what_it_waits_for(caplog):
    caplog.set_level(logging.INFO)
    with logs.waiting("the rendezvous of 2 nodes", every_s=0.05):
        deadline = time.monotonic() + 5  # until the first reminder, not a fixed sleep: a busy host starves threads
        while time.monotonic() < deadline and not any("still waiting" in r.getMessage() for r in caplog.records):
            time.sleep(0.01)
    with pytest.raises(RuntimeError):
        with logs.waiting("checkpoint save", every_s=10):
            raise RuntimeError("disk full")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "progress: waiting for the rendezvous of 2 nodes…"
    assert any(m.startswith("progress: still waiting for the rendezvous of 2 nodes (") for m in msgs)
    assert any(re.fullmatch(r"progress: the rendezvous of 2 nodes: done after \d+s", m) for m in msgs)
    assert msgs[-1] == "progress: checkpoint save: gave up after 0s"


def test_relay_copies_a_child_logs_progress_lines(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    log_file = tmp_path / "rank-0.log"
    log_file.write_text("old progress: train step 1/2 from an earlier attempt\n")

    def child():
        with open(log_file, "a") as f:
            for line in ("[10:00:01 rank 0] progress: train step 1/2, loss 3.000\n", "other line\n", "[10:00:02 "):
                f.write(line)
                f.flush()
                time.sleep(0.05)
            f.write("rank 0] progress: train step 2/2, loss 2.500, done\n")

    with logs.relay(log_file, poll_s=0.02):
        t = threading.Thread(target=child)
        t.start()
        t.join()
    got = [r.getMessage() for r in caplog.records if r.name == "tasks.progress"]
    assert got == ["progress: train step 1/2, loss 3.000", "progress: train step 2/2, loss 2.500, done"]


def test_config_is_params_on_parent_and_stage_runs_within_mlflow_limits(cfg):
    import mlflow

    cfg.data.inputs = ["/corpus/" + "x" * 7000]  # longer than MLflow's 6000-character param value
    parent = tracking.parent_run(cfg, "llm_pipeline", "manual__params")
    client = mlflow.MlflowClient(cfg.tracking.uri)
    params = client.get_run(parent).data.params
    assert params["train.lr"] == str(cfg.train.lr) and params["model.preset"] == cfg.model.preset
    assert len(params["data.inputs"]) == tracking.MAX_PARAM_VALUE and params["data.inputs"].endswith("…[truncated]")
    with tracking.stage_run(cfg, "plan", parent) as run_id:
        # a stage's resolved value beside the config's (MLflow refuses to change a param), an equal one is no change
        tracking.log_params({"parallel.dp": cfg.parallel.dp + 1, "train.lr": cfg.train.lr})
    got = client.get_run(run_id).data.params
    assert got["train.lr"] == str(cfg.train.lr) and got["parallel.dp"] == str(cfg.parallel.dp)
    assert got["parallel.dp.resolved"] == str(cfg.parallel.dp + 1)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    assert exp.tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_an_older_experiment_gets_the_model_training_kind(cfg):
    import mlflow

    cfg.tracking.experiment = "made-before-the-kind-tag"
    client = mlflow.MlflowClient(cfg.tracking.uri)
    exp_id = client.create_experiment(cfg.tracking.experiment)
    tracking.parent_run(cfg, "llm_pipeline", "manual__kind")
    assert client.get_experiment(exp_id).tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert tracking.experiment_url("7", cfg).endswith("/#/experiments/7?workflowType=machine_learning")


@pytest.fixture
def fake_npu_smi(tmp_path, monkeypatch):
    """`npu-smi info` on PATH answering with a real 910B2C capture (tests/fixtures/env/npu-smi)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "npu-smi"
    tool.write_text(f"#!/bin/sh\ncat {FIX / 'env' / 'npu-smi' / '910b2c.txt'}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_device_stages_get_system_metrics_with_npu(cfg, fake_npu_smi):
    import mlflow

    cfg.tracking.system_metrics_s = 0.5
    with tracking.stage_run(cfg, "train") as train_id:
        time.sleep(2.5)  # five intervals: two points at least, also when the first collect is slow on a busy host
    with tracking.stage_run(cfg, "smoke") as short_id:  # shorter than one interval: still one point
        pass
    with tracking.stage_run(cfg, "plan") as plan_id:  # not a device stage
        time.sleep(1.5)
    client = mlflow.MlflowClient(cfg.tracking.uri)
    train = client.get_run(train_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(train)
    assert train["system/npu_0_temperature_celsius"] == 51.0 and train["system/npu_1_power_usage_watts"] == 99.6
    assert train["system/npu_0_memory_usage_megabytes"] == pytest.approx(20701 * 2**20 / 1e6, abs=0.1)
    assert len(client.get_metric_history(train_id, "system/cpu_utilization_percentage")) >= 2
    assert "system/cpu_utilization_percentage" in client.get_run(short_id).data.metrics
    assert not any(k.startswith("system/") for k in client.get_run(plan_id).data.metrics)


def test_npu_metrics_from_every_chip_generation():
    from tasks import npu_smi
    from tasks.sysmetrics import npu_metrics

    for name in ("910b2c.txt", "910-two-chips.txt", "310p3.txt", "910b3-one-card.txt"):
        info = npu_smi.parse((FIX / "env" / "npu-smi" / name).read_text())
        got = npu_metrics(info)
        assert {f"npu_{i}_temperature_celsius" for i in range(len(info["chips"]))} <= set(got), name
        assert all(0 <= v <= 100 for k, v in got.items() if k.endswith("_percentage")), name


def test_headline_metric_names_sort_first():
    keys = ("loss", "val.loss", "tokens_per_s", "lr", "mfu", "val.time_s")
    assert [tracking.metric_key(k) for k in keys] == [
        "train/loss",
        "train/val.loss",  # issue 27's `val.loss`, in the UI's first section beside train/loss (issue 28)
        "train/tokens_per_s",
        "train.lr",
        "train.mfu",
        "train.val.time_s",
    ]


def test_backfill_uses_the_same_names(cfg, tmp_path):
    import mlflow

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(json.dumps({"step": s, "loss": 4.0 - s, "lr": 1e-3, "time": 1.0}) + "\n" for s in (1, 2))
    )
    with tracking.stage_run(cfg, "profile") as run_id:
        pass
    uri = tracking.tracking_uri(cfg)
    assert tracking.backfill_metrics(uri, run_id, metrics, prefix="train.") == 2  # an older pending entry's prefix
    assert tracking.backfill_metrics(uri, run_id, metrics) == 0  # found by the same key: nothing twice
    history = mlflow.MlflowClient(uri).get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2]


def test_cli_runs_go_to_their_own_experiment_unless_in_a_dag_runs_directory(cfg, tmp_path):
    from tasks.cli import tracking_home
    from tasks.pipeline import mark_dag_run

    name = cfg.tracking.experiment
    parent, tags = tracking_home(cfg, tmp_path / "cli-run")
    assert parent is None and cfg.tracking.experiment == f"{name}-cli" and tags["pipeline.origin"] == "cli"
    cfg.tracking.experiment = name
    mark_dag_run(tmp_path / "dag-run", "llm_pipeline", "manual__x", "p123")
    assert tracking_home(cfg, tmp_path / "dag-run") == ("p123", {"pipeline.origin": "cli"})
    assert cfg.tracking.experiment == name


def test_cli_in_a_dag_runs_directory_uses_that_runs_config(tmp_path, monkeypatch):
    """A stage rerun by hand in a DAG run's directory, without --config, runs with that run's preset and Params (it
    registered under the default preset's model name and moved that model's aliases); --config still wins."""
    from tasks.cli import dag_run_config
    from tasks.config import load_config
    from tasks.pipeline import config_for_params, join_dag_run
    from tasks.runner import default_run_dir

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path))
    dag = config_for_params({"preset": "ci-tiny", "steps": 7})  # as the DAG's tasks build it
    dag.tracking.enabled = False
    join_dag_run(dag, "llm_pipeline", "manual__x")
    run_dir = default_run_dir("llm_pipeline", "manual__x")
    cfg = load_config(*dag_run_config(str(run_dir), None), sets=["train.lr=0.01"])
    assert (cfg.preset, cfg.train.steps, cfg.train.lr) == ("ci-tiny", 7, 0.01)
    assert cfg.evaluate.registered_model == load_config("ci-tiny").evaluate.registered_model
    assert dag_run_config(str(run_dir), "demo-cpu") == ("demo-cpu", None)
    assert dag_run_config(str(tmp_path / "elsewhere"), None) == (None, None)
    from tasks.cli import CLI_CONFIG_FILE, main

    assert main(["plan", "--run-dir", str(run_dir), "--config", "demo-cpu", "--no-tracking"]) == 0
    assert not (run_dir / CLI_CONFIG_FILE).exists()  # a DAG run's directory keeps the DAG run's config


def test_cli_in_a_directory_a_cli_stage_made_uses_the_preset_it_was_given(tmp_path, monkeypatch):
    """`python -m tasks shard --run-dir D --config ci-tiny`, then `… evaluate --run-dir D` without --config: the
    second stage ran as demo-cpu (another gate, another perplexity, no word). The run directory now remembers the
    --config a stage was given there; a later --config wins and is remembered; a preset file is kept by its path."""
    from tasks.cli import dag_run_config, main

    run_dir = tmp_path / "D"
    assert main(["plan", "--run-dir", str(run_dir), "--config", "ci-tiny", "--no-tracking"]) == 0
    assert dag_run_config(str(run_dir), None) == ("ci-tiny", None)
    assert main(["plan", "--run-dir", str(run_dir), "--no-tracking"]) == 0
    assert json.loads((run_dir / "plan" / "plan.json").read_text())["model"].startswith("debug ")  # ci-tiny's model
    assert dag_run_config(str(run_dir), "demo-cpu") == ("demo-cpu", None)
    (tmp_path / "site.yaml").write_text((REPO / "configs" / "ci-tiny.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--run-dir", str(run_dir), "--config", "site.yaml", "--no-tracking"]) == 0
    monkeypatch.chdir(REPO)
    assert dag_run_config(str(run_dir), None) == (str(tmp_path / "site.yaml"), None)


def test_a_preset_from_the_environment_is_remembered_by_the_run_directory(tmp_path, monkeypatch):
    """`LLM_PIPELINE_PRESET=ci-tiny python -m tasks plan --run-dir D`, then a stage in D without the variable (another
    shell, a cron job): it once ran as demo-cpu. The run directory now records the environment's preset too."""
    from tasks.cli import CLI_CONFIG_FILE, main

    run_dir = tmp_path / "D"
    monkeypatch.setenv("LLM_PIPELINE_PRESET", "ci-tiny")
    assert main(["plan", "--run-dir", str(run_dir), "--no-tracking"]) == 0
    assert json.loads((run_dir / CLI_CONFIG_FILE).read_text()) == {"preset": "ci-tiny"}
    monkeypatch.delenv("LLM_PIPELINE_PRESET")
    assert main(["plan", "--run-dir", str(run_dir), "--no-tracking"]) == 0
    assert json.loads((run_dir / "plan" / "plan.json").read_text())["model"].startswith("debug ")  # ci-tiny's model


def test_a_run_directory_remembers_its_set_values_and_only_what_a_stage_accepted(tmp_path, capsys):
    """`train --config ci-tiny --set train.steps=300`, killed, then `train --run-dir D` again: the rerun took ci-tiny's
    6 steps and ended the run early, status ok. The directory now remembers the --set values with the preset; a new
    --set adds to them (the last wins); another --config starts without them; a refused stage changes nothing."""
    from tasks.cli import CLI_CONFIG_FILE, dag_run_config, main

    run_dir, remembered = tmp_path / "D", tmp_path / "D" / CLI_CONFIG_FILE
    args = ["--run-dir", str(run_dir), "--no-tracking"]
    assert main(["plan", *args, "--config", "ci-tiny", "--set", "train.global_batch=32", "train.steps=300"]) == 0
    assert json.loads(remembered.read_text()) == {
        "preset": "ci-tiny",
        "sets": {"train.global_batch": "32", "train.steps": "300"},
    }
    assert main(["plan", *args, "--set", "train.global_batch=64"]) == 0  # the directory's, one value changed
    assert "ci-tiny with --set train.global_batch=32 train.steps=300" in capsys.readouterr().err
    preset, overrides = dag_run_config(str(run_dir), None)
    assert (preset, overrides) == ("ci-tiny", {"train.global_batch": "64", "train.steps": "300"})
    assert dag_run_config(str(run_dir), "ci-tiny") == (preset, overrides)  # the same --config: the same values
    assert dag_run_config(str(run_dir), "demo-cpu") == ("demo-cpu", None)  # another: none of them
    assert json.loads((run_dir / "plan" / "plan.json").read_text())["global_batch"] == 64
    # refused by the stage (a model.* value under a what-if model): the directory's config is not replaced by it
    assert main(["plan", *args, "--model", "llama3-8b", "--config", "demo-cpu", "--set", "model.n_layers=4"]) == 2
    assert json.loads(remembered.read_text())["preset"] == "ci-tiny"


def _evaluation(run_dir: Path, **extra) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "stage": "evaluate",
        "status": "ok",
        "summary": "v1 candidate PTQ acc drop +0.40% (≤2%), decode 1.10x BF16, 0.55x size",
        "registered_model": "ops-approval-test",
        "version": "1",
        "champion": False,
        "champion_reason": "champion v0 was evaluated on data d0, this model on d1: perplexities are not comparable",
        **extra,
    }
    (run_dir / "evaluate.json").write_text(json.dumps(result))


def test_approval_contract(cfg):
    from tasks.pipeline import approval_of

    cfg.evaluate.require_approval = False
    base = {"version": "3", "champion": False}
    assert approval_of(base, cfg)["needed"] is False
    said = {**base, "approval": {"needed": True, "reason": "comparison inconclusive", "version": "3"}}
    assert approval_of(said, cfg) == {"needed": True, "reason": "comparison inconclusive", "version": "3"}
    cfg.evaluate.require_approval = True
    assert approval_of(base, cfg)["needed"] and "require_approval" in approval_of(base, cfg)["reason"]
    assert approval_of({**base, "champion": True}, cfg)["needed"] is False  # already the champion
    assert approval_of({}, cfg)["needed"] is False  # nothing registered


def test_approval_promotes_and_the_summary_shows_the_reason_in_full(cfg, tmp_path, monkeypatch, capsys):
    import mlflow

    from tasks import pipeline

    monkeypatch.setenv("MLFLOW_TRACKING_URI", cfg.tracking.uri)
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    client = mlflow.MlflowClient(cfg.tracking.uri)
    client.create_registered_model("ops-approval-test")
    client.create_model_version("ops-approval-test", source=str(tmp_path), run_id=None)
    run_dir = pipeline.default_run_dir("llm_pipeline", "manual__approve")
    params = {"preset": "ci-tiny", "require_approval": True}
    _evaluation(run_dir)
    ask = pipeline.approval_request(params, "llm_pipeline", "manual__approve")
    assert ask["subject"] == "Promote ops-approval-test v1 to champion?"
    assert "not comparable" in ask["body"] and "evaluate.require_approval is set" in ask["body"]
    answer = {"chosen_options": ["Approve"], "responded_by_user": {"id": "admin", "name": "admin"}}
    done = pipeline.promote_approved(params, "llm_pipeline", "manual__approve", answer)
    assert done["outcome"] == "approved" and done["by"] == "admin"
    mv = client.get_model_version_by_alias("ops-approval-test", "champion")
    assert str(mv.version) == "1" and mv.tags["champion.approved_by"] == "admin"
    pipeline.print_summary(params, "llm_pipeline", "manual__approve", answer=answer)
    out = capsys.readouterr().out
    reason = done["reason"]
    assert len(reason) > 80 and f"Approval: {reason} → approved by admin: v1 is the champion" in out  # in full
    assert "make ui" in out and "mlflow ui --backend-store-uri" not in out

    # A rejection is recorded by the summary; nothing moves.
    run_dir2 = pipeline.default_run_dir("llm_pipeline", "manual__reject")
    _evaluation(run_dir2)
    pipeline.print_summary(params, "llm_pipeline", "manual__reject", answer={"chosen_options": ["Reject"]})
    assert "rejected by ?: the champion is unchanged" in capsys.readouterr().out
    assert pipeline.approval_request({"preset": "ci-tiny"}, "llm_pipeline", "manual__x") == {}


def test_memory_is_a_table_and_two_metrics():
    from tasks.stages.train import memory_figures, memory_headline, memory_table

    gb = 1e9
    summary = {
        "memory_per_rank": [{"peak_bytes": 3 * gb}, {"peak_bytes": 4 * gb}],
        "memory_phases_per_rank": [{"base": gb, "init": gb, "train": 3 * gb}, {"base": gb, "train": 4 * gb}],
    }
    figures = memory_figures(summary, {"per_rank": [{"export": 2 * gb, "written_bytes": gb}]}, int(6 * gb), "npu")
    assert memory_headline(figures) == {"memory.peak_gb": 4.0, "memory.estimate_over_measured": 1.5}
    table = memory_table(figures)
    assert table["rank"] == [0, 1] and table["train_peak_gb"] == [3.0, 4.0] and table["init_peak_gb"] == [1.0, None]
    assert table["export_peak_over_written"] == [2.0, None] and table["overall_peak_gb"] == [3.0, 4.0]


def test_sourcing_the_env_again_with_another_var_dir_moves_every_store(tmp_path):
    """`source scripts/airflow-env.sh`, then `make db LLM_PIPELINE_VAR_DIR=/elsewhere` (the troubleshooting page's fix
    for an unwritable var/): the make recipe sources it again, and the stores it had derived for var/ stayed there
    (Airflow's DB migrated in var/, the run's MLflow records in var/, the runs elsewhere). Values it derived follow
    the new var dir; a value set by hand is kept."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW", "LLM_PIPELINE", "_LLM"))}
    names = [
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE",
        "MLFLOW_TRACKING_URI",
    ]
    show = " && ".join(f'echo "${n}"' for n in names)
    first, second = tmp_path / "a", tmp_path / "b"

    def sourced_twice(before: str = "") -> list[str]:
        script = (
            f"{before}export LLM_PIPELINE_VAR_DIR={first} && source scripts/airflow-env.sh && "
            f"export LLM_PIPELINE_VAR_DIR={second} && source scripts/airflow-env.sh && {show}"
        )
        out = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert all(str(second) in v and str(first) not in v for v in sourced_twice()), sourced_twice()
    kept = sourced_twice("export MLFLOW_TRACKING_URI=http://mlflow.example:5000 && ")
    assert kept[-1] == "http://mlflow.example:5000" and str(second) in kept[0], kept
