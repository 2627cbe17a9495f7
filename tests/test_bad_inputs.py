"""Bad inputs and faults across the CLI, config, data, training, tracking, DAG Params and `make run`: each must exit
non-zero with one line naming the cause (and the fix), and lose nothing completed.

"Nothing completed is lost": a run directory with a completed `plan` stage (built once, real) is the target of the
run-directory cases; every file it held before a failure is byte-identical afterwards. Most cases run the real
CLI entry point in-process (`tasks.cli.main`, exactly what `python -m tasks` runs) — fast, no torchrun; the
process-level ones (read-only disk, a lock held by another process, `make run`) start real processes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.train_fixture import BASE, shards  # noqa: F401

DP2 = {"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1, "hardware.nproc_per_node": 2}


def sets(d: dict) -> list[str]:
    return [a for k, v in d.items() for a in ("--set", f"{k}={v}")]


TRAIN = sets({**BASE, **DP2})


# ---- shared fixtures ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """A run directory holding one completed stage (plan), made by the real CLI."""
    from tasks.cli import main

    run = tmp_path_factory.mktemp("bad-inputs") / "run"
    assert main(["plan", "--no-tracking", "--run-dir", str(run)]) == 0
    return run


def _failure_record(p: Path) -> bool:
    if p.suffix != ".json" or p.parent.name == "plan":
        return False
    try:
        return json.loads(p.read_text()).get("status") == "failed"
    except (ValueError, AttributeError):
        return False


def snapshot(run: Path) -> dict[str, str]:
    """sha256 of every completed file (an earlier case's failure record and the lock file are not completed work)."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != ".lock" and not _failure_record(p)
    }


@pytest.fixture
def intact(done):
    """Yields the completed run directory; afterwards every file it held is unchanged."""
    before = snapshot(done)
    assert "plan.json" in before
    yield done
    after = snapshot(done)
    lost = {k for k in before if after.get(k) != before[k]}
    assert not lost, f"completed work changed or lost: {sorted(lost)}"


def run_cli(capsys, *argv) -> tuple[int, list[str]]:
    from tasks.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith(("warning: ", "progress: "))]
    return rc, err


