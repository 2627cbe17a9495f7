"""What makes work be redone or retried: the profile stage collected the profiled run again (minutes of device time)
when a setting the profiled run never reads changed (evaluate.*, quantize.*, tracking.*, smoke.*, timeouts.*); a
relative $LLM_PIPELINE_VAR_DIR (a bad path the user must fix) left the shard fan-out's step as a plain DataPrepError,
before the step's own error handling, which the partition/write tasks' retry policy retried with the same input."""

from __future__ import annotations

import datetime

import pytest

from tasks.config import apply_overrides, load_config
from tasks.errors import StageError
from tasks.fsutil import atomic_write_json
from tasks.stages import profile as stage

# -- profile: only what the profiled run reads decides a re-collect ---------------------------------------------------

NOT_READ = [
    {"evaluate.max_drop_pct": 5.0},
    {"evaluate.registered_model": "another-model"},
    {"evaluate.fail_on_gate": False},
    {"evaluate.tasks": ["hellaswag"]},
    {"quantize.method": "int8_dynamic"},  # without the qat_int8 converter no rank reads quantize.*
    {"quantize.calibration_batches": 9},
    {"tracking.experiment": "elsewhere"},
    {"tracking.enabled": False},
    {"smoke.steps": 7},
    {"timeouts.train_s": 99999},
    {"timeouts.profile_s": 3000},
]
READ = [
    {"train.lr": 1e-2},
    {"train.micro_batch": 1},
    {"model.n_layers": 3},
    {"data.seq_len": 64},
    {"parallel.zero": 1},
    {"hardware.nproc_per_node": 1},
    {"plan.runtime_reserve_gb": 3.0},  # train.prepare's memory estimate, in the launch spec
    {"profile.active": 3},
    {"model.converters": ["qat_int8"]},
]


def _ids(change: dict) -> str:
    return next(iter(change))


@pytest.mark.parametrize(
    "change, reused",
    [(c, True) for c in NOT_READ] + [(c, False) for c in READ],
    ids=lambda v: _ids(v) if isinstance(v, dict) else ("reused" if v else "collects again"),
)
def test_a_collect_is_reused_exactly_when_the_profiled_run_reads_no_changed_setting(change, reused, tmp_path):
    """A setting the profiled run never reads reuses the collect; one it reads collects again."""
    cfg = load_config("demo-cpu")
    marker, launch = tmp_path / "traces" / "collected.json", {"layout": {"dp": 2}, "world": 2}
    atomic_write_json(marker, {"collect_hash": stage.collect_digest(cfg), "shard_dir": "S", **launch})
    apply_overrides(cfg, change)
    assert stage.reusable(marker, cfg, "S", **launch) == (marker.parent if reused else None)


def test_the_quantize_settings_qat_int8_trains_with_collect_again():
    """With model.converters listing qat_int8 every rank fake-quantizes by quantize.method and skip_layers."""
    cfg = load_config("demo-cpu")
    apply_overrides(cfg, {"model.converters": ["qat_int8"]})
    before = stage.collect_digest(cfg)
    apply_overrides(cfg, {"quantize.calibration_batches": 9})  # the quantize stage's only
    assert stage.collect_digest(cfg) == before
    for change in ({"quantize.method": "int8_dynamic"}, {"quantize.skip_layers": ["lm_head"]}):
        apply_overrides(cfg, change)
        assert stage.collect_digest(cfg) != before
        before = stage.collect_digest(cfg)


# -- shard fan-out: a relative var directory fails once, in one line --------------------------------------------------


@pytest.fixture
def relative_var_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may land under the working directory
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", "rel-var")
    yield
    assert not (tmp_path / "rel-var").exists()


@pytest.mark.parametrize("step", ["prepare", "partition", "layout", "write"])
def test_a_relative_var_dir_fails_the_shard_step_without_a_retry(step, relative_var_dir):
    """shard_fanout._call maps a StageError to StageFailure, which the partition/write tasks' retry policy fails at
    once; anything else (the DataPrepError that escaped before) was retried with the same environment."""
    from tasks.pipeline import RetryableStageFailure, StageFailure, failure, shard_step

    arg = {"job": "/nonexistent/job", "index": 0} if step in ("partition", "write") else None
    with pytest.raises(StageError) as e:
        shard_step(step, {"preset": "ci-tiny"}, "llm_data", "r1", arg)
    assert not e.value.retryable and "\n" not in str(e.value)
    assert str(e.value).startswith("LLM_PIPELINE_VAR_DIR=rel-var is a relative path")
    assert "give an absolute one" in str(e.value)
    ended = failure(str(e.value), e.value.retryable)
    assert isinstance(ended, StageFailure) and not isinstance(ended, RetryableStageFailure)


def test_a_relative_var_dir_leaves_the_pre_execute_bound_to_the_task_body(relative_var_dir):
    """pre_execute (bound_from_run_config) runs before the task body: an exception there bypasses the body's
    mapping to StageFailure, so the retry policy retried it; the parse-time bound stays, the body refuses."""
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG

    from tasks.pipeline import bound_from_run_config

    with DAG("llm_data", schedule=None) as dag:
        task = EmptyOperator(task_id="shard_partition", execution_timeout=datetime.timedelta(seconds=7))
    bound_from_run_config({"task": task, "dag": dag, "run_id": "r1", "params": {}}, stage="shard")
    assert task.execution_timeout == datetime.timedelta(seconds=7)
