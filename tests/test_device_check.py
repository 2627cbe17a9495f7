"""`make device-check` (bench/device_check.py, bench/gpu_train.py, bench/titan_config.py) without a GPU: every stage
command it will run parses and validates as the CLI does, the sequence runner records failures and goes on, our
throughput step runs on the CPU, and torchtitan's log lines are read as its metrics code writes them. What is left
for a GPU host: the device calls themselves and torchtitan's trainer (bench/titan_config.py is written against its
0.3.0 sources; torchtitan is not installable beside this project's pins)."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import device_check  # noqa: E402
import gpu_train  # noqa: E402


def test_every_step_is_a_valid_command_on_cuda(tmp_path):
    from tasks import cli
    from tasks.config import load_config
    from tasks.runner import stage_module

    steps = device_check.plan(tmp_path, "cuda", device_check.cluster_for("NVIDIA H100 80GB HBM3"), "/opt/titan/python")
    names = [s["name"] for s in steps]
    assert names == [
        "shard",
        "smoke",
        "train-demo",
        "profile",
        "quantize",
        "evaluate",
        "shard-moe",
        "train-moe",
        "throughput",
    ]
    for s in steps[:-1]:
        argv = s["argv"]
        assert argv[1:3] == ["-m", "tasks"]
        parser = argparse.ArgumentParser()
        cli._common(parser)
        module = stage_module(argv[3])
        if hasattr(module, "add_cli_args"):
            module.add_cli_args(parser)
        args = parser.parse_args(argv[4:])
        cfg = load_config(args.config, sets=args.sets)  # every override validated as the stage will
        assert (cfg.hardware.device, cfg.hardware.cluster, cfg.parallel.dp) == ("cuda", "h100-80g", 1), s["name"]
        if not s["name"].startswith("shard"):
            assert cfg.model.preset == ("moe-demo" if s["name"] == "train-moe" else "demo"), s["name"]
    assert steps[-1]["argv"][-3:] == ["--compare-torchtitan", "--titan-python", "/opt/titan/python"]


def test_runner_records_a_failure_and_goes_on(tmp_path):
    steps = [
        {"name": "bad", "argv": [sys.executable, "-c", "import sys; print('cause here'); sys.exit(3)"]},
        {"name": "good", "argv": [sys.executable, "-c", "print('fine')"]},
    ]
    done = device_check.run_steps(steps, env={}, timeout_s=60)
    assert [(d["name"], d["rc"], d["last_line"]) for d in done] == [("bad", 3, "cause here"), ("good", 0, "fine")]


def test_torchtitan_log_lines_are_read(tmp_path):
    """The step line of torchtitan 0.3.0 (components/metrics.py MetricsProcessor.log), colours included."""
    red, blue, magenta, reset = "\x1b[31m", "\x1b[34m", "\x1b[35m", "\x1b[39m"
    lines = [
        f"[titan] 2026-12-01 INFO - {red}step: {s:2}  loss: 11.9  grad_norm:  3.1000  memory: 41.20GiB(51.98%)  "
        f"{blue}tps: {tps:,}  tflops: 310.20  {magenta}mfu: {mfu}{reset}"
        for s, tps, mfu in ((1, 1_024, "3.10%"), (2, 38_000, "41.20%"), (3, 40_000, "43.00%"), (4, 39_000, "N/A"))
    ]
    rows = gpu_train.parse_titan_log("\n".join(["[titan] building model", *lines]))
    assert [(r["step"], r["tps"], r["mfu"]) for r in rows] == [
        (1, 1024.0, 0.031),
        (2, 38000.0, 0.412),
        (3, 40000.0, 0.43),
        (4, 39000.0, None),
    ]
    assert gpu_train.titan_throughput(rows, warmup=1) == 39000.0
    with pytest.raises(RuntimeError, match="no step after 4 warm-up steps"):
        gpu_train.titan_throughput(rows, warmup=4)
    c = gpu_train.comparison(ours_tps=42_900.0, titan_tps=39_000.0, flops_tok=7.5e9, peak=989e12)
    assert c == {
        "gpu_train.titan_tokens_per_s": 39000.0,
        "gpu_train.tokens_per_s_ratio": 1.1,
        "gpu_train.titan_mfu": round(7.5e9 * 39000.0 / 989e12, 4),
    }


def test_torchtitan_side_is_its_own_entry_point_on_the_same_model():
    argv, env = gpu_train.titan_command("/venv/bin/python", 15, 2048, 8)
    assert argv[:2] == ["/venv/bin/python", "-m"] and "torchtitan.train" in argv
    assert argv[argv.index("--module") + 1] == "bench.titan_config"
    assert (env["TITAN_STEPS"], env["TITAN_SEQ_LEN"], env["TITAN_LOCAL_BATCH"]) == ("15", "2048", "8")
    tree = ast.parse((REPO / "bench" / "titan_config.py").read_text())
    config = argv[argv.index("--config") + 1]
    assert config in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    # Our side is torchtitan's Llama 3 "1B": Llama 3.2 1B's published 1,235,814,400 parameters (tied embeddings).
    from tasks.model import TransformerConfig, num_params

    assert num_params(TransformerConfig(**gpu_train.LLAMA_1B)) == 1_235_814_400


def test_our_throughput_step_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu_train.json"
    argv = [sys.executable, str(REPO / "bench" / "gpu_train.py"), "--device", "cpu", "--preset", "debug"]
    argv += ["--steps", "2", "--warmup", "1", "--seq-len", "32", "--micro-batch", "2", "--out", str(out)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["gpu_train.tokens_per_s"] > 0 and r["gpu_train.mfu"] is None  # no datasheet peak for a CPU
    assert r["config"]["global_batch"] == 2 and r["config"]["device_name"] == "cpu"