def one_line(rc: int, err: list[str], *expected: str, status: int = 2) -> None:
    assert rc == status, (rc, err)
    assert len(err) == 1, err
    assert err[0].startswith("error: "), err
    for e in expected:
        assert e in err[0], (e, err[0])
    assert "Traceback" not in err[0]


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory, shards):  # noqa: F811
    """Broken copies of the tiny shard set, by name."""
    base = tmp_path_factory.mktemp("bad-data")
    out = {}

    def copy(name):
        d = base / name
        shutil.copytree(shards, d)
        out[name] = d
        return d

    d = copy("missing-shard")
    sorted(d.glob("train-*.tar"))[1].unlink()
    d = copy("truncated-shard")
    v = sorted(d.glob("train-*.tar"))[0]
    v.write_bytes(v.read_bytes()[:1000])
    d = copy("altered-shard")
    v = sorted(d.glob("train-*.tar"))[0]
    b = bytearray(v.read_bytes())
    b[len(b) // 2] ^= 0xFF
    v.write_bytes(bytes(b))
    d = copy("manifest-not-json")
    (d / "manifest.json").write_text("{ not json")
    d = copy("manifest-old-format")
    m = json.loads((d / "manifest.json").read_text())
    m["format"] = "llm-pipeline-shards/0"
    (d / "manifest.json").write_text(json.dumps(m))
    out["empty-dir"] = base / "empty-dir"
    out["empty-dir"].mkdir()
    gz = base / "corpus.jsonl.gz"
    raw = gzip.compress(
        b"".join(json.dumps({"text": f"document number {i} " * 20}).encode() + b"\n" for i in range(400))
    )
    gz.write_bytes(raw[: len(raw) * 2 // 3])
    out["truncated-gz"] = gz
    bad_yaml = base / "bad.yaml"
    bad_yaml.write_text("train:\n  lr: [1, 2\n")
    out["bad-yaml"] = bad_yaml
    dup = base / "dup.yaml"
    dup.write_text("train:\n  lr: 1e-3\n  steps: 4\n  lr: 2e-3\n")
    out["dup-yaml"] = dup
    list_yaml = base / "list.yaml"
    list_yaml.write_text("- train\n- lr\n")
    out["list-yaml"] = list_yaml
    return out


# ---- the CLI and the config -----------------------------------------------------------------------------------------

CONFIG_CASES = [
    (["trian"], ["unknown stage 'trian'"]),
    (["plan", "--config", "/etc/passwd"], ["--config /etc/passwd: not a YAML preset"]),
    (["plan", "--config", "/nonexistent/x.yaml"], ["config file /nonexistent/x.yaml does not exist"]),
    (["plan", "--config", "no-such-preset"], ["unknown preset 'no-such-preset'", "known: "]),
    (["plan", "--config", "@bad-yaml"], ["is not valid YAML"]),
    (["plan", "--config", "@list-yaml"], ["expected a mapping of sections, got list"]),
    (["plan", "--set", "train.steps"], ["--set 'train.steps': expected section.key=value"]),
    (["plan", "--set", "trian.steps=3"], ["trian.steps: unknown section 'trian'"]),
    (["plan", "--set", "train.stpes=3"], ["train.stpes: unknown key"]),
    (["plan", "--set", "train.steps=abc"], ["train.steps: expected an integer, got 'abc'"]),
    (["plan", "--set", "train.lr=nan"], ["train.lr: expected a finite number"]),
    (["plan", "--set", "train.steps=0"], ["train.steps"]),
    (["plan", "--set", "hardware.device=tpu"], ["hardware.device"]),
    (["plan", "--set", "data.verify_sha256=maybe"], ["data.verify_sha256: expected true/false"]),
    # issue 26: every numeric field is bounded; the line names the setting and its range
    (["plan", "--set", "train.steps=1e24"], ["train.steps: 1e+24 must be in [1, 1000000000]"]),
    (["plan", "--set", "train.seed=-1"], ["train.seed: -1 must be in [0, 4294967295]"]),
    (["plan", "--set", "train.timeout_s=-1"], ["train.timeout_s: -1 must be in [1, 10000000]"]),
    (["plan", "--set", "train.min_lr=-0.05"], ["train.min_lr: -0.05 must be in [0.0, 10000.0]"]),
    (["plan", "--set", "smoke.micro_batch=0"], ["smoke.micro_batch: 0 must be in [1, 1048576]"]),
    (["plan", "--set", "evaluate.max_new_tokens=-3"], ["evaluate.max_new_tokens: -3 must be in [1, 1048576]"]),
    (["plan", "--set", "evaluate.latency_tokens=0"], ["evaluate.latency_tokens: 0 must be in [1, 1048576]"]),
    (["plan", "--set", "hardware.probe_sizes_mb=0,4"], ["hardware.probe_sizes_mb[0]: 0 must be in (0.0, 100000.0]"]),
    (["plan", "--set", "timeouts.train_s=1e12"], ["timeouts.train_s: 1000000000000 must be in [0, 10000000]"]),
    (["plan", "--config", "@dup-yaml"], ["dup.yaml: key 'lr' appears twice (lines 2 and 4); keep one"]),
]


@pytest.mark.parametrize("argv, expected", CONFIG_CASES, ids=[" ".join(c[0]) for c in CONFIG_CASES])
def test_cli_and_config(argv, expected, capsys, intact, bad_data):
    argv = [str(bad_data[a[1:]]) if a.startswith("@") else a for a in argv]
    one_line(
        *run_cli(capsys, *argv, "--no-tracking", "--run-dir", intact) if argv[0] != "trian" else run_cli(capsys, *argv),
        *expected,
    )


def test_every_numeric_field_is_bounded_on_both_sides():
    """Walk every section: an int or float field without a lower and an upper bound is how steps=1e24 got in."""
    import typing

    from tasks.config import PipelineConfig

    loose = []
    for name, section in PipelineConfig.model_fields.items():
        model = section.annotation
        if not hasattr(model, "model_fields"):  # `preset`: a string
            continue
        for key, f in model.model_fields.items():
            ann = f.annotation
            item = typing.get_args(ann)[0] if typing.get_origin(ann) is list else None
            if item is not None and typing.get_origin(item) is typing.Annotated:
                ann, meta = typing.get_args(item)[0], [m for i in typing.get_args(item)[1:] for m in i.metadata]
            else:
                meta = f.metadata
            optional = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(optional) == 1 and len(typing.get_args(ann)) == 2:  # `int | None`: unset, or a bounded int
                ann = optional[0]
            if ann not in (int, float):
                continue
            lo = any(getattr(m, k, None) is not None for m in meta for k in ("ge", "gt"))
            hi = any(getattr(m, k, None) is not None for m in meta for k in ("le", "lt"))
            if not (lo and hi):
                loose.append(f"{name}.{key}")
    assert not loose, f"unbounded numeric fields: {loose}"


def test_empty_run_dir_is_refused(capsys):
    one_line(*run_cli(capsys, "plan", "--no-tracking", "--run-dir", ""), "--run-dir is empty")


def test_summary_of_a_missing_run_dir_fails(capsys, tmp_path):
    one_line(
        *run_cli(capsys, "summary", "--run-dir", tmp_path / "nowhere"),
        f"summary: --run-dir '{tmp_path / 'nowhere'}' is not a directory (no run there)",
    )


def test_registered_model_name_mlflow_refuses_fails_the_first_stage(capsys, intact):
    """Checked by MLflow's own rule before the first stage runs (tracking on), not by evaluate after the whole run."""
    one_line(
        *run_cli(capsys, "plan", "--run-dir", intact, "--set", "evaluate.registered_model=team/model:v1"),
        "evaluate.registered_model: 'team/model:v1' is refused by MLflow's Model Registry (Invalid model name "
        "'team/model:v1'. Names cannot contain '/' or ':'.); choose another",
    )


def test_yaml_exponent_is_a_number_not_a_string(tmp_path):
    """PyYAML's YAML 1.1 reads `1e-4` as a string; the config reads it as the float everyone means."""
    from tasks.config import load_config

    f = tmp_path / "p.yaml"
    f.write_text("train:\n  lr: 1e-3\n  min_lr: 1E-5\n")
    cfg = load_config(str(f), sets=["train.warmup_steps=1e1"])
    assert (cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps) == (1e-3, 1e-5, 10)


# ---- the environment: run directories, disks, locks -----------------------------------------------------------------


def test_run_dir_is_a_file(capsys, intact):
    one_line(
        *run_cli(capsys, "plan", "--no-tracking", "--run-dir", intact / "plan.json"),
        f"--run-dir {intact / 'plan.json'} is a file, not a directory",
    )


def test_run_dir_below_a_file(capsys, intact):
    one_line(
        *run_cli(capsys, "plan", "--no-tracking", "--run-dir", intact / "plan.json" / "sub"),
        "Not a directory (ENOTDIR)",
    )


def test_copied_run_dir_is_refused(capsys, intact, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(intact, copy)
    one_line(
        *run_cli(capsys, "plan", "--no-tracking", "--run-dir", copy),
        f"run directory {copy} was copied or moved from {intact}",
        "use a new --run-dir",
    )
    assert snapshot(copy) == {k: v for k, v in snapshot(intact).items()}


def test_read_only_var_dir(tmp_path, monkeypatch, capsys):
    if os.geteuid() == 0:
        d = tmp_path / "ro"
        d.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)]).returncode:
            pytest.skip("cannot mount a read-only tmpfs")
    else:
        d = tmp_path / "ro"
        d.mkdir(mode=0o555)
    try:
        monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(d))
        rc, err = run_cli(capsys, "plan", "--no-tracking")
        one_line(rc, err, f"{d}/runs", "point LLM_PIPELINE_VAR_DIR")
        assert "(EROFS)" in err[0] or "(EACCES)" in err[0]
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(d)])


