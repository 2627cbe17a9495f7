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
    return subprocess.run([sys.executable, "-m", "tasks", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env=env)


@pytest.mark.parametrize("args, needle", [
    (["nope"], "error: unknown stage 'nope' (stages: env, shard, smoke, plan, train, profile, quantize, evaluate)"),
    (["plan", "--config", "nope"], "error: unknown preset 'nope'"),
    (["plan", "--set", "train.steps=zero"], "error: train.steps: expected an integer, got 'zero'"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    out = cli(*args)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and out.stderr.startswith(needle)


def test_bad_yaml_file(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("data: {seq_len: 12\n")
    out = cli("plan", "--config", str(bad))
    assert out.returncode == 2 and "x.yaml" in out.stderr and "not valid YAML" in out.stderr


def test_help_lists_stages():
    out = cli("--help")
    assert out.returncode == 0 and "summary" in out.stdout and "evaluate" in out.stdout


def test_summary_table(tmp_path):
    (tmp_path / "env.json").write_text(json.dumps({"status": "ok", "summary": "cpu ×2", "seconds": 3.2,
                                                   "mlflow_run_id": "abc"}))
    (tmp_path / "shard.json").write_text(json.dumps({"status": "failed", "summary": "no matching files",
                                                     "seconds": 0.4}))
    out = cli("summary", "--run-dir", str(tmp_path))
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert any(l.startswith("Environment validation") and "ok" in l and "cpu ×2" in l for l in lines)
    assert any(l.startswith("WebDataset sharding") and "failed" in l and "no matching files" in l for l in lines)
    assert any("runs/abc" in l for l in lines) and any("(not run)" in l for l in lines)
