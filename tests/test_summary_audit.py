"""The end-of-run summary (`python -m tasks summary`, the DAG's summary task) on run directories the happy path does
not leave: a damaged result file, a stage running now, a stage that stopped without a result (an Airflow timeout, a
Ctrl-C, a kill), a directory that is not a run. In-process and function-level: no stage runs."""

from __future__ import annotations

import json

import pytest

from tasks import summary
from tasks.errors import StageError
from tasks.procs import RunDirLock

OK = {"status": "ok", "summary": "fine", "seconds": 1.5}


def _write(run_dir, stage: str, body) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"{stage}.json").write_text(body if isinstance(body, str) else json.dumps(body), encoding="utf-8")


def _row(table: str, title: str) -> str:
    (line,) = [ln for ln in table.splitlines() if ln.startswith(title)]
    return line


def test_a_damaged_result_file_is_its_own_row_and_the_others_still_show(tmp_path):
    """A truncated or non-object <stage>.json ended the summary with `error: summary: JSONDecodeError …` (exit 1,
    no file named), hiding every other stage's outcome; now the row names the file and the cause, --check fails."""
    _write(tmp_path, "env", OK)
    _write(tmp_path, "shard", '{"status": "ok", "summ')  # cut short
    _write(tmp_path, "smoke", "[1, 2]")
    _write(tmp_path, "plan", {"status": None, "summary": None, "seconds": None})  # fields nulled by hand
    table = summary.render(tmp_path)
    assert "fine" in _row(table, "Environment validation")
    shard = _row(table, "WebDataset sharding")
    assert "unreadable" in shard and str(tmp_path / "shard.json") in shard and "not JSON" in shard
    assert "holds a JSON list" in _row(table, "Smoke run")
    assert "?" in _row(table, "Parallel plan")
    assert summary.main(["--run-dir", str(tmp_path), "--check"]) == 1


def test_a_stage_holding_the_lock_is_running_and_one_that_let_go_without_a_result_stopped(tmp_path):
    """While a stage ran (it holds <run-dir>/.lock, its <stage>.json not written yet) and after it ended without a
    result (Airflow's execution_timeout and a Ctrl-C are BaseExceptions the runner does not record; a SIGKILL
    records nothing), the summary said "(not run)" for it."""
    _write(tmp_path, "env", OK)
    lock = RunDirLock(tmp_path, "smoke").__enter__()
    try:
        row = _row(summary.render(tmp_path), "Smoke run")
        assert "running" in row and "no result yet" in row and "(not run)" not in row
        assert summary.main(["--run-dir", str(tmp_path), "--check"]) == 1
        _write(tmp_path, "smoke", OK)  # a rerun in progress: the last result stays visible, marked
        assert "last result: ok" in _row(summary.render(tmp_path), "Smoke run")
        (tmp_path / "smoke.json").unlink()
    finally:
        lock.__exit__(None, None, None)
    row = _row(summary.render(tmp_path), "Smoke run")
    assert "stopped" in row and "no result" in row and "rerun" in row
    assert "(not run)" in _row(summary.render(tmp_path), "Parallel plan")
    _write(tmp_path, "smoke", OK)  # its result, once written, is the row again
    assert "fine" in _row(summary.render(tmp_path), "Smoke run")


def test_a_directory_that_is_no_run_is_refused_naming_the_newest_run_under_it(tmp_path):
    """An empty directory, or var/runs/llm_pipeline itself, printed a table of "(not run)" and exited 0."""
    with pytest.raises(StageError, match="is not a run directory.*give the --run-dir a stage was given"):
        summary.main(["--run-dir", str(tmp_path)])
    _write(tmp_path / "manual__1", "env", OK)
    with pytest.raises(StageError, match=r"the newest run under it: --run-dir .*manual__1"):
        summary.main(["--run-dir", str(tmp_path)])
    assert summary.main(["--run-dir", str(tmp_path / "manual__1")]) == 0


def test_a_relative_run_dir_reaches_the_stage_as_an_absolute_path(tmp_path, monkeypatch):
    """README's `python -m tasks train --run-dir D` with a relative D, from anywhere but the repository, failed
    "rank 0 died (exit code 1) at step ?; see logs/rank-0.log": torchrun's ranks start in the repository and read
    D/train/launch.json from there. The runner hands every stage an absolute run directory (checked here on the
    plan stage, in-process: the paths a stage records and hands its children are under it)."""
    from tasks.config import load_config
    from tasks.runner import run_stage

    monkeypatch.chdir(tmp_path)
    cfg = load_config("ci-tiny")
    cfg.tracking.enabled = False
    result = run_stage("plan", cfg, "D")
    assert result["plan_json"] == str(tmp_path / "D" / "plan" / "plan.json")