def test_run_dir_held_by_another_process(capsys, intact):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from tasks.procs import RunDirLock\n"
            f"with RunDirLock({str(intact)!r}, 'train'):\n print('held', flush=True); "
            "time.sleep(60)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        one_line(*run_cli(capsys, "plan", "--no-tracking", "--run-dir", intact), f"is in use by pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()


# ---- data ----------------------------------------------------------------------------------------------------------

DATA_CASES = [
    ("smoke", "empty-dir", ["is not a shard set (no manifest.json)"]),
    ("train", "empty-dir", ["is not a shard set (no manifest.json)"]),
    ("train", "missing-shard", ["shards: shard ", "is missing"]),
    ("train", "truncated-shard", ["is truncated or altered: 1000 bytes"]),
    ("train", "manifest-not-json", ["manifest.json is unreadable"]),
    ("train", "manifest-old-format", ["format 'llm-pipeline-shards/0' is not", "rebuild the shard set"]),
    # no trained model here: "no trained model: run the train stage first", or, after the train cases above failed in
    # this directory, "the train stage's last attempt here failed (…)": either way the fix is train or --model-dir
    ("quantize", "empty-dir", ["quantize: ", "train", "or pass --model-dir"]),
]


@pytest.mark.parametrize("stage, data, expected", DATA_CASES, ids=[f"{c[0]}-{c[1]}" for c in DATA_CASES])
def test_bad_shard_sets(stage, data, expected, capsys, intact, bad_data):
    one_line(
        *run_cli(capsys, stage, "--no-tracking", "--run-dir", intact, "--shard-dir", bad_data[data], *TRAIN), *expected
    )


def test_altered_shard_bytes_with_verify_on(capsys, intact, bad_data):
    victim = sorted(bad_data["altered-shard"].glob("train-*.tar"))[0]
    one_line(
        *run_cli(
            capsys,
            "train",
            "--no-tracking",
            "--run-dir",
            intact,
            "--shard-dir",
            bad_data["altered-shard"],
            *TRAIN,
            "--set",
            "data.verify_sha256=true",
        ),
        f"shard {victim} is corrupt: sha256 differs from the manifest",
    )


def test_seq_len_differs_from_the_shard_set(capsys, intact, shards):  # noqa: F811
    one_line(
        *run_cli(
            capsys,
            "train",
            "--no-tracking",
            "--run-dir",
            intact,
            "--shard-dir",
            shards,
            *TRAIN,
            "--set",
            "data.seq_len=64",
        ),
        "data.seq_len: 64 differs from the shard set's 32",
    )


def test_truncated_jsonl_gz_is_refused_not_half_used(bad_data, tmp_path):
    from data_prep.build import build_shard_set
    from data_prep.config import ShardConfig
    from data_prep.errors import DataPrepError

    cfg = ShardConfig(
        inputs=[str(bad_data["truncated-gz"])],
        out_dir=str(tmp_path / "data"),
        vocab_size=300,
        seq_len=32,
        tokenize_processes=1,
        progress=False,
        shard_multiple=1,
    )
    with pytest.raises(DataPrepError) as e:
        build_shard_set(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"input {bad_data['truncated-gz']} is truncated or corrupt after ")
    assert "EOFError" in msg and "re-download" in msg
    assert not list((tmp_path / "data").rglob("manifest.json"))  # no shard set was published


def test_shard_stage_missing_input(capsys, intact, tmp_path):
    one_line(
        *run_cli(
            capsys,
            "shard",
            "--no-tracking",
            "--run-dir",
            intact,
            "--set",
            f"data.inputs={tmp_path}/nowhere/*.txt",
            "--set",
            f"data.out_dir={tmp_path}/data",
        ),
        "shard: ",
        "nowhere",
    )


# ---- training (all refused before a worker starts) -------------------------------------------------------------------

TRAIN_CASES = [
    ({"parallel.tp": 3, "hardware.nproc_per_node": 3, "parallel.dp": 1}, "parallel.tp: 3 does not divide"),
    ({"parallel.dp": 2, "parallel.tp": 2}, "≠ world size 2"),
    ({"parallel.pp": 4, "hardware.nproc_per_node": 4, "parallel.dp": 1}, "pipeline stages exceed the model's"),
]


@pytest.mark.parametrize("extra, expected", TRAIN_CASES, ids=[str(c[0]) for c in TRAIN_CASES])
def test_bad_training_layouts(extra, expected, capsys, intact, shards):  # noqa: F811
    one_line(
        *run_cli(capsys, "train", "--no-tracking", "--run-dir", intact, "--shard-dir", shards, *TRAIN, *sets(extra)),
        expected,
    )
    assert not (intact / "logs" / "torchrun.log").exists()  # no worker was started


