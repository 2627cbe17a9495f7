"""The Airflow side a user triggers, at the function level (no `airflow dags test`): every Param reaches the config
key it stands for, `make run CONF` refuses what the trigger form (and Airflow's check of `--conf`) refuses, a model
name nobody registers is refused before env and shard run, llm_data takes its own Params only (val_fraction among
them), and a refused Param costs neither DAG callback nor llm_data's shard task a traceback."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest

from tasks.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def _dag(name: str):
    """The DAG as Airflow parses its file (once per module: ~1 CPU s a file)."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / f"{name}.py"))
    assert bag.import_errors == {}, bag.import_errors
    return bag.dags[name]


def test_every_param_sets_its_config_key():
    """A non-default value of each Param (one the form accepts) lands on the key PARAMS names, explicitly; the
    integer Params whose 0 means something say what in their description."""
    import jsonschema

    from tasks.config import get, load_config
    from tasks.pipeline import PARAMS, config_for_params, param_schemas

    forms, base = param_schemas(), load_config("ci-tiny")
    chosen = {"model_preset": "demo", "hf_path": "/models/mine", "tokenizer": "/models/mine", "converters": []}
    chosen |= {"data_inputs": ["a/*.txt"], "eval_tasks": ["arc_easy"], "registered_model": "mine"}
    for name, key, *_ in PARAMS:
        if key is None:
            continue
        form, now = forms[name], get(base, key)
        kind = form["type"][0]
        if name in chosen:
            value = chosen[name]
        elif "enum" in form:
            value = next(v for v in form["enum"] if v is not None and v != now)
        elif kind == "boolean":
            value = not now
        elif kind in ("integer", "number"):
            value = next(v for v in (form["minimum"] + 1, form["minimum"] + 2) if v != now)
            value = min(value, form.get("maximum", value))
        else:
            raise AssertionError(f"{name}: give it a value in `chosen`")
        assert value != now, name
        jsonschema.validate(value, {k: v for k, v in form.items() if k not in ("title", "description", "section")})
        cfg = config_for_params({"preset": "ci-tiny", name: value})  # lr: 1.0, above min_lr (a cross-field rule)
        assert get(cfg, key) == value and key in cfg.explicit, (name, key, get(cfg, key))
        if kind == "integer" and form.get("minimum") == 0:
            assert "0 = " in form["description"], (name, form["description"])


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"model_preset": "qwen2-7"}, "model.preset: unknown preset 'qwen2-7' (known: debug, demo, qwen2-0.5b"),
        ({"model_preset": ""}, "model.preset: unknown preset '' (known: debug"),
        ({"converters": ["npu_fuse"]}, "model.converters: unknown converter 'npu_fuse'; known: "),
        (
            {"model_preset": "nope", "registered_model": "a/b"},
            "'a/b' is refused by MLflow's Model Registry (Invalid model name 'a/b'. Names cannot contain '/' or ':'.)"
            "; choose another; model.preset: unknown preset 'nope'",
        ),
    ],
    ids=["preset-typo", "preset-empty", "converter-typo", "both"],
)
def test_a_model_nobody_registers_is_refused_before_any_stage(params, expected):
    """Env and shard never build the model: a typo in Model preset or Model converters passed them (hours of
    tokenizing on a real corpus) and was refused by smoke. Now the first task (and `make run`) refuses it."""
    from tasks.pipeline import check_conf, config_for_params

    for refuse in (lambda: config_for_params({"preset": "ci-tiny", **params}), lambda: check_conf(json.dumps(params))):
        with pytest.raises(ConfigError) as e:
            refuse()
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_checkpoint_needs_no_model_preset():
    from tasks.pipeline import config_for_params

    cfg = config_for_params({"preset": "ci-tiny", "hf_path": "/models/mine", "model_preset": "custom"})
    assert cfg.model.hf_path == "/models/mine"  # its config.json is the shape; the shard stage checks the directory


CONF_CASES = [
    ("require_approval", "yes", "'yes' is not of type 'boolean', 'null'"),
    ("nproc_per_node", "2", "'2' is not of type 'integer', 'null'"),
    ("data_inputs", "stdlib", "'stdlib' is not of type 'array', 'null'"),
    ("eval_tasks", "mmlu", "'mmlu' is not of type 'array', 'null'"),
    ("preset", None, "None is not of type 'string'"),
    ("preset", "configs/ci-tiny.yaml", "'configs/ci-tiny.yaml' is not one of ['ci-tiny'"),
]


