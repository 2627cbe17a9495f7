"""The trainer's own step (tasks/train: `Trainer.train_step` — batch, TrainStep, metrics, hooks, heartbeats, the
metrics line) against a plain PyTorch loop, and compiled blocks (train.compile) against eager, on the demo model.

One process, one rank (a 1-process gloo group, as a torchrun CPU rank: one thread), the same shard set and batches
(each side its own ShardLoader over the same shards, seed and batch size, loader in the process), the same model
init, precision (the demo preset's bf16 autocast over fp32 parameters) and AdamW settings (foreach, as the trainer's).
The plain loop: next batch → forward → cross-entropy → backward → clip_grad_norm_ → AdamW → LR schedule → zero_grad.

- `train_step.trainer_ratio_vs_plain_loop`: trainer step time / plain loop step time (goal ≤ 1.05). CPU seconds of
  this process per step (on a shared host, other processes' load swings wall clock by ±30 %; the CPU time of one
  thread does not), steps interleaved in rounds (order alternating; 24 rounds), the per-round ratio's median;
  `…_wall` the same in wall-clock seconds.
- `train_step.compile_speedup_vs_eager`: eager step time / compiled step time (tokens/s ratio; target ≥ 1.2), after
  the compiled trainer's first steps (`train_step.compile_first_step_s`: the one-time compile), measured the same way.
  The compiled blocks compute attention through SDPA's math backend (tasks/parallel/compile.math_attention: at this
  sequence length faster than the CPU flash kernel that eager uses and inductor cannot fuse), so part of this ratio is
  that choice of attention, not compilation: `train_step.compile_speedup_vs_eager_math_attention` is the same ratio
  against an eager trainer whose blocks use the same math attention (interleaved in the same rounds) — what
  compiling the same operations buys.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROUNDS, PER_ROUND, WARMUP = 12, 3, 3
SETS = {
    "model.preset": "demo",
    "data.seq_len": 128,
    "data.loader_workers": 0,
    "train.steps": 100_000,  # never the last step: no final checkpoint inside the measurement
    "train.global_batch": 8,
    "train.micro_batch": 8,
    "train.precision": "bf16",
    "train.checkpoint_every": 0,
    "parallel.dp": 1,
    "parallel.tp": 1,
    "parallel.pp": 1,
    "parallel.zero": 0,
    "hardware.device": "cpu",
    "hardware.nproc_per_node": 1,
}


def trainer(tmp: Path, shards: Path, name: str, **sets):
    """A real Trainer of one rank in this process (its output stays on this process's stdout)."""
    import torch

    from tasks.config import apply_overrides, load_config
    from tasks.runner import StageContext
    from tasks.stages import train
    from tasks.train import trainer as trainer_mod

    cfg = load_config("demo-cpu")
    cfg.tracking.enabled = False
    apply_overrides(cfg, {**SETS, **sets})
    ctx = StageContext(
        run_dir=tmp / name, stage="train", args=argparse.Namespace(shard_dir=str(shards), fresh=True, no_export=True)
    )
    (tmp / name).mkdir(parents=True, exist_ok=True)
    spec = train.prepare(cfg, ctx)
    redirect, trainer_mod.redirect_output = trainer_mod.redirect_output, lambda path: None
    try:
        t = trainer_mod.Trainer(spec, torch.device("cpu"))
    finally:
        trainer_mod.redirect_output = redirect
    t.call("on_start")
    return t


def plain_loop(cfg_sets: dict, shards: Path):
    """The same model, data, precision and optimizer as a plain PyTorch loop: a function running one step."""
    import torch
    import torch.nn.functional as F

    from data_prep.loader import ShardLoader
    from tasks.config import apply_overrides, load_config
    from tasks.model import build_model, from_pipeline, materialize
    from tasks.parallel.optim import lr_factor

    cfg = load_config("demo-cpu")
    apply_overrides(cfg, cfg_sets)
    t = cfg.train
    from data_prep.manifest import load_manifest

    model = materialize(
        build_model(from_pipeline(cfg, vocab_size=load_manifest(shards)["vocab_size"]), "meta"), "cpu", t.seed
    )
    opt = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay, foreach=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t.warmup_steps, t.steps, t.lr, t.min_lr))
    batches = ShardLoader(shards, "train", batch_size=t.global_batch, num_workers=0, seed=t.seed).batches()

    def step() -> float:
        x, y = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def interleaved(steps: dict, rounds: int = ROUNDS, per_round: int = PER_ROUND) -> dict[str, dict[str, list]]:
    """{name: {"cpu": [per-round median step CPU s], "wall": [...]}}: each round runs `per_round` steps of every
    variant, in an order that rotates from round to round."""
    out = {k: {"cpu": [], "wall": []} for k in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cpu, wall = [], []
            for _ in range(per_round):
                c, w = time.process_time(), time.perf_counter()
                steps[name]()
                cpu.append(time.process_time() - c)
                wall.append(time.perf_counter() - w)
            out[name]["cpu"].append(statistics.median(cpu))
            out[name]["wall"].append(statistics.median(wall))
    return out


def ratio(times: dict, a: str, b: str, kind: str = "cpu") -> float:
    """Median over rounds of a's step time / b's (the variants of one round saw the same machine)."""
    return round(statistics.median(x / y for x, y in zip(times[a][kind], times[b][kind])), 3)


def run() -> dict:
    import torch
    import torch.distributed as dist

    from data_prep.testing import tiny_shard_set
    from tasks.device import dist_backend
    from tasks.parallel.compile import math_attention

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a torchrun CPU rank (OMP_NUM_THREADS=1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dist.init_process_group(dist_backend("cpu"), store=dist.FileStore(str(tmp / "store"), 1), rank=0, world_size=1)
        try:
            shards = tiny_shard_set(tmp / "data", seq_len=128, vocab_size=2048, n_docs=60)
            eager = trainer(tmp, shards, "eager")
            plain = plain_loop(SETS, shards)
            counter = {"eager": 0, "compiled": 0}

            def trainer_step(t, key):
                def step():
                    counter[key] += 1
                    t.train_step(counter[key])

                return step

            steps = {"trainer": trainer_step(eager, "eager"), "plain": plain}
            for _ in range(WARMUP):
                for s in steps.values():
                    s()
            overhead = interleaved(steps, rounds=2 * ROUNDS)  # a ratio near 1: twice the rounds for its median

            compiled = trainer(tmp, shards, "compiled", **{"train.compile": True})
            compiled_step = trainer_step(compiled, "compiled")
            t0 = time.perf_counter()
            compiled_step()
            first = time.perf_counter() - t0
            eager_math = trainer(tmp, shards, "eager-math")
            for block in eager_math.model.modules[0].layers.values():
                block.attention.attend = math_attention
            counter["eager_math"] = 0
            steps["eager_math"] = trainer_step(eager_math, "eager_math")
            for _ in range(WARMUP):
                compiled_step()
                steps["eager_math"]()
            speed = interleaved(
                {"eager": steps["trainer"], "eager_math": steps["eager_math"], "compiled": compiled_step}
            )
        finally:
            dist.destroy_process_group()
            torch.set_num_threads(threads)
    tokens = SETS["train.global_batch"] * SETS["data.seq_len"]
    return {
        "train_step.trainer_ratio_vs_plain_loop": ratio(overhead, "trainer", "plain"),
        "train_step.trainer_ratio_vs_plain_loop_wall": ratio(overhead, "trainer", "plain", "wall"),
        "train_step.trainer_cpu_seconds_per_step": round(statistics.median(overhead["trainer"]["cpu"]), 4),
        "train_step.compile_speedup_vs_eager": ratio(speed, "eager", "compiled"),
        "train_step.compile_speedup_vs_eager_wall": ratio(speed, "eager", "compiled", "wall"),
        "train_step.compile_speedup_vs_eager_math_attention": ratio(speed, "eager_math", "compiled"),
        "train_step.compiled_tokens_per_s_cpu": round(tokens / statistics.median(speed["compiled"]["cpu"]), 1),
        "train_step.compile_first_step_s": round(first, 1),
    }


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key} = {value}")