@pytest.mark.parametrize("fault", ["x", "1", "1:2:boom", "a:b", "1:2:3:4", "²:1", "١:2"])
def test_malformed_fault_injection_is_refused(fault, capsys, intact, shards, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LLM_PIPELINE_FAULT", fault)
    one_line(
        *run_cli(capsys, "train", "--no-tracking", "--run-dir", intact, "--shard-dir", shards, *TRAIN),
        f"LLM_PIPELINE_FAULT={fault!r} is malformed: expected RANK:STEP",
    )


def test_fault_injection_on_a_rank_outside_the_world_is_refused(capsys, intact, shards, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LLM_PIPELINE_FAULT", "5:1")
    one_line(
        *run_cli(capsys, "train", "--no-tracking", "--run-dir", intact, "--shard-dir", shards, *TRAIN),
        "LLM_PIPELINE_FAULT='5:1': rank 5 does not exist (world size 2); use a rank below 2",
    )


def test_checkpoint_of_another_model(capsys, tmp_path, shards):  # noqa: F811
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 2, "model": {"dim": 999}}))
    one_line(
        *run_cli(capsys, "train", "--no-tracking", "--run-dir", run, "--shard-dir", shards, *TRAIN),
        "written for another model shape",
        "use --fresh",
    )
    assert (step / "meta.json").is_file()  # the checkpoint is kept


def test_evaluate_without_a_quantized_model(capsys, intact, shards):  # noqa: F811
    one_line(
        *run_cli(capsys, "evaluate", "--no-tracking", "--run-dir", intact, "--shard-dir", shards),
        "evaluate: no quantized model: run the quantize stage first",
    )


# ---- tracking ------------------------------------------------------------------------------------------------------


def test_unreachable_tracking_server(capsys, intact):
    from tests.helpers.ports import free_port

    port = free_port()  # nothing listens there
    one_line(
        *run_cli(capsys, "plan", "--run-dir", intact, "--set", f"tracking.uri=http://127.0.0.1:{port}"),
        f"MLflow tracking server http://127.0.0.1:{port} is unreachable",
        "tracking.uri",
    )


# ---- DAG Params (the function every DAG task calls first) ------------------------------------------------------------

PARAM_CASES = [
    ({"steps": 1e24}, "train.steps: 1e+24 must be in [1, 1000000000]"),
    ({"registered_model": "a/b"}, "evaluate.registered_model: 'a/b' is refused by MLflow's Model Registry"),
    ({"registered_model": "50%"}, "Registered model name cannot contain '%' character"),
    ({"stpes": 5}, "unknown DAG Param 'stpes'"),
    ({"steps": 5, "lr ": 1e-3, "dp2": 2}, "unknown DAG Params 'dp2', 'lr '"),
    ({"steps": "many"}, "train.steps: expected an integer, got 'many'"),
    ({"preset": "no-such"}, "unknown preset 'no-such'"),
    ({"device": "tpu"}, "hardware.device"),
    ({"lr": -1}, "train.lr"),
]


@pytest.mark.parametrize("params, expected", PARAM_CASES, ids=[json.dumps(c[0]) for c in PARAM_CASES])
def test_bad_dag_params(params, expected):
    from tasks.errors import StageError
    from tasks.pipeline import config_for_params

    with pytest.raises(StageError) as e:
        config_for_params(params)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert not e.value.retryable


@pytest.mark.slow
def test_unknown_conf_key_fails_the_real_dag_run(tmp_path, airflow_db):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}",
    }
    cmd = "source scripts/airflow-env.sh && airflow dags test llm_pipeline --conf '{\"stpes\": 3}'"
    out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    text = out.stdout + out.stderr
    assert out.returncode != 0 or "state=failed" in text.replace(" ", ""), text[-2000:]
    assert "unknown DAG Param 'stpes'" in text, text[-3000:]
    assert not (tmp_path / "var" / "runs").exists() or not list((tmp_path / "var" / "runs").rglob("*.json"))


# ---- make run ------------------------------------------------------------------------------------------------------

MAKE_CASES = [
    ("[1]", "must be a JSON object of DAG Params, not list"),
    ("null", "must be a JSON object of DAG Params, not NoneType"),
    ("{", "is not JSON"),
    ('{"stpes": 3}', "unknown DAG Param 'stpes'"),
    ('{"preset": "no-such"}', "unknown preset 'no-such'"),
    ('{"steps": -4}', "train.steps"),
    ('{"steps": 1e24}', "train.steps: 1e+24 must be in [1, 1000000000]"),
]


@pytest.mark.parametrize("conf, expected", MAKE_CASES, ids=[c[0] for c in MAKE_CASES])
def test_make_run_bad_conf(conf, expected, tmp_path):
    from tests.helpers.make import make_run

    out = make_run(conf, tmp_path)
    lines = [ln for ln in (out.stdout + out.stderr).strip().splitlines() if not ln.startswith("make: ***")]
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: CONF {conf}: ") and expected in lines[0], lines
    assert not (tmp_path / "var" / "runs").exists()  # refused before Airflow started


# ---- issue 26: nothing completed deleted, no corrupt model read as whole, identities enforced -----------------------


def _fake_run(run: Path) -> Path:
    """A run directory holding completed training outputs (a checkpoint, metrics, train/)."""
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "meta.json").write_text(json.dumps({"step": 2}))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (run / "train").mkdir()
    (run / "train" / "summary.json").write_text("{}")
    return run


