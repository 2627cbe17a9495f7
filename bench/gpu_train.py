"""Training throughput on one (or more) accelerators: tokens/s, MFU and peak memory for a ~1.5B Llama in bf16,
through the training stage's own parallel code (FSDP2 mixed precision, the same step, optimizer and clipping).

Not part of `make bench` (it needs a GPU/NPU). On a lent machine:
    python bench/gpu_train.py --out gpu_train.json                      # one device
    torchrun --nproc-per-node 8 bench/gpu_train.py --out gpu_train.json # FSDP over 8 devices
Tokens are synthetic (seeded random ids): the figure is the model step, not the data pipeline.
Keys: gpu_train.tokens_per_s, gpu_train.mfu, gpu_train.peak_mem_gb, gpu_train.step_time_s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Llama-3.2-1B's shape with an untied output projection (1.50B parameters).
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
)


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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="", help="a tasks.model preset instead of the 1.5B Llama (e.g. debug)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "npu", "cpu"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step and device")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the figures")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak (default: known GPU/NPU table)")
    p.add_argument("--out", default="gpu_train.json")
    args = p.parse_args(argv)

    import torch

    from tasks.config import TrainConfig
    from tasks.device import detect, memory_stats, reset_peak, synchronize, torch_device
    from tasks.model import TransformerConfig, flops_per_token, get_preset, num_params
    from tasks.parallel.layout import Layout
    from tasks.parallel.mesh import build_mesh
    from tasks.parallel.metrics import peak_flops
    from tasks.parallel.optim import build_optimizers
    from tasks.train.build import Optimizers, build_model, build_step
    from tasks.units import GB

    backend = detect(args.device)
    rank, world = _init_dist(backend.dist_backend)
    device = torch_device(backend.kind, int(os.environ["LOCAL_RANK"]))
    tcfg = get_preset(args.preset) if args.preset else TransformerConfig(**LLAMA_1B)
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
        losses.append(result.loss.item())
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
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    # Skip interpreter teardown after destroy_process_group: a rare SIGABRT there ("terminate called without an
    # active exception") would fail torchrun although the run completed.
    os._exit(0)
