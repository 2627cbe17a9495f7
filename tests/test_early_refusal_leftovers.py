"""Bad config values refused before any work: an unknown model preset by every stage's CLI (not by smoke after a whole
shard set), a mistyped evaluate.tasks entry by the env stage, the run's first task (not by shard after tokenizing)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.quant_fixture import grammar_task


def test_every_stage_cli_refuses_an_unknown_model_preset_before_any_work(tmp_path, monkeypatch, capsys):
    """`python -m tasks shard --set model.preset=typo` tokenized a whole shard set, remembered the typo in the run
    directory's cli-config.json, and only smoke refused it. Every stage now answers in one line naming the known
    presets, exit 2, and writes nothing: no run directory, no shard set, an existing cli-config.json unchanged."""
    from tasks.cli import CLI_CONFIG_FILE, main
    from tasks.shape import PRESETS
    from tasks.stages import OWN_SCHEDULE, STAGES

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    shards = tmp_path / "shards"
    line = f"error: model.preset: unknown preset 'typo' (known: {', '.join(PRESETS)})"
    for stage in ["shard", *(s for s in [*STAGES, *OWN_SCHEDULE] if s != "shard")]:  # the leftover's first
        run_dir = tmp_path / f"new-{stage}"
        argv = [stage, "--config", "ci-tiny", "--run-dir", str(run_dir), "--no-tracking", "--set"]
        rc = main([*argv, "model.preset=typo", f"data.out_dir={shards}"])
        err = capsys.readouterr().err.strip()
        assert (rc, err) == (2, line), stage
        assert not run_dir.exists() and not shards.exists(), stage

    kept = tmp_path / "kept"  # a run directory with a config already: kept as it was
    kept.mkdir()
    (kept / CLI_CONFIG_FILE).write_text(json.dumps({"preset": "ci-tiny"}))
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    sets = ["model.preset=typo", f"data.out_dir={shards}"]
    rc = main(["shard", "--run-dir", str(kept), "--no-tracking", "--set", *sets])
    assert (rc, capsys.readouterr().err.strip().splitlines()[-1]) == (2, line)
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before and not shards.exists()


def test_env_check_refuses_a_mistyped_task_name_with_lm_evals_index(tmp_path):
    """The env stage's check (tasks.harness.suite.check_names, the line shard's full load gives) on a real lm-eval
    TaskManager: a task YAML's folder indexed as evaluate would index it. lm-eval's own ~14 700 tasks (about 7 s of
    CPU to index) are left out of the refusal here, `lm_eval_tasks=False`; the env stage indexes them."""
    from tasks.config import load_config
    from tasks.errors import StageError
    from tasks.stages.env import check_eval_tasks

    yaml = grammar_task(tmp_path / "tasks")

    def cfg(*tasks):
        return load_config("ci-tiny", sets=[f"evaluate.tasks=[{', '.join(tasks)}]"])

    with pytest.raises(StageError) as e:
        check_eval_tasks(cfg("demo-continuation", str(yaml), "grammer"), lm_eval_tasks=False)
    assert str(e.value) == (
        "evaluate.tasks: 'grammer' is not an lm-eval task, group or tag (close: grammar); give a name from "
        "`lm-eval ls tasks` or the path of a task YAML"
    )
    # a known name (its YAML's folder defines it) passes, with lm-eval's own tasks in reach: none indexed for it
    check_eval_tasks(cfg("demo-continuation", str(yaml), "grammar"))
    check_eval_tasks(cfg("demo-continuation"))  # the default: no lm-eval at all


def test_env_stage_refuses_a_missing_task_yaml_before_its_checks(tmp_path, monkeypatch, capsys):
    """The env stage runs the check first: a task YAML that does not exist is refused in evaluate's own line, before
    any version, device or host check (no env/env.json), not by shard after tokenizing."""
    from tasks.cli import main

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    missing = tmp_path / "nowhere.yaml"
    run_dir = tmp_path / "run"
    rc = main(
        ["env", "--config", "ci-tiny", "--run-dir", str(run_dir), "--no-tracking", "--no-probe", "--set"]
        + [f"evaluate.tasks=[demo-continuation, {missing}]"]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err.startswith(f"error: evaluate.tasks: {missing}: no such task YAML file"), err
    assert not (run_dir / "env").exists()
