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

from conftest import REPO
from train_fixture import BASE, shards  # noqa: F401

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
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("warning: ")]
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
]


@pytest.mark.parametrize("argv, expected", CONFIG_CASES, ids=[" ".join(c[0]) for c in CONFIG_CASES])
def test_cli_and_config(argv, expected, capsys, intact, bad_data):
    argv = [str(bad_data[a[1:]]) if a.startswith("@") else a for a in argv]
    one_line(
        *run_cli(capsys, *argv, "--no-tracking", "--run-dir", intact) if argv[0] != "trian" else run_cli(capsys, *argv),
        *expected,
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
    ("quantize", "empty-dir", ["no trained model"]),
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
    ({"train.precision": "fp16"}, "train.precision: fp16 training needs a loss scaler"),
    ({"parallel.pp": 4, "hardware.nproc_per_node": 4, "parallel.dp": 1}, "pipeline stages exceed the model's"),
]


@pytest.mark.parametrize("extra, expected", TRAIN_CASES, ids=[str(c[0]) for c in TRAIN_CASES])
def test_bad_training_layouts(extra, expected, capsys, intact, shards):  # noqa: F811
    one_line(
        *run_cli(capsys, "train", "--no-tracking", "--run-dir", intact, "--shard-dir", shards, *TRAIN, *sets(extra)),
        expected,
    )
    assert not (intact / "logs" / "torchrun.log").exists()  # no worker was started


@pytest.mark.parametrize("fault", ["x", "1", "1:2:boom", "a:b", "1:2:3:4"])
def test_malformed_fault_injection_is_refused(fault, capsys, intact, shards, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LLM_PIPELINE_FAULT", fault)
    one_line(
        *run_cli(capsys, "train", "--no-tracking", "--run-dir", intact, "--shard-dir", shards, *TRAIN),
        f"LLM_PIPELINE_FAULT={fault!r} is malformed: expected RANK:STEP",
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
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one_line(
        *run_cli(capsys, "plan", "--run-dir", intact, "--set", f"tracking.uri=http://127.0.0.1:{port}"),
        f"MLflow tracking server http://127.0.0.1:{port} is unreachable",
        "tracking.uri",
    )


# ---- DAG Params (the function every DAG task calls first) ------------------------------------------------------------

PARAM_CASES = [
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
]


@pytest.mark.parametrize("conf, expected", MAKE_CASES, ids=[c[0] for c in MAKE_CASES])
def test_make_run_bad_conf(conf, expected, tmp_path):
    from test_make_run import make_run

    out = make_run(conf, tmp_path)
    lines = [ln for ln in (out.stdout + out.stderr).strip().splitlines() if not ln.startswith("make: ***")]
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: CONF {conf}: ") and expected in lines[0], lines
    assert not (tmp_path / "var" / "runs").exists()  # refused before Airflow started
