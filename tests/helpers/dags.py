"""`airflow dags test` of one DAG in a temporary var dir and MLflow store (the orchestration and e2e tests), and the
session's shared runs of llm_pipeline that the DAG-level assertions read: one full run, one that fails at train."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]

# What the DAG-level tests' claims never read, made small: the demo-continuation task scored by evaluate (lm-eval, per
# model: FP32, BF16, INT8; ci-tiny's 300 examples were most of a run's CPU) and train's validation loss (ci-tiny:
# every step, on 64 sequences). Both still run, on their real code paths.
LEAN = {"evaluate": {"demo_examples": 40}, "train": {"eval_samples": 8}}
# The env stage's torchrun collective probe (2 CPU s + ~2.5 per rank), left out of the runs whose claims are elsewhere;
# the session's checkpoint run (every stage, as a user runs it) keeps it.
NO_PROBE = {"collective_probe": False}

# ci-tiny (the debug model on a pinned dp2 ZeRO-3 layout, 2 gloo ranks) on a device of FAIL_GB: the plan's estimate
# (0.1225 GB, mostly the CPU runtime reserve) fits it and plan passes, while what each rank really holds beyond its
# pre-model RSS (measured 0.1346-0.1368 GB in DAG runs: the model, optimizer, gloo, the loader) is above it. Only the
# rehearsal can tell; it stops train at its third step, before that step's checkpoint.
FAIL_GB = 0.128
FAILING = {
    "hardware": {"device_memory_gb": FAIL_GB} | NO_PROBE,
    "train": {"steps": 6, "checkpoint_every": 1, "rehearsal_steps": 3} | LEAN["train"],
    "smoke": {"steps": 6, "model": "same"},  # the debug model itself (auto would keep 25 % of the device free)
}


def preset_file(path: Path, sections: dict, base: str = "ci-tiny") -> Path:
    """configs/<base>.yaml with `sections` merged over its own (a section given as {} is emptied), written to `path`:
    the DAG's default preset when passed as $LLM_PIPELINE_PRESET (then --conf names no preset)."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / f"{base}.yaml").read_text())
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values} if values else {}
    path.write_text(yaml.safe_dump(cfg))
    return path


def dags_test(dag_id: str, conf: dict, tmp_path: Path, extra_env: dict | None = None, timeout: int = 600):
    from tests.helpers.mlflow_store import fresh_store

    env = {
        **os.environ,
        "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
        "MLFLOW_TRACKING_URI": fresh_store(tmp_path / "m.db"),
        **(extra_env or {}),
    }
    cmd = f"source scripts/airflow-env.sh && airflow dags test {dag_id} --conf '{json.dumps(conf)}'"
    return subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def session_root(tmp_path_factory) -> Path:
    """A directory of this test session that every xdist worker sees (their base temps' parent; without xdist the
    session's own base temp)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(root: Path, name: str, make) -> dict:
    """`make(root / name)` (returning a JSON-able dict) run once per session, whichever process asks first: the
    others (xdist workers) wait on the file lock and read its recorded result."""
    (root / name).mkdir(parents=True, exist_ok=True)
    done = root / name / "result.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if make() raised
        if not done.is_file():
            done.write_text(json.dumps(make(root / name)))
    return json.loads(done.read_text())


def checkpoint_run(tmp: Path) -> dict:
    """One `airflow dags test llm_pipeline` of ci-tiny continuing the training of a tiny Qwen2 saved by transformers
    with its own tokenizer (`tokenizer` and `hf_path` = that directory, tmp/ckpt), through every stage."""
    from tests.helpers.models import stdlib_bpe, trained_tiny_qwen2

    ckpt = tmp / "ckpt"
    trained_tiny_qwen2(ckpt, stdlib_bpe(384))
    preset = preset_file(tmp / "ci-tiny-lean.yaml", LEAN)  # ci-tiny, its evaluation task and validation smaller
    conf = {"tokenizer": str(ckpt), "hf_path": str(ckpt), "precision": "fp32", "steps": 4}
    env = {"HF_HUB_OFFLINE": "1", "LLM_PIPELINE_PRESET": str(preset)}
    out = dags_test("llm_pipeline", conf, tmp, extra_env=env, timeout=1200)
    return {"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}


def failing_rehearsal_run(tmp: Path) -> dict:
    """One `airflow dags test llm_pipeline` of FAILING: the rehearsal stops it at train (tmp/var, tmp/m.db)."""
    preset = preset_file(tmp / "failing.yaml", FAILING)
    out = dags_test("llm_pipeline", {}, tmp, extra_env={"LLM_PIPELINE_PRESET": str(preset)}, timeout=900)
    return {"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}


def shared_failing_rehearsal_run(tmp_path_factory) -> SimpleNamespace:
    """The session's run that fails at train (failing_rehearsal_run, once): tmp (its var/ and m.db), out (returncode,
    stdout, stderr). Read it, never write into it: the rehearsal test and the failed-stage test both read it."""
    root = session_root(tmp_path_factory)
    out = SimpleNamespace(**once(root, "failing-rehearsal-run", failing_rehearsal_run))
    return SimpleNamespace(tmp=root / "failing-rehearsal-run", out=out)


def shared_checkpoint_run(tmp_path_factory) -> SimpleNamespace:
    """The session's checkpoint run (checkpoint_run, once): tmp (its var/ and m.db), out (returncode, stdout,
    stderr), ckpt, and the checkpoint as transformers reads it back (hf, its tokenizer `fast`)."""
    import torch
    import transformers

    root = session_root(tmp_path_factory)
    out = SimpleNamespace(**once(root, "checkpoint-run", checkpoint_run))
    tmp = root / "checkpoint-run"
    ckpt = tmp / "ckpt"
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"), eos_token="<|endoftext|>")
    return SimpleNamespace(tmp=tmp, out=out, ckpt=ckpt, hf=hf, fast=fast)
