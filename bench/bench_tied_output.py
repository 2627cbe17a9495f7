"""The tied output projection's backward (tasks/model/transformer.TiedOutput) at Qwen2-0.5B's tied embedding (151936 ×
896, fp32) and 32 tokens (tests/test_scale.py's cut), against its fallback in the same run: `_TiedLinear`, whose
backward returns the weight gradient as the tensor its matmul made, over the linear backward followed by `_OwnGrad`'s
copy of that gradient (what a DTensor or autocast takes). Timed: one backward through the output projection and the
embedding, their gradients summed in place, in this process's CPU seconds on one thread; the two variants interleaved
round by round (order alternated), the per-round ratio's median reported (< 1: cheaper). Both variants' gradients are
checked bit-identical first."""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tasks.model.transformer import _OwnGrad, _TiedLinear  # noqa: E402

VOCAB, DIM, TOKENS, ROUNDS = 151936, 896, 32, 9


def _backward(own: bool, weight, hidden, ids) -> tuple[float, torch.Tensor]:
    """(CPU seconds of the backward, the weight's gradient) for one forward through embedding + tied output."""
    weight.grad = None
    gc.collect()
    x = hidden + F.embedding(ids, weight)
    logits = _TiedLinear.apply(x, weight) if own else F.linear(x, _OwnGrad.apply(weight))
    loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
    start = time.process_time()
    loss.backward()
    return time.process_time() - start, weight.grad


def run() -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=gen) * 0.02)
    hidden = torch.randn(1, TOKENS, DIM, generator=gen)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)
    same = torch.equal(_backward(True, weight, hidden, ids)[1], _backward(False, weight, hidden, ids)[1])
    if not same:
        raise SystemExit("bench_tied_output: the two backwards' weight gradients differ")
    own, copy, ratios = [], [], []
    for r in range(ROUNDS):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {variant: _backward(variant, weight, hidden, ids)[0] for variant in order}
        own.append(got[True])
        copy.append(got[False])
        ratios.append(got[True] / got[False])
    return {
        "tied_output.backward_cpu_s_own_gradient": round(statistics.median(own), 3),
        "tied_output.backward_cpu_s_copy": round(statistics.median(copy), 3),
        "tied_output.backward_cpu_ratio_own_vs_copy": round(statistics.median(ratios), 3),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
