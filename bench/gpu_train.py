"""Training throughput on one (or more) accelerators: tokens/s, MFU and peak memory for Llama 3.2 1B's shape in bf16,
through the training stage's own parallel code (FSDP2 mixed precision, the same step, optimizer and clipping), and
with --compare-torchtitan the same model and batch through torchtitan 0.3.0's own trainer (bench/titan_config.py):
the tokens/s ratio and both MFUs against the device's datasheet peak (tasks.planner.cluster.DEVICES).

Not part of `make bench` (it needs a GPU/NPU); `make device-check` runs it. On a GPU host:
    python bench/gpu_train.py --out gpu_train.json --compare-torchtitan   # one device, both trainers
    torchrun --nproc-per-node 8 bench/gpu_train.py --out gpu_train.json   # FSDP over 8 devices
Tokens are synthetic (seeded random ids): the figure is the model step, not the data pipeline.
Keys: gpu_train.tokens_per_s, gpu_train.mfu, gpu_train.peak_mem_gb, gpu_train.step_time_s, and with torchtitan
gpu_train.titan_tokens_per_s, gpu_train.titan_mfu, gpu_train.tokens_per_s_ratio (ours / torchtitan's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent

# Llama 3.2 1B's shape, as torchtitan 0.3.0's llama3 "1B" flavour (models/llama3/__init__.py `_1b`: dim 2048, 16 layers,
# 32 heads, 8 KV heads, FFN compute_ffn_hidden_dim(2048, multiple_of=1024, ffn_dim_multiplier=1.5) = 8192, vocabulary
# 128256, tied embeddings): 1.24B parameters.
LLAMA_1B = dict(
    family="llama",
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=8192,
    vocab_size=128256,
    rope_theta=500000.0,
    max_seq_len=8192,
    tie_embeddings=True,
)
# torchtitan's per-step log line (components/metrics.py MetricsProcessor.log): "step: 5  loss: … tps: 12,345  …
# mfu: 41.20%", with ANSI colours when the output is a terminal.
TITAN_LINE = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)\s.*?mfu:\s*([\d.]+|N/A)%?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _init_dist(backend_name: str):
    import torch.distributed as dist

    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29531"),
    ):
        os.environ.setdefault(key, value)  # plain `python bench/gpu_train.py` = a world of one
    dist.init_process_group(backend_name)
    return dist.get_rank(), dist.get_world_size()


def titan_command(python: str, steps: int, seq_len: int, local_batch: int) -> tuple[list[str], dict]:
    """torchtitan's own entry point on one device with bench/titan_config.py (argv, environment)."""
    argv = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    argv += ["-m", "torchtitan.train", "--module", "bench.titan_config", "--config", "llama3_1b_synthetic"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
        "TITAN_STEPS": str(steps),
        "TITAN_SEQ_LEN": str(seq_len),
        "TITAN_LOCAL_BATCH": str(local_batch),
    }
    return argv, env


def parse_titan_log(text: str) -> list[dict]:
    """[{step, tps, mfu}] from torchtitan's step lines (mfu a fraction, None when it printed N/A)."""
    rows = []
    for line in ANSI.sub("", text).splitlines():
        m = TITAN_LINE.search(line)
        if m:
            mfu = None if m.group(3) == "N/A" else round(float(m.group(3)) / 100, 6)
            rows.append({"step": int(m.group(1)), "tps": float(m.group(2).replace(",", "")), "mfu": mfu})
    return rows


def titan_throughput(rows: list[dict], warmup: int) -> float:
    """Median tokens/s per device of torchtitan's steps after the warm-up ones."""
    kept = [r["tps"] for r in rows if r["step"] > warmup]
    if not kept:
        raise RuntimeError(f"torchtitan logged no step after {warmup} warm-up steps ({len(rows)} step lines)")
    return statistics.median(kept)


def comparison(ours_tps: float, titan_tps: float, flops_tok: float, peak: float | None) -> dict:
    """Both trainers on one basis: this project's FLOPs per token and the datasheet peak of the device."""
    return {
        "gpu_train.titan_tokens_per_s": round(titan_tps, 1),
        "gpu_train.tokens_per_s_ratio": round(ours_tps / titan_tps, 4),
        "gpu_train.titan_mfu": round(flops_tok * titan_tps / peak, 4) if peak else None,
    }


