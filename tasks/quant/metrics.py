"""What evaluation measures: perplexity and next-token top-1 accuracy over fixed tokens, size on disk, per-token
forward latency, prefill and KV-cache decode speed, greedy text and the agreement of two models' continuations."""

from __future__ import annotations

import math
import io
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tasks import device as devices


@torch.no_grad()
def perplexity(model, batches, device) -> dict:
    """exp(mean token NLL) over every target token of `batches` (fp32 log-softmax; a sum, so batches of any size
    weigh by their tokens). Both models of a comparison get the same list of batches, hence the same tokens."""
    nll, tokens, correct = 0.0, 0, 0
    for inputs, targets in batches:
        logits = model(inputs.to(device))
        targets = targets.to(device)
        nll += F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum").item()
        correct += int((logits.argmax(-1) == targets).sum())  # next-token top-1: what greedy decoding would emit
        tokens += targets.numel()
    if tokens == 0:
        raise ValueError("perplexity over zero tokens")
    return {"nll": nll / tokens, "ppl": math.exp(nll / tokens), "tokens": tokens, "accuracy": correct / tokens}


def size_on_disk(path: str | os.PathLike) -> int:
    p = Path(path)
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


class _ByteCounter(io.RawIOBase):
    """A write-only sink that counts: torch.save into it measures a file without writing one (a 7B FP32 model
    would otherwise cost 28 GB of scratch disk)."""

    def __init__(self):
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.written += len(b)
        return len(b)


def state_dict_bytes(model, dtype: torch.dtype | None = None) -> int:
    """Bytes `torch.save(state_dict)` writes, floating tensors cast to `dtype`: the FP32/BF16 references go through
    the same serializer as the INT8 file, so the ratio compares weights, not formats. A tensor shared by two names
    (tied embeddings) is cast once and saved once, as torch.save stores the uncast model."""
    cast: dict[tuple, torch.Tensor] = {}

    def to(v: torch.Tensor) -> torch.Tensor:
        if dtype is None or not v.is_floating_point():
            return v
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()))
        return cast.setdefault(key, v.to(dtype))

    sd = {k: to(v) for k, v in model.state_dict().items()}
    counter = _ByteCounter()
    torch.save(sd, counter)
    return counter.written


def agreement(a: list, b: list) -> float:
    """Share of positions where two continuations of the same prompts agree (pairs of equal-length token lists)."""
    pairs = [(x, y) for seq_a, seq_b in zip(a, b) for x, y in zip(seq_a, seq_b)]
    if not pairs:
        raise ValueError("agreement over zero tokens")
    return sum(x == y for x, y in pairs) / len(pairs)


@torch.no_grad()
def generation_speed(
    models: dict, prompt: torch.Tensor, new_tokens: int, device, repeats: int = 3, warmup: int = 1
) -> dict:
    """{name: {"prefill_s", "decode_tokens_per_s"}}: the prompt [b, s] through a prefill that fills the KV cache,
    then `new_tokens` - 1 cached single-token steps for the whole batch (tokens/s counts b × steps). Rounds
    alternate between the models; the median round counts."""
    from tasks.model.generate import forward_cached

    prompt = prompt.to(device)
    prefill = {name: [] for name in models}
    decode = {name: [] for name in models}
    for i in range(warmup + repeats):
        for name, model in models.items():
            cache: dict = {}
            devices.synchronize(prompt.device)
            t0 = time.perf_counter()
            nxt = forward_cached(model, prompt, cache, 0)[:, -1].argmax(-1, keepdim=True)
            devices.synchronize(prompt.device)
            t1 = time.perf_counter()
            for j in range(new_tokens - 1):
                nxt = forward_cached(model, nxt, cache, prompt.size(1) + j)[:, -1].argmax(-1, keepdim=True)
            devices.synchronize(prompt.device)
            t2 = time.perf_counter()
            if i >= warmup:
                prefill[name].append(t1 - t0)
                decode[name].append(prompt.size(0) * (new_tokens - 1) / (t2 - t1))
    return {
        name: {"prefill_s": statistics.median(prefill[name]), "decode_tokens_per_s": statistics.median(decode[name])}
        for name in models
    }
