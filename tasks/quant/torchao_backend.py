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


def quantized_names(model: torch.nn.Module) -> list[str]:
    """Layers whose weight is now a torchao tensor subclass (what was actually quantized)."""
    return [name for name, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor) and type(m.weight).__module__.startswith("torchao")]