def test_make_run_conf_refuses_what_airflow_refuses():
    """`make run CONF` is checked before Airflow starts; the config model coerces "yes", "2", a text for a list and
    takes a null or a file path for the preset, so the check passed and `airflow dags test` then refused the run
    (ParamValidationError). Each value here is refused by the DAG's real Param, and now by check_conf, one line."""
    from airflow.sdk import Param
    from airflow.sdk.definitions.param import ParamValidationError

    from tasks.pipeline import check_conf, param_schemas

    schemas = param_schemas()  # the DAG's Params are Param(**schema) of these (dags/llm_pipeline.py)
    for name, value, expected in CONF_CASES:
        with pytest.raises(ParamValidationError):
            Param(**schemas[name]).resolve(value)
        with pytest.raises(ConfigError) as e:
            check_conf(json.dumps({name: value}))
        assert str(e.value).startswith(f"{name}: {expected}") and "\n" not in str(e.value), str(e.value)
    cfg = check_conf('{"preset": "ci-tiny", "steps": null, "nproc_per_node": 2, "require_approval": true}')
    assert (cfg.train.steps, cfg.hardware.nproc_per_node, cfg.evaluate.require_approval) == (6, 2, True)


def test_llm_data_takes_its_own_params(monkeypatch, tmp_path):
    """llm_data's form holds DATA_PARAMS, val_fraction (which decides the set's split, and which the fix for a too
    small val split names) among them; llm_pipeline's other Params given to it in `--conf` were merged by Airflow
    and silently ignored: refused in one line by each of its tasks' entry points."""
    from tasks.pipeline import DATA_PARAMS, config_for_params, shard_step

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    dag = _dag("llm_data")
    assert list(dag.params) == list(DATA_PARAMS) and "val_fraction" in dag.params
    assert config_for_params({"preset": "ci-tiny", "val_fraction": 0.2}, "llm_data").data.val_fraction == 0.2
    expected = "unknown DAG Param 'steps' (known: preset, data_inputs, "
    for refuse in (
        lambda: config_for_params({"preset": "ci-tiny", "steps": 5}, "llm_data"),
        lambda: shard_step("prepare", {"steps": 5}, "llm_data", "manual__1"),
    ):
        with pytest.raises(ConfigError) as e:
            refuse()
        assert expected in str(e.value) and "'steps': llm_pipeline's, not llm_data's" in str(e.value), str(e.value)
    assert not (tmp_path / "var").exists()
    assert config_for_params({"preset": "ci-tiny", "steps": 5}, "llm_pipeline").train.steps == 5
    doc = " ".join((REPO / "docs" / "configuration.md").read_text().split())
    assert f"(`DATA_PARAMS`: {', '.join(f'`{n}`' for n in DATA_PARAMS)})" in doc  # the docs list them all


def test_llm_data_shard_task_ends_on_its_one_line_cause(monkeypatch, tmp_path):
    """llm_data's own `shard` task ended a known cause with AirflowFailException (its frames under the cause in the
    task log); it ends as the fan-out's tasks and llm_pipeline's do: the cause logged at ERROR, a StageFailure."""
    from types import SimpleNamespace

    from airflow.sdk.execution_time.context import set_current_context

    from tasks.pipeline import StageFailure

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    dag = _dag("llm_data")
    ti = SimpleNamespace(try_number=1)  # the task instance every task's context holds (the shard task reads its try)
    context = {"dag": dag, "run_id": "manual__1", "params": {"preset": "ci-tiny", "seq_len": 4}, "ti": ti}
    with set_current_context(context), pytest.raises(StageFailure) as e:
        dag.get_task("shard").python_callable(outlet_events={})
    assert str(e.value).startswith("data.seq_len: 4 must be in [8, "), str(e.value)


