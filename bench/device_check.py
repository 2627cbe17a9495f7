"""`make device-check`: on a CUDA host, in under 10 minutes, the device paths the CPU suite cannot run.

Each step is the project's own entry point in a subprocess, on one GPU, in strict NCCL mode
(LLM_PIPELINE_STRICT_COLLECTIVES=nccl: tasks/collectives.py checks each collective of the layer, and real NCCL
refuses the rest — a CPU tensor in any collective is the MoE statistics' defect class):
    shard → smoke → train (demo model) → profile (torch.profiler) → quantize (INT8) → evaluate,
    train (MoE model, its own run directory), and the throughput of this trainer against torchtitan 0.3.0 on the same
    model and batch (bench/gpu_train.py --compare-torchtitan: tokens/s ratio, MFU against the datasheet peak).
Writes <out>/device-check.json (device name, per step: exit code, seconds, last line) and exits 1 when a step failed.

    python bench/device_check.py --out var/device-check [--titan-python .venv-titan/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEP_TIMEOUT_S = 420


def stage_sets(device: str, cluster: str, data_dir: Path) -> list[str]:
    """The ci-tiny preset on one `device`: the smallest run that still passes through every stage."""
    return [
        f"hardware.device={device}",
        "hardware.nproc_per_node=1",
        f"hardware.cluster={cluster}",
        "parallel.dp=1",
        "parallel.tp=1",
        "parallel.pp=1",
        f"data.out_dir={data_dir}",
        "train.precision=bf16",
        "train.steps=20",
        "train.checkpoint_every=10",
        "smoke.steps=10",
    ]


def plan(out: Path, device: str = "cuda", cluster: str = "cpu-laptop", titan_python: str = "") -> list[dict]:
    """[{name, argv}]: the steps, in order (each stage reads its predecessors' results from its run directory)."""
    py = sys.executable
    sets = stage_sets(device, cluster, out / "data")

    def stage(name: str, stage: str, run: str, *extra: str) -> dict:
        argv = [py, "-m", "tasks", stage, "--config", "ci-tiny", "--run-dir", str(out / run), "--no-tracking"]
        return {"name": name, "argv": argv + list(extra) + ["--set", *sets]}

    demo, moe = ["--set", "model.preset=demo"], ["--set", "model.preset=moe-demo", "model.n_layers=2"]
    steps = [
        stage("shard", "shard", "demo"),
        stage("smoke", "smoke", "demo", *demo),
        stage("train-demo", "train", "demo", *demo),
        stage("profile", "profile", "demo", *demo),
        stage("quantize", "quantize", "demo", *demo),
        stage("evaluate", "evaluate", "demo", *demo),
        stage("shard-moe", "shard", "moe"),
        stage("train-moe", "train", "moe", *moe),
    ]
    bench = [py, str(REPO / "bench" / "gpu_train.py"), "--device", device, "--out", str(out / "gpu_train.json")]
    if titan_python:
        bench += ["--compare-torchtitan", "--titan-python", titan_python]
    steps.append({"name": "throughput", "argv": bench})
    return steps


def run_steps(steps: list[dict], env: dict, timeout_s: int = STEP_TIMEOUT_S) -> list[dict]:
    """Run each step; a failed step is recorded (exit code, last output line) and the next ones still run."""
    done = []
    for s in steps:
        t0 = time.monotonic()
        try:
            p = subprocess.run(s["argv"], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
            rc, text = p.returncode, (p.stdout + p.stderr).strip()
        except subprocess.TimeoutExpired as e:
            rc, text = 124, f"timed out after {timeout_s} s: {(e.stderr or b'')[-300:]!r}"
        last = text.splitlines()[-1][:300] if text else ""
        done.append({"name": s["name"], "rc": rc, "seconds": round(time.monotonic() - t0, 1), "last_line": last})
        print(f"{'ok ' if rc == 0 else 'FAIL'} {s['name']:<12} {done[-1]['seconds']:7.1f} s  {last[:120]}", flush=True)
    return done


def device_name(device: str) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return device


def cluster_for(name: str) -> str:
    """The cluster preset whose device row matches the runtime device name (the MFU peak, memory), else cpu-laptop."""
    from tasks.planner.cluster import DEVICES, PRESETS

    return next((k for k in PRESETS if any(m in name for m in DEVICES[k].match)), "cpu-laptop")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="var/device-check")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a rehearsal of the sequence")
    p.add_argument("--titan-python", default="", help="python with torchtitan==0.3.0 (skip the comparison if empty)")
    p.add_argument("--only", nargs="*", default=None, help="run only these steps (names as printed)")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    name = device_name(args.device)
    steps = plan(out, args.device, cluster_for(name), args.titan_python)
    if args.only is not None:
        steps = [s for s in steps if s["name"] in args.only]
    env = {**os.environ, "LLM_PIPELINE_STRICT_COLLECTIVES": "nccl" if args.device == "cuda" else "hccl"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    done = run_steps(steps, env)
    report = {"device": name, "seconds": round(time.monotonic() - t0, 1), "steps": done}
    bench = out / "gpu_train.json"
    if bench.is_file():
        report["gpu_train"] = json.loads(bench.read_text())
    (out / "device-check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{name}: {sum(s['rc'] == 0 for s in done)}/{len(done)} steps ok in {report['seconds']} s → {out}")
    return 0 if all(s["rc"] == 0 for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())