def test_fresh_with_a_bad_layout_loses_nothing(capsys, tmp_path, shards):  # noqa: F811
    """On main `--fresh --set parallel.dp=3` on a 2-rank host deleted checkpoints/, metrics.jsonl and train/ first."""
    run = _fake_run(tmp_path / "run")
    before = snapshot(run)
    one_line(
        *run_cli(
            capsys,
            "train",
            "--no-tracking",
            "--run-dir",
            run,
            "--shard-dir",
            shards,
            *TRAIN,
            "--fresh",
            "--set",
            "parallel.dp=3",
        ),
        "parallel: dp 3 × tp 1 × pp 1 = 3 ≠ world size 2",
    )
    after = snapshot(run)
    assert {k: after.get(k) for k in before} == before and not (run / ".fresh-old").exists()


def test_fresh_sets_old_outputs_aside_until_the_first_checkpoint(cfg, tmp_path, shards):  # noqa: F811
    import argparse

    from tasks.runner import StageContext
    from tasks.stages import train
    from tests.helpers.train_fixture import configure

    run = _fake_run(tmp_path / "run")
    before = snapshot(run)
    ctx = StageContext(run, "train", argparse.Namespace(shard_dir=str(shards), fresh=True, no_export=True))
    spec = train.prepare(configure(cfg, **DP2), ctx)
    assert spec["resume_from"] is None and any("kept in" in w and ".fresh-old" in w for w in spec["warnings"])
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    assert {k.removeprefix(".fresh-old/"): v for k, v in snapshot(run).items()} == before  # moved, not lost
    (run / "metrics.jsonl").write_text("{}\n")  # a fresh attempt that died before its first checkpoint …
    train.prepare(configure(cfg, **DP2), ctx)  # … and --fresh again: the set-aside (the real old run) is kept
    assert (run / ".fresh-old" / "checkpoints" / "step-2" / "meta.json").is_file()
    (run / "checkpoints" / "step-1").mkdir(parents=True)  # the new run's first complete checkpoint
    (run / "checkpoints" / "step-1" / "meta.json").write_text("{}")
    train.drop_set_aside(run)
    assert not (run / ".fresh-old").exists()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, shards):  # noqa: F811
    """A small export with our manifest (save_hf, tokenizer from `shards`) and copies to break."""
    from tasks.model import build_model, materialize
    from tasks.model.config import get_preset
    from tasks.model.hf_io import save_hf

    root = tmp_path_factory.mktemp("hf")
    tcfg = get_preset("debug")
    tcfg.vocab_size = 512
    save_hf(materialize(build_model(tcfg, "cpu"), "cpu", seed=0), root / "good", tokenizer_dir=shards)
    return root


def _broken(hf_dirs, tmp_path, manifest: bool = True) -> Path:
    d = tmp_path / "model"
    shutil.copytree(hf_dirs / "good", d)
    if not manifest:
        (d / "llm-pipeline.json").unlink()  # as transformers saves it: structural checks only
    return d