def test_dag_failure_callback_with_refused_params_ends_quietly():
    """A run whose Params the first task refused started no MLflow parent run; the DAG's failure callback read the
    same Params, raised the same ConfigError and Airflow logged "Callback failed" with its traceback."""
    from tasks.pipeline import end_parent_run

    dag = _dag("llm_data")  # first: parsing a DAG file sets Airflow's logging up (the root logger's handlers)
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("tasks.pipeline")
    logger.addHandler(handler)
    try:
        end_parent_run(success=False)({"dag": dag, "run_id": "manual__1", "params": {"stpes": 3}})
    finally:
        logger.removeHandler(handler)
    assert any(m.startswith("no MLflow parent run to end: unknown DAG Param 'stpes'") for m in seen), seen


def test_the_longest_train_bound_the_form_allows_arms_airflows_timer(monkeypatch, tmp_path):
    """Steps = the form's maximum (1e9) without a planner estimate: train's bound was 4e10 s, which the pre_execute
    hook set as execution_timeout and Airflow's task runner could not arm (setitimer: OverflowError, the task's
    only line). The task's bound is capped; the stage's own bound (what the cause names) is kept."""
    from airflow.sdk.execution_time.timeout import timeout

    from tasks.bounds import MAX_TASK_TIMEOUT_S, stage_timeout_s
    from tasks.pipeline import bound_from_run_config

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    dag = _dag("llm_pipeline")
    task = dag.get_task("train")
    params = {"preset": "ci-tiny", "steps": 10**9}
    bound_from_run_config({"task": task, "dag": dag, "run_id": "manual__1", "params": params})
    seconds = task.execution_timeout.total_seconds()
    assert seconds == MAX_TASK_TIMEOUT_S
    with timeout(seconds):  # as the task runner arms it around the task
        pass
    from tasks.pipeline import config_for_params

    assert stage_timeout_s("train", config_for_params(params)) > MAX_TASK_TIMEOUT_S


def test_an_empty_line_in_evaluation_tasks_is_refused_at_the_first_task():
    """The form's text area sends an empty last line as "" (["arc_easy", ""]); the config took it, and quantize
    found it no lm-eval task after the whole training run."""
    from tasks.pipeline import config_for_params

    with pytest.raises(ConfigError) as e:
        config_for_params({"preset": "ci-tiny", "eval_tasks": ["demo-continuation", ""]})
    assert str(e.value) == (
        "evaluate.tasks: ['demo-continuation', ''] has a blank entry (an empty line in Evaluation tasks); remove it"
    )


def test_a_stage_bug_names_its_real_result_file(monkeypatch, tmp_path):
    """A Python exception in a stage ended its task on `… (traceback below and in <run-dir>/env.json)`: a literal
    placeholder where the run directory is known."""
    from types import SimpleNamespace

    from airflow.exceptions import AirflowFailException
    from airflow.sdk.execution_time.context import set_current_context

    import tasks.pipeline
    from tasks.runner import default_run_dir

    def bug(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setattr(tasks.pipeline, "run_for_dag_run", bug)
    dag = _dag("llm_pipeline")
    context = {"dag": dag, "run_id": "manual__1", "params": {"preset": "ci-tiny"}, "ti": SimpleNamespace(try_number=1)}
    with set_current_context(context), pytest.raises(AirflowFailException) as e:
        dag.get_task("env").python_callable()
    where = default_run_dir("llm_pipeline", "manual__1") / "env.json"
    assert str(e.value) == f"env: RuntimeError: boom (traceback below and in {where})", str(e.value)


def test_the_approval_waits_as_long_as_the_runs_own_preset_says(monkeypatch, tmp_path):
    """evaluate.approval_timeout_h of the run's preset, not the default preset's read at parse time: the approve
    task's pre_execute sets the response_timeout HITLOperator.execute parks the task with."""
    import datetime

    import yaml

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    preset = yaml.safe_load((REPO / "configs" / "ci-tiny.yaml").read_text())
    preset.setdefault("evaluate", {})["approval_timeout_h"] = 5
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(preset))
    dag = _dag("llm_pipeline")
    task = dag.get_task("approve")
    assert task.response_timeout == datetime.timedelta(hours=72)  # the default preset's, at parse time
    task._pre_execute_hook(  # as the task runner calls it before execute (task_runner._execute_task)
        {"task": task, "dag": dag, "run_id": "manual__1", "params": {"preset": str(tmp_path / "site.yaml")}}
    )
    assert task.response_timeout == datetime.timedelta(hours=5)
