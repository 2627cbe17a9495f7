"""Operator-by-operator precision comparison ("accuracy worse than on GPU → compare layer by layer"): one forward of
the same weights and batch on the device (in its training precision) and in FP32 on the CPU, every module's output
captured by forward hooks in compute order, and the first layer whose output departs beyond a tolerance named.

Errors per layer: max_abs = max |device − cpu|; max_rel = max_abs / max |cpu| (relative to the layer's own scale,
which stays meaningful where single elements are near zero); mean_abs. A layer "departs" when max_rel > tolerance.
A mixture-of-experts layer's routed experts are compared only where its router chose the same experts for every
token on both sides: their output rows are sorted by expert, so one token routed elsewhere shifts every row after
it (a 1-in-16 routing flip read as a 127 % error); such a layer's row says how many tokens were routed elsewhere,
and the MoE block's own output carries the real effect.
"""

from __future__ import annotations

import torch

from tasks import device as devices


def capture(model: torch.nn.Module, tokens: torch.Tensor, autocast) -> list[tuple[str, torch.Tensor]]:
    """[(module name, its output as FP32 on the CPU)] for every named module, in the order they ran; the model's
    own output last as "logits"."""
    outs: list[tuple[str, torch.Tensor]] = []
    handles = []

    def hook(name):
        def record(module, inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(out) and out.is_floating_point():
                outs.append((name, out.detach().float().cpu()))

        return record

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_hook(hook(name)))
    try:
        with torch.no_grad(), autocast:
            logits = model(tokens)
    finally:
        for h in handles:
            h.remove()
    outs.append(("logits", logits.detach().float().cpu()))
    return outs


def compare(
    reference: list[tuple[str, torch.Tensor]], candidate: list[tuple[str, torch.Tensor]], tolerance: float
) -> dict:
    """Per-layer error table of candidate against reference (matched by name, in reference order)."""
    cand, refs = dict(candidate), dict(reference)
    rows = []
    for name, ref in reference:
        got = cand.get(name)
        if got is None or got.shape != ref.shape:
            rows.append({"layer": name, "missing": got is None, "shape": list(ref.shape)})
            continue
        flips = _routing_flips(name, ref, refs, cand)
        if flips:  # rows sorted by expert: another routing shifts them, so row-by-row errors would mean nothing
            rows.append({"layer": name, "shape": list(ref.shape), "routing_differs": flips})
            continue
        diff = (got - ref).abs()
        scale = ref.abs().max().item()
        max_abs = diff.max().item() if diff.numel() else 0.0
        rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
        rows.append(
            {
                "layer": name,
                "shape": list(ref.shape),
                "max_abs": max_abs,
                "max_rel": rel,
                "mean_abs": diff.mean().item() if diff.numel() else 0.0,
                "ref_max_abs": scale,
                "non_finite": int((~torch.isfinite(got)).sum()),
                "beyond": rel > tolerance,
            }
        )
    first = next((r for r in rows if r.get("beyond") or r.get("non_finite")), None)
    final = next((r for r in reversed(rows) if "max_rel" in r), None)
    return {
        "tolerance": tolerance,
        "layers": rows,
        "routing_differs": {r["layer"]: r["routing_differs"] for r in rows if "routing_differs" in r},
        "first_beyond": first["layer"] if first else None,
        "first_beyond_rel": first.get("max_rel") if first else None,
        "logits_max_rel": final["max_rel"] if final else None,
        "max_rel": max((r["max_rel"] for r in rows if "max_rel" in r), default=0.0),
    }


def _routing_flips(name: str, ref: torch.Tensor, refs: dict, cand: dict) -> int:
    """For a mixture-of-experts layer's routed experts (`<moe>.experts`, whose output rows are the token
    assignments sorted by expert, top_k per token): how many tokens its router (`<moe>.router`, the logits) sends
    to another set of experts on the candidate than on the reference; 0 for any other module."""
    if not name.endswith(".experts"):
        return 0
    router = name[: -len("experts")] + "router"
    a, b = refs.get(router), cand.get(router)
    if a is None or b is None or a.shape != b.shape or a.dim() != 2 or not a.shape[0]:
        return 0
    k, rest = divmod(ref.shape[0], a.shape[0])
    if rest or not 0 < k <= a.shape[1]:
        return 0
    chosen = [t.topk(k, dim=-1).indices.sort(dim=-1).values for t in (a, b)]
    return int((chosen[0] != chosen[1]).any(dim=-1).sum())


def _model(tcfg, state: dict, dev, converters=()):
    """The model on `dev` from `state`, with `converters` (built ones) applied as the smoke curves and the trainer
    apply them: before the weights load."""
    from tasks.model import build_model
    from tasks.model.converters import apply

    model = build_model(tcfg).to_empty(device=dev)
    apply(model, converters)
    model.tie_weights()
    model.load_state_dict(state)
    model.init_rope()
    return model.eval()


def compare_with_cpu(
    tcfg, state: dict, tokens: torch.Tensor, dev, precision: str, tolerance: float, converters=(), cfg=None
) -> dict:
    """One forward on `dev` in `precision` (fp32 | bf16 | fp16 autocast) against FP32 on the CPU, same weights and
    tokens. On a CPU-only host `dev` is the CPU itself, so this compares CPU BF16 with CPU FP32.

    Both models get `converters` (model.converters; `cfg`: the run's config, for their settings), each built for its
    own side's device as training builds them: the CPU reference then computes the function training trains
    (qat_int8's fake-quantized weights, math_attention's explicit ops), and npu_fused, whose NPU kernels exist only
    on an NPU, is the identity there: the reference keeps the plain PyTorch ops the fused kernels are checked
    against."""
    from tasks.model.converters import ConvertContext, build

    ref_convs = build(converters, ConvertContext("cpu", tcfg, cfg))
    reference = capture(
        _model(tcfg, state, torch.device("cpu"), ref_convs), tokens.cpu(), devices.autocast(torch.device("cpu"), "fp32")
    )
    convs = build(converters, ConvertContext(dev.type, tcfg, cfg))
    model = _model(tcfg, state, dev, convs)
    candidate = capture(model, tokens.to(dev), devices.autocast(dev, precision))
    del model
    out = compare(reference, candidate, tolerance)
    out.update(device=str(dev), precision=precision, reference="cpu fp32", tokens=list(tokens.shape))
    out["converters"] = {"device": [repr(c) for c in convs], "cpu": [repr(c) for c in ref_convs]}
    return out


def summary(result: dict) -> str:
    where = (
        f"first layer beyond {result['tolerance']:.0%}: {result['first_beyond']} "
        f"(max rel {result['first_beyond_rel']:.2%})"
        if result["first_beyond"]
        else f"every layer within {result['tolerance']:.0%}"
    )
    flips = result.get("routing_differs") or {}
    routing = (
        f"; the router sent {sum(flips.values())} token(s) to other experts in {len(flips)} layer(s) "
        "(their expert rows not compared)"
        if flips
        else ""
    )
    return (
        f"{result['device']} {result['precision'].upper()} vs CPU FP32: {where}; logits max rel "
        f"{result['logits_max_rel']:.2%}{routing}"
    )
