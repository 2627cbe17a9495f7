"""Single-process training-step cost of the project's model and step, against two baselines in the same run:

- a minimal plain-PyTorch loop (forward, cross-entropy, backward, clip, AdamW) over the SAME model, batch and
  optimizer settings — our step's overhead (non-finite checks, fp32 loss) should stay within 5%;
- transformers' LlamaForCausalLM of the same shape, same batch, same loop — how our model code compares.

These two ratios are measured on one thread in this process's CPU seconds: on a shared 2-core machine other
processes' load and a second thread's barrier waits made wall-clock ratios swing ±30%; one thread and CPU time keep
them within ~2%. The three variants are interleaved round by round (order rotated); ratios are taken per round and
their median reported.

MFU (`train_step.cpu_mfu`) is measured separately, the way the term is meant: achieved FLOP/s of our step in wall
clock with the threads a training rank uses — torchrun gives each CPU rank OMP_NUM_THREADS=1 (the train stage
leaves it so), and this bench uses $OMP_NUM_THREADS or 1 likewise (`train_step.threads`) — over the peak FLOP/s of
this CPU measured in the same run with the same thread count and dtype (fp32): `train_step.cpu_matmul_peak_gflops`,
the best of a few 1024² matmuls.
FLOPs per token: 6 × matmul parameters plus causal attention as a causal kernel executes it (scores and values for
the s(s+1)/2 visible pairs, forward + backward: 12·L·H·d·(s+1)/2). Step and peak are interleaved round by round;
the per-round ratio's median is reported.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tasks.model import build_model, get_preset, materialize  # noqa: E402
from tasks.train.step import single_process  # noqa: E402

BATCH, SEQ, ROUNDS, WARMUP, MFU_ROUNDS = 4, 128, 30, 2, 12


def matmul_peak_flops(n: int = 1024, reps: int = 4, dtype=torch.float32) -> float:
    """Best wall-clock FLOP/s of an n×n matmul in `dtype` with the current thread count."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def step_flops(tcfg, batch: int, seq: int) -> float:
    """Training FLOPs of one step: the project's one formula (tasks.planner.memory.flops_per_token), with causal
    attention counted as executed."""
    from tasks.planner.memory import flops_per_token

    return flops_per_token(tcfg, seq, causal=True) * batch * seq


def plain_step(model, opt, x, y):
    logits = model(x)
    logits = logits.logits if hasattr(logits, "logits") else logits
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def hf_llama(tcfg):
    import transformers

    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=tcfg.dim,
            intermediate_size=tcfg.ffn_dim,
            num_hidden_layers=tcfg.n_layers,
            num_attention_heads=tcfg.n_heads,
            num_key_value_heads=tcfg.n_kv_heads,
            vocab_size=tcfg.vocab_size,
            max_position_embeddings=tcfg.max_seq_len,
            rms_norm_eps=tcfg.norm_eps,
            tie_word_embeddings=False,
            use_cache=False,
            attn_implementation="sdpa",
        )
    )


def _batch(tcfg):
    torch.manual_seed(0)
    x = torch.randint(0, tcfg.vocab_size, (BATCH, SEQ))
    return x, torch.roll(x, -1, dims=1)


def ratios() -> dict:
    tcfg = get_preset("demo")
    x, y = _batch(tcfg)
    ours = materialize(build_model(tcfg), "cpu", seed=0)
    ours_step = single_process(ours, torch.optim.AdamW(ours.parameters(), lr=1e-4), grad_clip=1.0)
    steps = {
        "ours": (ours, lambda m, o: ours_step(x, y)),
        "plain": (materialize(build_model(tcfg), "cpu", seed=0), lambda m, o: plain_step(m, o, x, y)),
        "transformers": (hf_llama(tcfg), lambda m, o: plain_step(m, o, x, y)),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, (m, _) in steps.items() if k != "ours"}
    times = {k: [] for k in steps}
    names = list(steps)
    for r in range(WARMUP + ROUNDS):
        for name in names[r % 3 :] + names[: r % 3]:  # rotate the order: no variant always runs first
            model, step = steps[name]
            t = time.process_time()
            step(model, opts.get(name))
            if r >= WARMUP:
                times[name].append(time.process_time() - t)

    def ratio(other: str) -> float:  # per round, then the median: variants of one round saw the same machine
        return round(statistics.median(a / b for a, b in zip(times["ours"], times[other])), 3)

    return {
        "train_step.ratio_vs_plain_loop": ratio("plain"),
        "train_step.ratio_vs_transformers": ratio("transformers"),
        "train_step.cpu_seconds_per_step_1_thread": round(statistics.median(times["ours"]), 4),
    }


def mfu() -> dict:
    """Wall clock, all the run's threads, fp32 (the dtype the step computes in)."""
    tcfg = get_preset("demo")
    x, y = _batch(tcfg)
    model = materialize(build_model(tcfg), "cpu", seed=0)
    step = single_process(model, torch.optim.AdamW(model.parameters(), lr=1e-4), grad_clip=1.0)
    flops = step_flops(tcfg, BATCH, SEQ)
    for _ in range(WARMUP):
        step(x, y)
    per_round, step_s, peaks = [], [], []
    for _ in range(MFU_ROUNDS):
        peak = matmul_peak_flops()
        t = time.perf_counter()
        step(x, y)
        dt = time.perf_counter() - t
        per_round.append(flops / dt / peak)
        step_s.append(dt)
        peaks.append(peak)
    return {
        "train_step.cpu_mfu": round(statistics.median(per_round), 4),
        "train_step.cpu_matmul_peak_gflops": round(statistics.median(peaks) / 1e9, 1),
        "train_step.achieved_gflops": round(flops / statistics.median(step_s) / 1e9, 1),
        "train_step.wall_seconds_per_step": round(statistics.median(step_s), 4),
        "train_step.threads": torch.get_num_threads(),
    }


def run() -> dict:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))  # as a torchrun CPU rank
        out = mfu()
        torch.set_num_threads(1)
        out.update(ratios())
    finally:
        torch.set_num_threads(threads)
    return out


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key} = {value}")