def _rewrite_header(path: Path, change) -> None:
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _last_tensor(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def test_export_shard_cut_in_half_is_named(capsys, tmp_path, hf_dirs, shards):  # noqa: F811
    """On main: quantize ok, half of lm_head read as zeros, the gate passed."""
    d = _broken(hf_dirs, tmp_path)
    f = d / "model.safetensors"
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[: size // 2])
    want = f"{f} is truncated or altered ({size // 2} bytes, {size} recorded in llm-pipeline.json); re-export the model"
    one_line(
        *run_cli(
            capsys, "quantize", "--no-tracking", "--run-dir", tmp_path / "r", "--model-dir", d, "--shard-dir", shards
        ),
        want,
    )
    one_line(
        *run_cli(
            capsys,
            "train",
            "--no-tracking",
            "--run-dir",
            tmp_path / "t",
            "--shard-dir",
            shards,
            *TRAIN,
            "--set",
            f"model.hf_path={d}",
            "--set",
            "model.preset=debug",
        ),
        want,
    )


def _header_case(name):
    def past_end(h):  # a lying header: the last tensor claims twice its rows, past the end of the file
        t = h[_last_tensor(h)]
        a, b = t["data_offsets"]
        t["shape"][0] *= 2
        t["data_offsets"] = [a, a + 2 * (b - a)]

    def f8(h):
        h[_last_tensor(h)]["dtype"] = "F8_E4M3"

    return {"past-end": past_end, "f8": f8}[name]


HEADER_CASES = [
    ("cut", "ends at byte {end}, past the end of the file ({size} bytes)"),
    ("past-end", "ends at byte {end}, past the end of the file ({size} bytes)"),
    (
        "f8",
        "has dtype 'F8_E4M3', which is not supported (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL); "
        "convert the checkpoint to bf16 or fp32",
    ),
    ("huge-header", "header length 1099511627776 bytes exceeds safetensors' limit of 100000000"),
]


@pytest.mark.parametrize("case, expected", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_lying_or_truncated_safetensors_without_manifest(case, expected, capsys, tmp_path, hf_dirs, shards):  # noqa: F811
    import struct

    d = _broken(hf_dirs, tmp_path, manifest=False)
    f = d / "model.safetensors"
    (n,) = struct.unpack("<Q", f.read_bytes()[:8])
    header = json.loads(f.read_bytes()[8 : 8 + n])
    last = _last_tensor(header)
    if case == "huge-header":
        f.write_bytes(struct.pack("<Q", 1 << 40) + f.read_bytes()[8:])
    elif case == "cut":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        _rewrite_header(f, _header_case(case))
    if case != "huge-header":
        (n2,) = struct.unpack("<Q", f.read_bytes()[:8])
        end = 8 + n2 + json.loads(f.read_bytes()[8 : 8 + n2])[last]["data_offsets"][1]
    else:
        end = None
    msg = expected.format(end=end, size=f.stat().st_size)
    where = f"{f}: " if case == "huge-header" else f"{f}: tensor {last!r} "
    one_line(
        *run_cli(
            capsys, "quantize", "--no-tracking", "--run-dir", tmp_path / "r", "--model-dir", d, "--shard-dir", shards
        ),
        where,
        msg,
    )


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A shard set of the same vocabulary size made by another tokenizer (BPE trained on other documents)."""
    from data_prep.testing import tiny_shard_set

    return tiny_shard_set(tmp_path_factory.mktemp("other-tok"), n_docs=25)


def _identity(d) -> str:
    from tasks.model.model_dir import shard_tokenizer

    return shard_tokenizer(d)


def test_quantize_on_another_tokenizers_shard_set(capsys, tmp_path, hf_dirs, shards, other_tokenizer):  # noqa: F811
    d = hf_dirs / "good"
    assert json.loads((other_tokenizer / "manifest.json").read_text())["vocab_size"] == 512
    one_line(
        *run_cli(
            capsys, "quantize", "--no-tracking", "--run-dir", tmp_path, "--model-dir", d, "--shard-dir", other_tokenizer
        ),
        f"quantize: the model {d} was trained with tokenizer {_identity(shards)}, but the shard set "
        f"{other_tokenizer} was made by tokenizer {_identity(other_tokenizer)}: its token ids mean other tokens",
    )


def test_evaluate_a_quantized_model_of_another_tokenizer(capsys, tmp_path, hf_dirs, shards, other_tokenizer):  # noqa: F811
    from tasks.model.hf_io import load_hf, save_hf

    model = tmp_path / "model-other"  # the same weights exported with the other tokenizer: the model check passes
    save_hf(load_hf(hf_dirs / "good"), model, tokenizer_dir=other_tokenizer)
    q = tmp_path / "quantize"
    q.mkdir()
    (q / "quant_meta.json").write_text(
        json.dumps(
            {
                "model_dir": str(model),
                "shard_dir": str(shards),
                "format": "torch_state_dict",
                "tokenizer": [_identity(shards)],
            }
        )
    )
    one_line(
        *run_cli(
            capsys,
            "evaluate",
            "--no-tracking",
            "--run-dir",
            tmp_path,
            "--quant-dir",
            q,
            "--model-dir",
            model,
            "--shard-dir",
            other_tokenizer,
        ),
        f"evaluate: the quantized model {q} was trained with tokenizer {_identity(shards)}, but the shard set "
        f"{other_tokenizer} was made by tokenizer {_identity(other_tokenizer)}",
    )


def test_resume_on_another_tokenizers_shard_set(cfg, capsys, tmp_path, shards, other_tokenizer):  # noqa: F811
    from tasks.stages import train
    from tests.helpers.train_fixture import configure, context

    model = train.prepare(configure(cfg, **DP2), context(tmp_path / "probe", shards))["model"]
    step = tmp_path / "run" / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 2, "model": model, "tokenizer": _identity(shards)}))
    one_line(
        *run_cli(
            capsys, "train", "--no-tracking", "--run-dir", tmp_path / "run", "--shard-dir", other_tokenizer, *TRAIN
        ),
        f"checkpoint {step} was trained with tokenizer {_identity(shards)}, but the shard set {other_tokenizer} was "
        f"made by tokenizer {_identity(other_tokenizer)}: its token ids mean other tokens; resume on the shard set it "
        "was trained on, or start over with --fresh",
    )
    assert (step / "meta.json").is_file()


def test_smoke_from_an_export_of_another_tokenizer(capsys, tmp_path, hf_dirs, shards, other_tokenizer):  # noqa: F811
    d = hf_dirs / "good"
    one_line(
        *run_cli(
            capsys,
            "smoke",
            "--no-tracking",
            "--run-dir",
            tmp_path,
            "--shard-dir",
            other_tokenizer,
            "--set",
            f"model.hf_path={d}",
            "--set",
            "hardware.device=cpu",
        ),
        f"model.hf_path {d} was trained with tokenizer {_identity(shards)}, but the shard set {other_tokenizer}",
    )


def test_checkpoint_state_that_needs_pickle_is_refused(cfg, capsys, tmp_path, shards):  # noqa: F811
    """loader-dp*.pt / rng-*.pt were unpickled with weights_only=False: whoever could write the run directory ran
    code as the trainer. Now they load with weights_only=True; a file that needs more is refused in one line."""
    import argparse

    import torch

    from tasks.stages import train
    from tests.helpers.train_fixture import configure, context

    model = train.prepare(configure(cfg, **DP2), context(tmp_path / "probe", shards))["model"]
    step = tmp_path / "run" / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 2, "model": model}))
    torch.save({"order": argparse.Namespace(evil=True)}, step / "loader-dp0.pt")
    one_line(
        *run_cli(capsys, "train", "--no-tracking", "--run-dir", tmp_path / "run", "--shard-dir", shards, *TRAIN),
        f"checkpoint {step / 'loader-dp0.pt'}: refused, loading it needs unsafe unpickling (it holds "
        "argparse.Namespace); resume from a checkpoint written by this version, or start over with --fresh",
        "resume from a checkpoint written by this version, or start over with --fresh",
    )


def test_checkpoint_loader_and_rng_state_round_trip_without_pickle(tmp_path):
    """The new format (loader JSON, RNG tensors) and the old one (pickled dicts of plain values) both load with
    weights_only=True and restore the same RNG streams."""
    import random

    import torch

    from tasks.parallel.checkpoint import _rng_state, _set_rng_state, load_loader_state, safe_load

    random.seed(7)
    torch.manual_seed(7)
    torch.save(_rng_state(), tmp_path / "rng-new.pt")
    old = {"torch": torch.get_rng_state(), "python": random.getstate()}
    torch.save(old, tmp_path / "rng-old.pt")
    want = (random.random(), torch.rand(3))
    for f in ("rng-new.pt", "rng-old.pt"):
        random.seed(0)
        torch.manual_seed(0)
        _set_rng_state(safe_load(tmp_path / f))
        got = (random.random(), torch.rand(3))
        assert got[0] == want[0] and torch.equal(got[1], want[1]), f
    torch.save({"order": "global/1", "epoch": 0, "samples": 16}, tmp_path / "loader-dp0.pt")
    assert load_loader_state(tmp_path)["samples"] == 16
    (tmp_path / "loader-dp0.json").write_text('{"order": "global/1", "epoch": 1, "samples": 8}')
    assert load_loader_state(tmp_path)["epoch"] == 1


def test_file_modes_ignore_the_umask(tmp_path):
    """Under umask 000 the run directory, its files and checkpoints were world-writable."""
    script = (
        "import os, sys; os.umask(0); from tasks.cli import main\n"
        f"sys.exit(main(['plan', '--no-tracking', '--run-dir', {str(tmp_path / 'run')!r}]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in tmp_path.rglob("*")}
    assert modes["run"] == "0o755" and modes["run/plan.json"] == "0o644", modes
    assert all(m == ("0o755" if (tmp_path / k).is_dir() else "0o644") for k, m in modes.items()), modes

    from tasks.fsutil import SECRET_MODE, atomic_write_text

    assert atomic_write_text(tmp_path / "s", "x", SECRET_MODE).stat().st_mode & 0o777 == 0o600
    db = tmp_path / "var" / "airflow.db"
    cmd = f"umask 000; LLM_PIPELINE_VAR_DIR={tmp_path / 'var'} AIRFLOW__DATABASE__SQL_ALCHEMY_CONN= "
    cmd += f"source scripts/airflow-env.sh && private_sqlite sqlite:///{tmp_path / 'var' / 'mlflow_auth.db'}"
    assert subprocess.run(["bash", "-c", cmd], cwd=REPO).returncode == 0
    assert oct(db.stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "var" / "mlflow_auth.db").stat().st_mode & 0o777) == "0o600"


def test_a_full_disk_seen_by_the_ranks_is_named_and_not_retried(tmp_path):
    from tasks.parallel.rank_errors import RankFailure, disk_fault

    failures = [RankFailure(0, 1, "OSError", "[Errno 28] No space left on device", "log"), RankFailure(1, -15)]
    assert disk_fault(tmp_path, failures) == f"{tmp_path}: rank 0: OSError: [Errno 28] No space left on device"
    assert disk_fault(tmp_path, [RankFailure(1, -9)]) is None  # a plain kill stays a retryable death


@pytest.mark.slow
def test_disk_full_during_training(tmp_path, shards):  # noqa: F811
    """A 3 MB run directory: step-1 fits, step-2's save fills the disk (the ranks can write neither their logs nor
    their error files). On main: "rank 0 died … a retry resumes", and step-2.tmp left behind on every retry."""
    if os.geteuid() != 0:
        pytest.skip("needs a small tmpfs (root)")
    d = tmp_path / "fs"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(d)]).returncode:
        pytest.skip("cannot mount a tmpfs")
    try:
        run = d / "run"
        argv = [
            "train",
            "--no-tracking",
            "--no-export",
            "--run-dir",
            run,
            "--shard-dir",
            shards,
            *TRAIN,
            *sets({"train.steps": 4, "train.checkpoint_every": 1}),
        ]
        out = subprocess.run(
            [sys.executable, "-m", "tasks", *map(str, argv)],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=600,
        )
        err = [ln for ln in out.stderr.strip().splitlines() if not ln.startswith(("warning: ", "progress: "))]
        one_line(
            out.returncode,
            err,
            f"training stopped: {run}: No space left on device (ENOSPC); free space on that filesystem or point "
            "LLM_PIPELINE_VAR_DIR / --run-dir elsewhere; not retried: fix the disk, then rerun (it resumes from "
            "checkpoint step-1)",
        )
        assert not list((run / "checkpoints").glob("*.tmp"))
    finally:
        subprocess.run(["umount", str(d)])


PROFILE_CASES = [("-5", "'-5'"), ("nan", "'nan'"), ("abc", "'abc'")]


@pytest.mark.parametrize("value, shown", PROFILE_CASES, ids=[c[0] for c in PROFILE_CASES])
def test_profile_rows_with_bad_durations(value, shown, capsys, tmp_path, fixtures_dir):
    """On main: `profile analyze` reported ok with total_us NaN."""
    src = tmp_path / "prof"
    shutil.copytree(fixtures_dir / "profiling" / "ascend_pt_old_healthy", src)
    f = next(src.rglob("step_trace_time.csv"))
    lines = f.read_text().splitlines()
    cells = lines[1].split(",")
    cells[1] = value
    lines[1] = ",".join(cells)
    f.write_text("\n".join(lines) + "\n")
    one_line(
        *run_cli(capsys, "profile", "analyze", src, "--no-tracking", "--run-dir", tmp_path / "r"),
        f"{f}: line 2, column 'Computing': {shown} is not a duration (must be a finite number >= 0)",
    )


def test_profile_trace_with_a_negative_duration(capsys, tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "ts": 0, "dur": -4}]}))
    one_line(
        *run_cli(capsys, "profile", "analyze", trace, "--no-tracking", "--run-dir", tmp_path / "r"),
        f"{trace}: event 'ProfilerStep#1' has duration -4 (must be a finite number >= 0)",
    )


@pytest.mark.parametrize("fs", ["read-only", "full"])
def test_make_db_on_an_unwritable_var_dir(fs, tmp_path):
    """`make run` migrates Airflow's DB first: on a read-only or full var/ that was a traceback and an earlier run's
    db-migrate.log shown as if it were this one's."""
    if os.geteuid() != 0:
        pytest.skip("needs a tmpfs (root)")
    d = tmp_path / "var"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)]).returncode:
        pytest.skip("cannot mount a tmpfs")
    try:
        (d / "logs").mkdir()
        (d / "logs" / "db-migrate.log").write_text("STALE LOG OF AN EARLIER RUN\n")
        if fs == "read-only":
            subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
        else:
            subprocess.run(["bash", "-c", f"head -c 1000000 /dev/zero > {d}/fill"])
        out = subprocess.run(
            ["bash", "scripts/migrate-db.sh"],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "LLM_PIPELINE_VAR_DIR": str(d)},
            timeout=120,
        )
        lines = (out.stdout + out.stderr).strip().splitlines()
        cause = "Read-only file system" if fs == "read-only" else "No space left on device"
        assert out.returncode == 2 and lines == [
            f"error: {d} is not writable ({cause}): free space or fix its permissions, or set LLM_PIPELINE_VAR_DIR "
            "to a writable directory"
        ], lines
    finally:
        subprocess.run(["umount", str(d)])


