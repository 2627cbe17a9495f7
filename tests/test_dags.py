"""The DAG files through real Airflow: import, structure, Params refusing bad values before a run starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def test_dags_import_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert {"llm_pipeline", "llm_data", "llm_health"} <= set(dagbag.dags)


def test_dags_folder_holds_only_dag_files(dagbag):
    """What the DAGs share lives in tasks/ (e.g. tasks/shard_fanout.py): every file in dags/ defines a DAG."""
    files = {p.name for p in (REPO / "dags").iterdir() if p.name != "__pycache__"}
    assert files == {Path(d.fileloc).name for d in dagbag.dags.values()}


def test_main_dag_shape(dagbag):
    dag = dagbag.dags["llm_pipeline"]
    stages = ["env", "shard", "smoke", "plan", "train", "profile", "quantize", "evaluate"]
    for up, down in zip(stages[1:], stages[2:]):
        assert dag.get_task(down).upstream_task_ids == {up}
    assert_shard_fanout(dag, after="env")
    assert dag.catchup is False
    assert all(dag.get_task(t).doc_md for t in stages)
    assert dag.get_task("train").retries == 2  # a retry resumes from the last checkpoint
    assert dag.get_task("pipeline_ok").upstream_task_ids == {"evaluate"}
    assert dag.get_task("pipeline_ok").trigger_rule == "all_success"
    # The approval chain after evaluate; the summary waits for it and runs whatever happened.
    chain = ["evaluate", "approval_needed", "approve", "promote"]
    for up, down in zip(chain, chain[1:]):
        assert dag.get_task(down).upstream_task_ids == {up}
    assert type(dag.get_task("approve")).__name__ == "ApprovalOperator"
    assert dag.get_task("approve").defaults == ["Reject"]  # no answer within the timeout: the champion stays
    assert dag.get_task("summary").upstream_task_ids == {"evaluate", "promote"}
    assert dag.get_task("summary").trigger_rule == "all_done"


def test_timed_runs_are_opt_in(monkeypatch):
    """No weekly run nobody asked for: without LLM_PIPELINE_SCHEDULE the DAG runs on new shard sets and by hand
    only (unpausing it starts nothing); with it, on that cron as well."""
    from airflow.dag_processing.dagbag import DagBag

    from tasks.pipeline import SCHEDULE_ENV

    monkeypatch.delenv(SCHEDULE_ENV, raising=False)
    off = DagBag(dag_folder=str(REPO / "dags" / "llm_pipeline.py")).dags["llm_pipeline"]
    assert type(off.timetable).__name__ == "AssetTriggeredTimetable", off.timetable
    monkeypatch.setenv(SCHEDULE_ENV, "0 3 * * 1")
    on = DagBag(dag_folder=str(REPO / "dags" / "llm_pipeline.py")).dags["llm_pipeline"]
    assert "0 3 * * 1" in str(on.timetable) and "llm-shard-set" in str(on.timetable)
    monkeypatch.setenv(SCHEDULE_ENV, "@quarterly")  # an Airflow preset croniter does not know
    assert "0 0 1 */3 *" in str(
        DagBag(dag_folder=str(REPO / "dags" / "llm_pipeline.py")).dags["llm_pipeline"].timetable
    )
    # a broken expression: the DAG's import error names it (it parsed, and failed the scheduler run after run)
    monkeypatch.setenv(SCHEDULE_ENV, "0 3 * *")
    bad = DagBag(dag_folder=str(REPO / "dags" / "llm_pipeline.py"))
    assert "llm_pipeline" not in bad.dags, bad.dags
    (error,) = bad.import_errors.values()
    assert "LLM_PIPELINE_SCHEDULE='0 3 * *' is not a cron expression" in error, error


def assert_shard_fanout(dag, after: str | None) -> None:
    """prepare → partition (mapped) → layout → write (mapped) → shard: the reduce runs when the mapped tasks were
    skipped (a cache hit) and not after a failure; the mapped tasks retry (a killed worker), the others do not."""
    up = {t: dag.get_task(t).upstream_task_ids for t in ("shard_prepare", "shard_partition", "shard_layout")}
    assert up == {
        "shard_prepare": {after} if after else set(),
        "shard_partition": {"shard_prepare"},
        "shard_layout": {"shard_prepare", "shard_partition"},
    }
    assert dag.get_task("shard_write").upstream_task_ids == {"shard_layout"}
    assert dag.get_task("shard").upstream_task_ids == {"shard_write"}
    for name in ("shard_partition", "shard_write"):
        assert dag.get_task(name).retries == 2 and dag.get_task(name).expand_input is not None
    assert dag.get_task("shard").trigger_rule == dag.get_task("shard_layout").trigger_rule == "none_failed"
    assert dag.get_task("shard").retries == 0


def test_data_dag_shape(dagbag):
    dag = dagbag.dags["llm_data"]
    assert_shard_fanout(dag, after=None)
    assert set(dag.task_ids) == {"shard_prepare", "shard_partition", "shard_layout", "shard_write", "shard"}
    assert "partitions" in dag.params


def test_params_have_sections_types_and_ranges(dagbag):
    params = dagbag.dags["llm_pipeline"].params
    sections = {params.get_param(k).schema.get("section") for k in params}
    assert {"Hardware", "Data", "Model", "Parallelism", "Training", "Quantization"} <= sections
    steps = params.get_param("steps").schema
    assert steps["type"] == ["integer", "null"] and steps["minimum"] == 1  # null = from the preset
    assert params.get_param("precision").schema["enum"] == ["fp32", "bf16", "fp16", None]


def test_every_param_schema_is_the_config_models_schema_of_its_field(dagbag):
    """The trigger form cannot disagree with validation: for every Param the form's type, enum, minimum/maximum and
    items are the config model's own JSON schema for that field (pydantic's), made nullable ("from the preset");
    the form's default is null and the model's default is a value the form accepts."""
    import jsonschema

    from tasks.config import PipelineConfig, load_config
    from tasks.pipeline import PARAMS

    from tasks.config import CONFIG_DIR

    model = PipelineConfig.model_json_schema()
    presets = {p.stem: load_config(p.stem) for p in sorted(CONFIG_DIR.glob("*.yaml"))}
    for pipeline_dag in (dagbag.dags["llm_pipeline"], dagbag.dags["llm_data"]):
        for name, key, *_ in PARAMS:
            if key is None or name not in pipeline_dag.params:
                continue
            section, _, field = key.partition(".")
            ref = model["properties"][section]["$ref"].rsplit("/", 1)[-1]
            want = model["$defs"][ref]["properties"][field]
            form = {
                k: v
                for k, v in pipeline_dag.params.get_param(name).schema.items()
                # $schema: the dialect the form's schema is checked in (draft 7: tests/test_stage_cpu.py)
                if k not in ("title", "description", "section", "values_display", "default", "$schema")
            }
            expect = {k: v for k, v in want.items() if k not in ("title", "description", "default")}
            expect["type"] = [want["type"], "null"]
            if "enum" in want:
                expect["enum"] = [*want["enum"], None]
            assert form == expect, (name, key)
            assert pipeline_dag.params.get_param(name).resolve(None) is None  # the default: from the preset
            default = want.get("default", getattr(getattr(PipelineConfig(), section), field))
            jsonschema.validate(default, pipeline_dag.params.get_param(name).schema)
            # The hint names every preset's value, the default preset first: it stays true when another is chosen.
            desc = pipeline_dag.params.get_param(name).description
            for preset, c in presets.items():
                shown = str(c.model_dump()[section][field]).strip("[]").replace("'", "")
                assert f"{'(' if preset == 'demo-cpu' else '; '}{preset}: {shown}" in desc, (name, desc)


def test_dag_files_import_no_heavy_modules():
    code = (
        "import sys; sys.path.insert(0, 'dags'); import llm_pipeline, llm_data, llm_health; "
        "bad = [m for m in ('torch', 'mlflow', 'webdataset', 'torchao') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_out_of_range_param_fails_before_the_run(tmp_path, airflow_db):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}",
    }
    cmd = "source scripts/airflow-env.sh && airflow dags test llm_pipeline --conf '{\"steps\": 0}'"
    out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "ParamValidationError" in text and "steps" in text
    assert not (tmp_path / "var" / "runs").exists()  # refused before any stage ran


def test_form_defaults_do_not_undo_the_chosen_preset():
    from tasks.pipeline import config_for_params, param_schemas

    form = {name: s["default"] for name, s in param_schemas().items()}  # what an untouched form submits
    cfg = config_for_params({**form, "preset": "ci-tiny"})
    assert (cfg.model.preset, cfg.train.steps, cfg.data.seq_len) == ("debug", 6, 64)  # ci-tiny's own values
    cfg = config_for_params({**form, "preset": "ci-tiny", "steps": 3})
    assert cfg.train.steps == 3 and cfg.data.seq_len == 64  # a changed field still wins


def test_make_run_conf_sets_the_evaluation_tasks_and_the_val_split():
    """docs/evaluation.md's `make run CONF='{"eval_tasks": [...]}'`: the Params a user needs for the fix a too small
    val split names (tasks/stages/shard.py check_evaluation_data), checked as `make run` checks CONF."""
    from tasks.pipeline import check_conf

    cfg = check_conf('{"preset": "ci-tiny", "eval_tasks": ["arc_easy", "demo-continuation"], "val_fraction": 0.3}')
    assert cfg.evaluate.tasks == ["arc_easy", "demo-continuation"] and cfg.data.val_fraction == 0.3
    from tasks.errors import ConfigError

    # a Param given twice: JSON keeps the last without a word (7 steps, not 5); refused as YAML presets are
    with pytest.raises(ConfigError, match=r"^key 'steps' appears twice; keep one"):
        check_conf('{"preset": "ci-tiny", "steps": 5, "steps": 7}')
    doc = (REPO / "docs" / "evaluation.md").read_text()
    assert """make run CONF='{"eval_tasks": ["arc_easy", "demo-continuation"]}'""" in doc
