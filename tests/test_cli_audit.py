"""The CLI audit's findings: what a run directory remembers (a killed stage's --set values, the default preset, a
blank or file-named --config), the summary's config, a corrupt hf/ export re-exported by a train rerun, the MLflow
unreachable message naming where its URI came from, a relative LLM_PIPELINE_VAR_DIR, list-of-text --set values, and
the troubleshooting quote of a stopped training. In-process and cheap: `plan` is the only stage run."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.train_fixture import shards  # noqa: F401

NO_TRACKING = "--no-tracking"


class Killed(BaseException):
    """What SIGKILL is to the CLI: nothing after it runs (not an Exception, not a KeyboardInterrupt)."""


def _main(*argv) -> int:
    from tasks.cli import main

    return main([str(a) for a in argv])


@pytest.fixture(autouse=True)
def _no_env_preset(monkeypatch):
    monkeypatch.delenv("LLM_PIPELINE_PRESET", raising=False)


# ---- 1. a killed stage's --set values are taken by the next run -----------------------------------------------------


def test_a_killed_stages_set_values_are_taken_by_the_next_run(tmp_path, monkeypatch, capsys):
    """`train --set train.steps=400` in a directory an earlier stage made, killed, rerun as `train --run-dir D`: the
    rerun once took the remembered config without the 400 (the preset's steps). It now takes the killed run's values,
    says so in one line, and remembers them once it finished."""
    import tasks.runner
    from tasks.cli import CLI_CONFIG_FILE, PENDING_CONFIG_FILE, dag_run_config

    run = tmp_path / "D"
    assert _main("plan", "--run-dir", run, NO_TRACKING, "--config", "ci-tiny", "--set", "train.lr=0.01") == 0
    remembered = (run / CLI_CONFIG_FILE).read_text()
    real = tasks.runner.run_stage

    def killed(*a, **k):
        raise Killed

    monkeypatch.setattr(tasks.runner, "run_stage", killed)
    with pytest.raises(Killed):
        _main("plan", "--run-dir", run, NO_TRACKING, "--set", "train.steps=400")
    assert (run / CLI_CONFIG_FILE).read_text() == remembered  # not finished: not the directory's yet
    monkeypatch.setattr(tasks.runner, "run_stage", real)
    capsys.readouterr()
    assert dag_run_config(str(run), None) == ("ci-tiny", {"train.lr": "0.01", "train.steps": "400"})
    err = capsys.readouterr().err
    said = [ln for ln in err.splitlines() if "train.steps=400" in ln]
    assert (
        len(said) == 1 and "config: this run directory's (ci-tiny with --set train.lr=0.01 train.steps=400" in said[0]
    )
    assert "cli-config.pending.json: left by a stage run that did not finish, taken)" in said[0]
    assert _main("plan", "--run-dir", run, NO_TRACKING) == 0  # the rerun, without --set
    assert json.loads((run / CLI_CONFIG_FILE).read_text()) == {
        "preset": "ci-tiny",
        "sets": {"train.lr": "0.01", "train.steps": "400"},
    }
    assert not (run / PENDING_CONFIG_FILE).exists()


def test_a_refused_stage_leaves_no_pending_values_and_keeps_a_killed_runs(tmp_path, monkeypatch):
    import tasks.runner
    from tasks.cli import CLI_CONFIG_FILE, PENDING_CONFIG_FILE

    run = tmp_path / "D"
    assert _main("plan", "--run-dir", run, NO_TRACKING, "--config", "ci-tiny") == 0
    remembered = (run / CLI_CONFIG_FILE).read_text()
    refused = ["--model", "llama3-8b", "--set", "model.n_layers=4"]  # refused by the stage (a what-if model)
    assert _main("plan", "--run-dir", run, NO_TRACKING, *refused) == 2
    assert not (run / PENDING_CONFIG_FILE).exists() and (run / CLI_CONFIG_FILE).read_text() == remembered
    real = tasks.runner.run_stage
    monkeypatch.setattr(tasks.runner, "run_stage", lambda *a, **k: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        _main("plan", "--run-dir", run, NO_TRACKING, "--set", "train.steps=400")
    left = (run / PENDING_CONFIG_FILE).read_text()
    monkeypatch.setattr(tasks.runner, "run_stage", real)
    assert _main("plan", "--run-dir", run, NO_TRACKING, *refused) == 2
    assert (run / PENDING_CONFIG_FILE).read_text() == left  # the killed run's values, still to be taken


# ---- 2. --config '' and a preset's own file -------------------------------------------------------------------------


def test_a_blank_config_is_refused_and_changes_nothing(tmp_path, capsys):
    from tasks.cli import CLI_CONFIG_FILE

    run = tmp_path / "D"
    assert _main("plan", "--run-dir", run, NO_TRACKING, "--config", "ci-tiny", "--set", "train.lr=0.01") == 0
    remembered = (run / CLI_CONFIG_FILE).read_text()
    capsys.readouterr()
    assert _main("plan", "--run-dir", run, NO_TRACKING, "--config", "") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --config is empty"), err
    assert (run / CLI_CONFIG_FILE).read_text() == remembered


def test_a_presets_own_file_is_that_preset(tmp_path):
    from tasks.cli import dag_run_config

    run = tmp_path / "D"
    assert _main("plan", "--run-dir", run, NO_TRACKING, "--config", "ci-tiny", "--set", "train.lr=0.01") == 0
    path = str(REPO / "configs" / "ci-tiny.yaml")
    assert dag_run_config(str(run), path) == (path, {"train.lr": "0.01"})


# ---- 3. a corrupt hf/ export is exported again ------------------------------------------------------------------


def _safetensors(path: Path) -> None:
    header = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))


def _whole_export(run: Path, checkpoint: Path) -> None:
    from tasks.fsutil import sha256_file
    from tasks.model.model_dir import FORMAT, MANIFEST, file_entry
    from tests.helpers.models import LLAMA_CONFIG as LLAMA

    hf = run / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(LLAMA))
    _safetensors(hf / "model.safetensors")
    body = {
        "format": FORMAT,
        "files": {n: file_entry(hf / n) for n in ("config.json", "model.safetensors")},
        "checkpoint": {"name": checkpoint.name, "meta_sha256": sha256_file(checkpoint / "meta.json")},
    }
    (hf / MANIFEST).write_text(json.dumps(body))


def test_an_export_whose_files_differ_from_its_manifest_is_exported_again(tmp_path, caplog):
    from tasks.stages import train

    run = tmp_path / "run"
    step = run / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 2}))
    _whole_export(run, step)
    assert train.export_current(run, step)
    weights = run / "hf" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # same size, another byte: only the sha256 tells
    weights.write_bytes(bytes(data))
    assert not train.export_current(run, step)
    assert "is corrupt" in caplog.text and "exporting" in caplog.text
    weights.write_bytes(bytes(data[:-4]))  # cut short
    assert not train.export_current(run, step)


# ---- 4. MLflow unreachable: where the URI came from -----------------------------------------------------------------


def test_an_unreachable_tracking_uri_names_its_source_and_the_fix(monkeypatch):
    from tasks.config import load_config
    from tasks.errors import StageError
    from tasks.tracking import _configure

    import mlflow

    monkeypatch.setattr(mlflow, "set_tracking_uri", lambda uri: None)  # no process-wide URI left behind
    down = "http://127.0.0.1:9"
    cfg = load_config("ci-tiny", sets=[f"tracking.uri={down}"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:7")
    with pytest.raises(StageError) as err:
        _configure(cfg)
    said = str(err.value)
    assert said.startswith(f"MLflow tracking server {down} is unreachable (")
    assert "it is tracking.uri" in said and "--set tracking.uri=" in said and "--no-tracking" in said
    assert "set MLFLOW_TRACKING_URI /" not in said and "\n" not in said
    with pytest.raises(StageError) as err:
        _configure(load_config("ci-tiny"))
    said = str(err.value)
    assert said.startswith("MLflow tracking server http://127.0.0.1:7 is unreachable (")
    assert "it is $MLFLOW_TRACKING_URI: start it (make ui), or set MLFLOW_TRACKING_URI" in said


# ---- 5. the summary takes the run directory's config ----------------------------------------------------------------


def test_summary_links_use_the_run_directorys_ui_url(tmp_path, capsys):
    from tasks.cli import CLI_CONFIG_FILE

    run = tmp_path / "D"
    run.mkdir()
    (run / CLI_CONFIG_FILE).write_text(
        json.dumps({"preset": "ci-tiny", "sets": {"tracking.ui_url": "http://mlflow.example:5000"}})
    )
    result = {"stage": "plan", "status": "ok", "summary": "s", "mlflow_run_id": "abc", "mlflow_experiment_id": "1"}
    (run / "plan.json").write_text(json.dumps(result))
    assert _main("summary", "--run-dir", run) == 0
    assert "http://mlflow.example:5000/" in capsys.readouterr().out


# ---- 6. a relative LLM_PIPELINE_VAR_DIR ----------------------------------------------------------------------------


def test_a_relative_var_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    from data_prep.config import var_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", "rel-var")
    capsys.readouterr()
    assert _main("plan", NO_TRACKING) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LLM_PIPELINE_VAR_DIR=rel-var is a relative path" in err[0], err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "abs"))
    assert var_dir() == tmp_path / "abs"


# ---- 7. the default preset is said and remembered -------------------------------------------------------------------


def test_the_default_preset_is_remembered_and_said_where_it_matters(tmp_path, monkeypatch, capsys):
    from tasks.cli import CLI_CONFIG_FILE

    run = tmp_path / "D"
    assert _main("plan", "--run-dir", run, NO_TRACKING) == 0
    assert json.loads((run / CLI_CONFIG_FILE).read_text()) == {"preset": "demo-cpu"}
    monkeypatch.setenv("LLM_PIPELINE_PRESET", "ci-tiny")  # another shell: the run keeps its preset, and says so
    capsys.readouterr()
    assert _main("plan", "--run-dir", run, NO_TRACKING) == 0
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("config: ")]
    assert said == [
        f"config: this run directory's (demo-cpu, from {run / CLI_CONFIG_FILE}); not $LLM_PIPELINE_PRESET's "
        "ci-tiny; --config to choose another"
    ]
    assert not json.loads((run / "plan" / "plan.json").read_text())["model"].startswith("debug ")  # not ci-tiny's
    # another --config here rebinds the directory: said (a plan of qwen2-7b-910b made the next smoke its, unsaid)
    assert _main("plan", "--run-dir", run, "--config", "ci-tiny", NO_TRACKING) == 0
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("config: ")]
    assert said == [
        f"config: --config ci-tiny, where this run directory's is demo-cpu (from {run / CLI_CONFIG_FILE}); once this "
        "stage succeeds the directory's is ci-tiny (a later stage here without --config takes it)"
    ]
    assert json.loads((run / CLI_CONFIG_FILE).read_text()) == {"preset": "ci-tiny"}
    assert _main("plan", "--run-dir", run, "--config", "ci-tiny", NO_TRACKING) == 0  # its own again: nothing to say
    assert not [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("config: ")]
    # its --set values apply under the same --config again: said (a user's earlier tasks and shots came back unsaid)
    assert _main("plan", "--run-dir", run, "--config", "ci-tiny", "--set", "train.lr=0.01", NO_TRACKING) == 0
    capsys.readouterr()
    assert _main("plan", "--run-dir", run, "--config", "ci-tiny", NO_TRACKING) == 0
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("config: ")]
    assert said == [
        f"config: --config ci-tiny with --set train.lr=0.01 (from {run / CLI_CONFIG_FILE}); --set a key again to "
        "change it"
    ]


# ---- 8. list-of-text --set values -----------------------------------------------------------------------------------


def test_list_of_text_items_keep_their_spaces():
    from tasks.config import load_config

    assert load_config("demo-cpu", sets=["evaluate.prompts=def ,import "]).evaluate.prompts == ["def ", "import "]
    assert load_config("demo-cpu", sets=['evaluate.prompts=["a, b", "c "]']).evaluate.prompts == ["a, b", "c "]
    assert load_config("demo-cpu", sets=["plan.zero_stages=0, 1"]).plan.zero_stages == [0, 1]


# ---- 9. the stopped-training line troubleshooting quotes ------------------------------------------------------------


def test_troubleshooting_quotes_the_stopped_training_line():
    source = (REPO / "tasks" / "stages" / "train.py").read_text()
    doc = (REPO / "docs" / "troubleshooting.md").read_text()
    printed = "training stopped: {disk}; not retried: fix the disk, then rerun (it resumes from"
    assert printed in source
    assert printed.replace("{disk}", "<cause>") in doc
    assert "rank 1: OSError: [Errno 30] Read-only file system" in doc


# ---- 10. a typo in LLM_PIPELINE_PRESET ------------------------------------------------------------------------------


def test_an_unknown_preset_from_the_environment_names_the_variable(monkeypatch):
    from tasks.config import load_config
    from tasks.errors import ConfigError

    monkeypatch.setenv("LLM_PIPELINE_PRESET", "ci-tin")
    with pytest.raises(ConfigError, match=r"unknown preset 'ci-tin' from \$LLM_PIPELINE_PRESET \(known: "):
        load_config()
    with pytest.raises(ConfigError) as err:
        load_config("ci-tin")
    assert "LLM_PIPELINE_PRESET" not in str(err.value)


@pytest.mark.slow
def test_a_train_rerun_re_exports_a_corrupt_export(cfg, tmp_path, shards):  # noqa: F811
    """docs/troubleshooting.md's fix for a corrupt hf/ file: rerun train. A real 2-step run (one rank) exports; one
    byte of its weights flipped, the rerun does not hand it back: it exports again, and the files verify."""
    from tasks.model.model_dir import verify
    from tasks.stages import train
    from tests.helpers.train_fixture import configure, context

    c = configure(cfg, **{"train.steps": 2, "parallel.dp": 1, "hardware.nproc_per_node": 1})
    run = tmp_path / "run"
    assert not train.run(c, context(run, shards, no_export=False))["reused"]
    weights = sorted((run / "hf").glob("*.safetensors"))[0]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert not train.run(c, context(run, shards, no_export=False))["reused"]
    verify(run / "hf")


# ---- a data.* value a later stage cannot apply -----------------------------------------------------------------------


def test_a_data_value_a_later_stage_cannot_apply_is_refused_not_remembered(tmp_path, capsys, shards):  # noqa: F811
    """`train --set data.inputs=[…] data.max_documents=5` on a built set trained on that set as it is, exit 0, and
    cli-config.json (and MLflow) kept the new values as the run's data. Only the shard stage builds a set: each such
    value is one line, exit 2, nothing remembered; the set's own values (and the loader's keys) still pass."""
    from tasks.cli import CLI_CONFIG_FILE

    run = tmp_path / "D"
    common = ("--run-dir", run, NO_TRACKING, "--config", "ci-tiny", "--shard-dir", shards)
    assert _main("plan", "--run-dir", run, NO_TRACKING, "--config", "ci-tiny") == 0
    remembered = (run / CLI_CONFIG_FILE).read_text()
    capsys.readouterr()
    assert _main("train", *common, "--set", "data.inputs=[/usr/share/doc]", "data.max_documents=5") == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: data.inputs: /usr/share/doc differs from the shard set train reads (")
        and "\n" not in err
    )
    assert "; data.max_documents: 5 differs from the shard set train reads (" in err
    assert "only the shard stage builds a set: rerun `python -m tasks shard` with it (then train)" in err
    assert (run / CLI_CONFIG_FILE).read_text() == remembered