def test_a_file_cut_after_its_header_was_read_is_named(tmp_path, hf_dirs):
    """Every read's length is checked: a file truncated between reading its header and its rows is one line."""
    from tasks.errors import StageError
    from tasks.model.safetensors_io import read_header, read_tensor

    f = tmp_path / "m.safetensors"
    shutil.copy(hf_dirs / "good" / "model.safetensors", f)
    header = read_header(f)
    last = max(header, key=lambda k: header[k].start)
    with open(f, "r+b") as fh:
        fh.truncate(header[last].start + 10)
    with pytest.raises(StageError) as e:
        read_tensor(header, last)
    assert str(e.value) == (
        f"{f}: tensor {last!r}: read 10 of {header[last].nbytes} bytes (the file is truncated); re-export or re-copy it"
    )


@pytest.mark.parametrize("with_sha", [False, True])
def test_pickled_int8_module_is_never_unpickled_off_an_ascend_host(tmp_path, with_sha):
    """A quant_meta.json that says "torch_module" (AMCT's pickled deploy model) beside a pickle that runs code: on a
    host without AMCT it is refused before the file is opened, with or without a matching sha256 beside it."""
    import pickle

    from tasks.errors import StageError
    from tasks.quant.artifact import META, WEIGHTS, load_quantized

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / WEIGHTS).write_bytes(pickle.dumps(Payload()))
    meta = {"format": "torch_module", "int8_bytes": (tmp_path / WEIGHTS).stat().st_size}
    if with_sha:
        meta["weights_sha256"] = hashlib.sha256((tmp_path / WEIGHTS).read_bytes()).hexdigest()
    (tmp_path / META).write_text(json.dumps(meta))
    with pytest.raises(StageError) as e:
        load_quantized(tmp_path)
    assert not marker.exists() and "\n" not in str(e.value)
    want = "loads only where AMCT is installed" if with_sha else "without the sha256 its quantize stage records"
    assert want in str(e.value)


