"""What went wrong in a short run, and what to try: the smoke stage's failure report.

Likely causes, cheapest to confirm first: BF16 range (FP32 is clean, BF16 is not), learning rate (finite at first,
diverges later), data or weights (the very first forward is already non-finite).
"""

from __future__ import annotations

import math

import torch

from tasks.model.probe import LayerProbe, first_non_finite_grad

ADVICE = {
    "bf16_range": "BF16 range: FP32 runs clean, so values overflow or lose precision in BF16 — clip gradients "
    "(train.grad_clip), keep norms/softmax/loss in FP32, or use fp16 with a loss scaler",
    "learning_rate": "learning rate: finite at first, then diverged — lower smoke.lr / train.lr about 10x, add "
    "warmup, keep gradient clipping on",
    "data": "data or weights: the first forward is already non-finite — check token ids against the vocabulary and "
    "the checkpoint (model.hf_path) for NaN/Inf values",
}


def likely_causes(precision: str, step: int, fp32_clean: bool) -> list[str]:
    order = ["data", "learning_rate"] if step == 0 else ["learning_rate", "data"]
    if precision != "fp32":  # BF16 range is the first suspect only when FP32 ran clean on the same batches
        order.insert(0 if fp32_clean else len(order), "bf16_range")
    return order


def diagnose_non_finite(
    model, inputs, autocast, precision: str, step: int, loss: float, grad_norm: float, fp32_clean: bool
) -> dict:
    """Replay the failing forward with probes on the weights that produced it (train_step skipped the update)."""
    bad_grad = first_non_finite_grad(model) if math.isfinite(loss) else None
    with LayerProbe(model) as probe, torch.no_grad(), autocast:
        model(inputs)
    first = probe.first_non_finite()
    causes = likely_causes(precision, step, fp32_clean)
    culprit = probe.culprit()
    if first is not None:
        where = (
            f"first non-finite layer {culprit} (output of {first['layer']}: {first['nan']} NaN, "
            f"{first['inf']} Inf of {first['numel']}, dtype {first['dtype']})"
        )
    elif bad_grad is not None:
        where = f"forward is finite; first non-finite gradient in {bad_grad}"
    else:
        where = "no layer output is non-finite in the replay (non-deterministic overflow?)"
    what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
    return {
        "precision": precision,
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "first_bad_layer": culprit,
        "first_bad_grad": bad_grad,
        "where": where,
        "cause": f"{precision.upper()} {what} at step {step}; {where}",
        "likely_causes": causes,
        "advice": [ADVICE[c] for c in causes],
        "layers": probe.records,
    }
