"""`python -m tasks …` as a user runs it: one-line errors with exit 2, help, the summary table."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def cli(*args, cwd=REPO):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "tasks", *args], cwd=cwd, capture_output=True, text=True, timeout=180, env=env
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["nope"], "error: unknown stage 'nope' (stages: env, shard, smoke, plan, train, profile, quantize, evaluate)"),
        (["plan", "--config", "nope"], "error: unknown preset 'nope'"),
        (["plan", "--set", "train.steps=zero"], "error: train.steps: expected an integer, got 'zero'"),
        # a mistyped flag: argparse's 18-line usage block before; one line naming the flag and where flags are listed
        (["plan", "--stpes", "3"], "error: python -m tasks plan: unrecognized arguments: --stpes 3 (`python -m tasks "),
        (["summary", "--run-dri", "x"], "error: python -m tasks summary: "),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    out = cli(*args)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and out.stderr.startswith(needle)


def test_json_prints_a_failed_stages_record_too(tmp_path):
    """--json on a failed or refused stage printed nothing on stdout (a script parsed an empty string): the failure
    record the runner wrote, else {stage, status, error}; stderr keeps its one line."""
    run = tmp_path / "r"
    out = cli("quantize", "--config", "ci-tiny", "--run-dir", str(run), "--json", "--no-tracking")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: quantize: no trained model: run the train stage first or pass --model-dir"
    ]
    assert json.loads(out.stdout) == json.loads((run / "quantize.json").read_text())
    assert json.loads(out.stdout)["status"] == "failed"
    refused = cli("plan", "--config", "ci-tiny", "--run-dir", str(run), "--json", "--set", "train.steps=yes")
    assert refused.returncode == 2 and json.loads(refused.stdout) == {
        "stage": "plan",
        "status": "failed",
        "error": "train.steps: expected an integer, got 'yes'",
    }


def test_the_dags_launcher_is_named_not_silently_ignored(tmp_path):
    """hardware.launcher routes the DAG's device tasks; the CLI runs a stage here (it is what each pod runs) and says
    so in one line before the stage's own (here: no shard set yet); a stage that never leaves the worker says
    nothing."""
    out = cli("smoke", "--run-dir", str(tmp_path), "--no-tracking", "--set", "hardware.launcher=kubernetes")
    note, error = out.stderr.strip().splitlines()
    assert note == (
        "note: hardware.launcher kubernetes sends the DAG's smoke task to a Kubernetes Job; `python -m tasks` runs "
        "the stage here, on this machine (what each pod runs)"
    )
    assert out.returncode == 2 and error.startswith("error: smoke: no shard set"), out.stderr
    out = cli("plan", "--run-dir", str(tmp_path), "--no-tracking", "--set", "hardware.launcher=kubernetes")
    assert out.returncode == 0 and "note:" not in out.stderr, out.stderr


def test_bad_yaml_file(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("data: {seq_len: 12\n")
    out = cli("plan", "--config", str(bad))
    assert out.returncode == 2 and "x.yaml" in out.stderr and "not valid YAML" in out.stderr


def test_help_lists_stages():
    out = cli("--help")
    assert out.returncode == 0 and "summary" in out.stdout and "evaluate" in out.stdout


def test_summary_table(tmp_path):
    (tmp_path / "env.json").write_text(
        json.dumps({"status": "ok", "summary": "cpu ×2", "seconds": 3.2, "mlflow_run_id": "abc"})
    )
    (tmp_path / "shard.json").write_text(
        json.dumps({"status": "failed", "summary": "no matching files", "seconds": 0.4})
    )
    out = cli("summary", "--run-dir", str(tmp_path))
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert any(line.startswith("Environment validation") and "ok" in line and "cpu ×2" in line for line in lines)
    assert any(
        line.startswith("WebDataset sharding") and "failed" in line and "no matching files" in line for line in lines
    )
    assert any("runs/abc" in line for line in lines) and any("(not run)" in line for line in lines)


def cli_loading(loaded: Path, *args):
    """cli(*args), run through runpy so that at exit the process writes to `loaded` which of torch and mlflow it had
    imported (a stage that needs neither must not pay their seconds of import)."""
    code = (
        "import atexit, json, runpy, sys\n"
        f"atexit.register(lambda: open({str(loaded)!r}, 'w').write(json.dumps("
        "[m for m in ('torch', 'mlflow') if m in sys.modules])))\n"
        f"sys.argv = ['tasks', *{list(args)!r}]\n"
        "runpy.run_module('tasks', run_name='__main__', alter_sys=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
    return out, json.loads(loaded.read_text())


@pytest.fixture(scope="module")
def run_with_shards_64(tmp_path_factory):
    """A run directory whose shard stage built 64-token windows with a 300-token BPE (one --set, several pairs);
    with --no-tracking and --publish-only (the llm_data DAG's shard task) it imports neither torch nor mlflow. Without
    --publish-only the stage checks evaluate.tasks against the set (the val split read with the torch loader, lm-eval
    tasks loaded), and 10 documents leave none in val."""
    tmp = tmp_path_factory.mktemp("cli-run")
    run = tmp / "run"
    out, loaded = cli_loading(
        tmp / "loaded.json",
        "shard",
        "--run-dir",
        str(run),
        "--no-tracking",
        "--publish-only",
        "--set",
        "data.seq_len=64",
        "data.vocab_size=300",
        "data.max_documents=10",
        "data.shard_size_mb=0.05",
        f"data.out_dir={tmp / 'data'}",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((run / "shard.json").read_text())["seq_len"] == 64
    assert loaded == []
    return run


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["data.seq_len=128"], "error: data.seq_len: 128 differs from the shard set's 64"),
        (["data.seq_len=32", "data.vocab_size=512"], "error: data.seq_len: 32 differs from the shard set's 64 ("),
        (["data.vocab_size=512"], "error: data.vocab_size: 512 differs from the shard set's 300"),
    ],
)
def test_an_explicit_value_that_differs_from_the_shard_set_fails_in_one_line(run_with_shards_64, sets, needle):
    out = cli("train", "--run-dir", str(run_with_shards_64), "--no-tracking", "--set", *sets)
    # the directory remembers shard's --set values (with the default preset): said on a `config:` line first
    err = [ln for ln in out.stderr.strip().splitlines() if not ln.startswith("config: this run directory's")]
    assert out.returncode == 2 and len(err) == 1 and err[0].startswith(needle), out.stderr
    assert not (run_with_shards_64 / "logs").exists()  # refused before any worker started


def test_a_refused_train_imports_neither_torch_nor_mlflow(run_with_shards_64, tmp_path):
    """A config refused before launch answers in a fraction of a second: no torch (tasks.model's torch parts load on
    first use), no mlflow (--no-tracking)."""
    args = ("train", "--run-dir", str(run_with_shards_64), "--no-tracking", "--set", "data.seq_len=128")
    out, loaded = cli_loading(tmp_path / "loaded.json", *args)
    assert out.returncode == 2 and "differs from the shard set's 64" in out.stderr and loaded == []


def test_train_takes_seq_len_from_the_shard_set_and_launches_the_layouts_ranks(run_with_shards_64):
    """demo-cpu says seq_len 128 and nproc_per_node 2: the shard set's 64 wins (not set explicitly), and with
    nproc_per_node unpinned a dp1 layout launches one CPU rank instead of failing `1 ≠ world size 2`."""
    run = run_with_shards_64
    out = cli(
        "train",
        "--run-dir",
        str(run),
        "--no-tracking",
        "--no-export",
        "--set",
        "model.preset=debug",
        "hardware.nproc_per_node=0",
        "parallel.dp=1",
        "parallel.tp=1",
        "parallel.pp=1",
        "train.steps=2",
        "train.global_batch=4",
        "train.micro_batch=2",
        "--set",
        "train.precision=fp32",
        "train.checkpoint_every=0",
        "data.loader_workers=0",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((run / "train.json").read_text())
    assert result["status"] == "ok" and result["layout"] == "single" and result["steps"] == 2
    spec = json.loads((run / "train" / "launch.json").read_text())
    assert (spec["config"]["data"]["seq_len"], spec["config"]["data"]["vocab_size"]) == (64, 300)
    assert (spec["nproc"], spec["world"], spec["config"]["train"]["precision"]) == (1, 1, "fp32")
    assert sorted(p.name for p in (run / "logs").glob("rank-*.log")) == ["rank-0.log"]


def test_plan_with_several_pairs_after_one_set_and_a_typed_list(tmp_path):
    """`--set a=1 b=2` works like repeated --set, and list items are coerced (zero_stages=0,1 are integers)."""
    out = cli(
        "plan",
        "--run-dir",
        str(tmp_path),
        "--no-tracking",
        "--json",
        "--set",
        "plan.zero_stages=0,1",
        "parallel.dp=0",
        "parallel.tp=0",
        "parallel.pp=0",
        "data.seq_len=64",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["seq_len"] == 64 and {p["zero"] for p in plan["plans"]} == {0, 1}