def test_a_warmup_longer_than_the_run_is_said(cfg, tmp_path, shards):  # noqa: F811
    """train.warmup_steps past train.steps: the run never trains at train.lr (nor decays) — a warning before launch
    naming both values and where the learning rate ends; a warm-up that ends at the last step says nothing."""
    from tasks.stages import train
    from tests.helpers.train_fixture import configure, context

    one = {"hardware.nproc_per_node": 1, "parallel.dp": 1, "train.steps": 6}
    spec = train.prepare(configure(cfg, **one, **{"train.warmup_steps": 100}), context(tmp_path / "long", shards))
    [note] = [w for w in spec["warnings"] if "warmup" in w]
    assert note.startswith(
        "train.warmup_steps 100 > train.steps 6: the learning rate never reaches train.lr 0.003 (it ends warming up "
        "at 0.00018)"
    ), note
    spec = train.prepare(configure(cfg, **one, **{"train.warmup_steps": 6}), context(tmp_path / "ok", shards))
    assert not any("warmup" in w for w in spec["warnings"])


def test_training_by_hand_after_a_failed_smoke_says_so(cfg, tmp_path, shards):  # noqa: F811
    """The DAG does not train a model smoke failed; `python -m tasks train` in that run directory trained it without
    a word. It still trains (the user asked), with a warning naming smoke's cause."""
    from tasks.stages import train
    from tests.helpers.train_fixture import configure, context

    one = {"hardware.nproc_per_node": 1, "parallel.dp": 1, "train.steps": 6}
    ctx = context(tmp_path / "run", shards)
    ctx.inputs["smoke"] = {"status": "failed", "error": "smoke: loss is NaN at step 2 in layers.0.attention"}
    [note] = [w for w in train.prepare(configure(cfg, **one), ctx)["warnings"] if "smoke" in w]
    assert note.startswith("the smoke stage failed in this run directory (smoke: loss is NaN at step 2 in layers.0.")
    ctx.inputs["smoke"] = {"status": "ok"}
    assert not any("smoke" in w for w in train.prepare(configure(cfg, **one), ctx)["warnings"])
