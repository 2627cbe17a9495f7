"""torchao INT8 on any device: weight-only, dynamic W8A8, and SmoothQuant W8A8 (calibrated), restricted to the
layers the plan chose (filter_fn), which is how skip_layers reaches torchao."""

from __future__ import annotations

import torch

from tasks.errors import StageError


def _configs(method: str):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

    if method == "int8_weight_only":
        return Int8WeightOnlyConfig()
    if method in ("int8_dynamic", "smoothquant"):
        return Int8DynamicActivationInt8WeightConfig()
    raise StageError(f"quantize.method: {method!r} is not one of int8_weight_only, int8_dynamic, smoothquant")


def quantize(model: torch.nn.Module, method: str, names, calib_batches, device) -> torch.nn.Module:
    """Quantize `model` in place; SmoothQuant observes activations over the calibration batches first."""
    from torchao.quantization import quantize_

    wanted = set(names)

    def only_chosen(module, fqn):
        return fqn in wanted and isinstance(module, torch.nn.Linear)

    base = _configs(method)
    _quantize_experts(model, method, wanted)
    if method != "smoothquant":
        quantize_(model, base, filter_fn=only_chosen)
        return model
    from torchao.prototype.smoothquant import SmoothQuantConfig
    from torchao.quantization.quantize_.common.quantization_step import QuantizationStep

    quantize_(model, SmoothQuantConfig(base, QuantizationStep.PREPARE), filter_fn=only_chosen)
    with torch.no_grad():
        for inputs, _ in calib_batches:
            model(inputs.to(device))
    # After PREPARE the chosen layers are SmoothQuantObservedLinear (a Linear subclass): same names, same filter.
    quantize_(model, SmoothQuantConfig(base, QuantizationStep.CONVERT), filter_fn=only_chosen)
    return model


def _quantize_experts(model: torch.nn.Module, method: str, wanted: set) -> None:
    """MoE routed experts (stacked [E, out, in] weights, tasks/model/moe.py): INT8 weight-only per row, by
    parameter name (torchao FqnToConfig); the expert loop multiplies them with F.linear, which torchao's Int8Tensor
    implements."""
    from collections import OrderedDict

    from torchao.quantization import FqnToConfig, quantize_

    from tasks.model.moe import GroupedExperts

    params = [
        f"{n}.{w}"
        for n, m in model.named_modules()
        if n in wanted and isinstance(m, GroupedExperts)
        for w in ("w1", "w2", "w3")
    ]
    if not params:
        return
    if method != "int8_weight_only":
        raise StageError(f"quantize: MoE experts are quantized INT8 weight-only only, not {method}")
    quantize_(model, FqnToConfig(OrderedDict((p, _configs(method)) for p in params)), filter_fn=None)


def quantized_names(model: torch.nn.Module) -> list[str]:
    """Layers whose weight (MoE experts: stacked w1) is now a torchao tensor subclass (what was quantized)."""
    out = []
    for name, m in model.named_modules():
        w = getattr(m, "weight", getattr(m, "w1", None))
        if isinstance(w, torch.Tensor) and type(w).__module__.startswith("torchao"):
            out.append(name)
    return out
