"""torchao INT8 on any device: weight-only, dynamic W8A8, and SmoothQuant W8A8 (calibrated), restricted to the
layers the plan chose (filter_fn), which is how skip_layers reaches torchao. Embeddings are quantized INT8
weight-only per row whatever the method (a lookup has no activation to quantize).

`pack_for_cpu` swaps the loaded INT8 weight-only layers for CPU kernels (`Int8PackedLinear`, `Int8PackedEmbedding`):
the artifact stays torchao's state dict; only what runs changes (docs/benchmarks.md has the measured difference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    quantize_(
        model,
        _configs("int8_weight_only"),
        filter_fn=lambda module, fqn: fqn in wanted and isinstance(module, torch.nn.Embedding),
    )
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


# ---- CPU inference kernels for the saved INT8 weights ----
#
# torchao 0.18's Int8Tensor computes weight-only INT8 eagerly as `mm(x, qdata.t().to(x.dtype)) * scale.to(x.dtype)`
# (quantize_/workflows/int8/int8_tensor.py, the aten.linear implementation): a weight-sized BF16 temporary and three
# kernels per call, plus the tensor subclass's dispatch. aten._weight_int8pack_mm is PyTorch's fused CPU kernel for
# the same product (aten/src/ATen/native/cpu/int8mm_kernel.cpp: int8 rows widened and scaled inside the FMA loop).
# Its AVX-512 loop steps K by 16 with aligned loads and no remainder (AVX2 and NEON by 8): K % 16 == 0 and aligned
# operands are required — anything else reads out of bounds (measured here: K=100 crashes, K=200 returns NaN). The
# scales are x's dtype, as torchao's own path casts them.
PACK_K_MULTIPLE = 16


class Int8PackedLinear(torch.nn.Module):
    """y = x · (qdata · scale)ᵀ (+ bias) through aten._weight_int8pack_mm, per-row scales."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("qdata", qdata.detach().clone(memory_format=torch.contiguous_format))  # fresh: aligned
        self.register_buffer("scale", scale.detach().reshape(-1).to(dtype).contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.scale.dtype).contiguous()
        if x2.data_ptr() % 64:  # a view with an offset: the kernel's aligned loads need its own copy
            x2 = x2.clone()
        y = torch.ops.aten._weight_int8pack_mm(x2, self.qdata, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1).to(x.dtype)


class Int8PackedEmbedding(torch.nn.Module):
    """Rows looked up in int8 and scaled (in fp32, as torchao's dequantize_affine) — torchao's Int8Tensor embedding
    dequantizes the whole table on every call."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("qdata", qdata.detach().contiguous())
        self.register_buffer("scale", scale.detach().reshape(-1, 1).float().contiguous())
        self.dtype = dtype

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return (F.embedding(idx, self.qdata).float() * F.embedding(idx, self.scale)).to(self.dtype)


def _weight_only_rows(w) -> bool:
    """A torchao INT8 weight-only tensor with one scale per row and no zero point: what the CPU kernels compute."""
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    return (
        isinstance(w, Int8Tensor)
        and w.qdata.dim() == 2
        and w.act_quant_kwargs is None
        and w.act_pre_scale is None
        and (w.zero_point is None or not bool(w.zero_point.any()))
        and list(w.block_size) == [1, w.qdata.shape[1]]
    )


def pack_for_cpu(model: torch.nn.Module) -> list[str]:
    """Swap INT8 weight-only Linear/Embedding layers of a model on the CPU for the packed kernels, in place; layers
    the kernel cannot take (K % 16, W8A8, other devices) keep torchao's path. → names of the swapped layers."""
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            w = getattr(child, "weight", None)
            if not _weight_only_rows(w) or w.device.type != "cpu":
                continue
            if isinstance(child, torch.nn.Linear):
                if w.qdata.shape[1] % PACK_K_MULTIPLE:
                    continue
                new = Int8PackedLinear(w.qdata, w.scale, child.bias, w.dtype)
            elif isinstance(child, torch.nn.Embedding) and child.padding_idx is None and child.max_norm is None:
                new = Int8PackedEmbedding(w.qdata, w.scale, w.dtype)
            else:
                continue
            setattr(parent, name, new)
            swapped.append(f"{parent_name}.{name}" if parent_name else name)
    return swapped
