"""Single-process training-step cost of the project's model and step, against two baselines in the same run:

- a minimal plain-PyTorch loop (forward, cross-entropy, backward, clip, AdamW) over the SAME model, batch and
  optimizer settings — our step's overhead (non-finite checks, fp32 loss) should stay within 5%;
- transformers' LlamaForCausalLM of the same shape, same batch, same loop — how our model code compares;

and CPU MFU: model FLOPs/s (flops_per_token × tokens/s) over a matmul peak measured here and now.

Measured on one thread in this process's CPU seconds: on a shared 2-core machine other processes' load and a second
thread's barrier waits made wall-clock ratios swing ±30%; one thread and CPU time keep them within ~2%. The three
variants are interleaved round by round (order rotated); ratios are taken per round and their median reported. The
matmul peak is measured the same way (best of several), so MFU compares like with like.
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

from tasks.model import build_model, flops_per_token, get_preset, materialize  # noqa: E402
from tasks.model.step import train_step  # noqa: E402

BATCH, SEQ, ROUNDS, WARMUP = 4, 128, 30, 2


def matmul_peak_flops(n: int = 1024, reps: int = 8) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        a @ b
        best = min(best, time.process_time() - t)
    return 2 * n ** 3 / best


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

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=tcfg.dim, intermediate_size=tcfg.ffn_dim, num_hidden_layers=tcfg.n_layers,
        num_attention_heads=tcfg.n_heads, num_key_value_heads=tcfg.n_kv_heads, vocab_size=tcfg.vocab_size,
        max_position_embeddings=tcfg.max_seq_len, rms_norm_eps=tcfg.norm_eps, tie_word_embeddings=False,
        use_cache=False, attn_implementation="sdpa"))


def measure() -> dict:
    tcfg = get_preset("demo")
    torch.manual_seed(0)
    x = torch.randint(0, tcfg.vocab_size, (BATCH, SEQ))
    y = torch.roll(x, -1, dims=1)
    steps = {
        "ours": (materialize(build_model(tcfg), "cpu", seed=0), lambda m, o: train_step(m, o, x, y, grad_clip=1.0)),
        "plain": (materialize(build_model(tcfg), "cpu", seed=0), lambda m, o: plain_step(m, o, x, y)),
        "transformers": (hf_llama(tcfg), lambda m, o: plain_step(m, o, x, y)),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, (m, _) in steps.items()}
    times = {k: [] for k in steps}
    peak = matmul_peak_flops()
    names = list(steps)
    for r in range(WARMUP + ROUNDS):
        for name in names[r % 3:] + names[:r % 3]:  # rotate the order: no variant always runs first
            model, step = steps[name]
            t = time.process_time()
            step(model, opts[name])
            if r >= WARMUP:
                times[name].append(time.process_time() - t)
    peak = max(peak, matmul_peak_flops())  # the best the machine gave, before or after
    med = {k: statistics.median(v) for k, v in times.items()}

    def ratio(other: str) -> float:  # per round, then the median: variants of one round saw the same machine
        return round(statistics.median(a / b for a, b in zip(times["ours"], times[other])), 3)

    return {
        "train_step.ratio_vs_plain_loop": ratio("plain"),
        "train_step.ratio_vs_transformers": ratio("transformers"),
        "train_step.cpu_mfu": round(flops_per_token(tcfg, SEQ) * BATCH * SEQ / med["ours"] / peak, 4),
        "train_step.cpu_seconds_per_step": round(med["ours"], 4),
        "train_step.matmul_peak_gflops_per_cpu_s": round(peak / 1e9, 1),
    }


def run() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure()
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key} = {value}")