def run_torchtitan(args, log: Path) -> list[dict]:
    argv, env = titan_command(args.titan_python, args.steps, args.seq_len, args.micro_batch * args.accum)
    with open(log, "w") as f:
        rc = subprocess.run(argv, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=args.titan_timeout_s)
    text = log.read_text(errors="replace")
    if rc.returncode != 0:
        tail = " | ".join(text.strip().splitlines()[-3:])
        raise RuntimeError(f"torchtitan exited {rc.returncode} (log {log}): {tail[-400:]}")
    return parse_titan_log(text)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="", help="a tasks.model preset instead of Llama 3.2 1B's shape (e.g. debug)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "npu", "cpu"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step and device")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the figures")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak (default: known GPU/NPU table)")
    p.add_argument("--out", default="gpu_train.json")
    p.add_argument("--compare-torchtitan", action="store_true", help="also run torchtitan 0.3.0 on the same model")
    p.add_argument("--titan-python", default=sys.executable, help="a python with torchtitan==0.3.0 and CUDA torch")
    p.add_argument("--titan-timeout-s", type=int, default=600)
    args = p.parse_args(argv)

    import torch

    from tasks.config import TrainConfig
    from tasks.device import detect, memory_stats, reset_peak, synchronize, torch_device
    from tasks.model import TransformerConfig, flops_per_token, get_preset, num_params
    from tasks.layout import Layout
    from tasks.parallel.mesh import build_mesh
    from tasks.parallel.metrics import peak_flops
    from tasks.parallel.optim import build_optimizers
    from tasks.train.build import Optimizers, build_model, build_step
    from tasks.units import GB

    backend = detect(args.device)
    rank, world = _init_dist(backend.dist_backend)
    device = torch_device(backend.kind, int(os.environ["LOCAL_RANK"]))
    tcfg = get_preset(args.preset) if args.preset else TransformerConfig(**LLAMA_1B)
    if args.compare_torchtitan and (world > 1 or args.preset or args.accum != 1):
        raise SystemExit("--compare-torchtitan compares one device, the 1B shape, no accumulation (as torchtitan's)")
    local = args.micro_batch * args.accum
    lay = Layout(
        dp=world, tp=1, pp=1, zero=3, recompute=args.recompute, micro_batch=args.micro_batch, global_batch=local * world
    )
    mesh = build_mesh(device.type, 1, world, 1)
    model = build_model(tcfg, lay, mesh, device, args.precision, seed=0)
    train_cfg = TrainConfig(steps=args.steps, lr=3e-4, min_lr=3e-5, warmup_steps=2)
    opts = Optimizers(build_optimizers(model.modules, train_cfg), replicas=[], owner={})
    step = build_step(model, opts, mesh, lay, device, args.precision, grad_clip=1.0)  # the trainer's TrainStep
    gen = torch.Generator().manual_seed(rank)
    times, losses = [], []
    reset_peak(device)
    for i in range(args.steps):
        tokens = torch.randint(0, tcfg.vocab_size, (local, args.seq_len + 1), generator=gen).to(device)
        synchronize(device)
        t0 = time.perf_counter()
        result = step(tokens[:, :-1], tokens[:, 1:])
        synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(result.loss))  # StepResult.loss: the global loss, already read to the host
        if rank == 0:
            print(f"step {i + 1}: loss {losses[-1]:.3f}, {times[-1]:.3f} s", flush=True)
    step_s = statistics.median(times[args.warmup :] or times)
    tps = lay.global_batch * args.seq_len / step_s
    peak = peak_flops(device, args.peak_tflops)
    mem = memory_stats(device)
    result = {
        "gpu_train.tokens_per_s": round(tps, 1),
        "gpu_train.step_time_s": round(step_s, 4),
        "gpu_train.mfu": round(flops_per_token(tcfg, args.seq_len) * tps / (peak * world), 4) if peak else None,
        "gpu_train.peak_mem_gb": round(mem["peak_bytes"] / GB, 2),
        "gpu_train.peak_reserved_gb": round(mem["peak_reserved_bytes"] / GB, 2),
        "config": {
            "params": num_params(tcfg),
            "world": world,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "seq_len": args.seq_len,
            "global_batch": lay.global_batch,
            "precision": args.precision,
            "recompute": args.recompute,
            "first_loss": losses[0],
            "last_loss": losses[-1],
        },
    }
    if args.compare_torchtitan:
        torch.distributed.destroy_process_group()
        del model, opts, step
        if device.type == "cuda":
            torch.cuda.empty_cache()  # torchtitan's process needs the memory this one held
        rows = run_torchtitan(args, Path(args.out).with_suffix(".torchtitan.log"))
        result.update(comparison(tps, titan_throughput(rows, args.warmup), flops_per_token(tcfg, args.seq_len), peak))
        result["config"]["torchtitan"] = {"version": "0.3.0", "steps_logged": len(rows), "own_mfu": rows[-1]["mfu"]}
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    # Skip interpreter teardown after destroy_process_group: a rare SIGABRT there ("terminate called without an
    # active exception") would fail torchrun although the run completed.
    os._exit(0)
