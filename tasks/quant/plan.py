"""Pure decisions behind the quantize stage: which backend and flow, which layers, and whether each can be quantized.

No torch, no AMCT: the stage describes the model as (name, type, weight shape) rows and these functions decide, so
the Ascend path's logic is tested on a machine without AMCT.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.errors import StageError

# What each method quantizes (type names of nn.Module classes).
# AMCT classic PTQ (create_quant_config docs): Linear, Conv2d, Conv3d, ConvTranspose2d, AvgPool2d.
# AMCT LLM flow (amct.quantize docs, INT8 rows): Linear only. torchao: Linear, and Embedding INT8 weight-only per row
# (its Int8Tensor implements aten.embedding: quantize_/workflows/int8/int8_tensor.py); tasks/quant/torchao_backend.py.
SUPPORTED = {
    ("amct", "ptq"): ("Linear", "Conv2d", "Conv3d", "ConvTranspose2d", "AvgPool2d"),
    ("amct", "llm"): ("Linear",),
    ("torchao", None): ("Linear", "Embedding"),
}
# MoE routed experts (tasks/model/moe.py): torchao INT8 weight-only over the stacked expert weights.
EXPERTS = "GroupedExperts"
# Our modules use torchtitan names; users write skip_layers in HF terms ("lm_head", "embed_tokens") as for AMCT.
HF_ALIASES = {
    "output": "lm_head",
    "tok_embeddings": "embed_tokens",
    "attention.": "self_attn.",
    "feed_forward.": "mlp.",
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w1": "gate_proj",
    "w2": "down_proj",
    "w3": "up_proj",
    "moe.": "mlp.",
    "router": "gate",
}


@dataclass(frozen=True)
class Layer:
    name: str  # module path, e.g. "layers.0.attention.wq"
    type: str  # class name, e.g. "Linear"
    shape: tuple = ()  # weight shape (out, in) — empty for weightless layers
    shared: bool = False  # weight shared with another module (tied embeddings)


def hf_name(name: str) -> str:
    """Our module name in HF terms, as transformers spells the module path: under `model.` but for `lm_head`
    ("layers.0.attention.wq" → "model.layers.0.self_attn.q_proj"; "model.layers.0." was refused as matching none)."""
    for ours, theirs in HF_ALIASES.items():
        name = name.replace(ours, theirs)
    return name if name == "lm_head" or name.startswith("lm_head.") else f"model.{name}"


def is_skipped(name: str, patterns) -> bool:
    """AMCT's LLM flow matches skip_layers as substrings; we match our name and its HF spelling the same way."""
    alias = hf_name(name)
    return any(p and (p in name or p in alias) for p in patterns)


def choose_backend(requested: str, amct_error: str | None, device_kind: str, flow: str, dtype: str = "bf16") -> str:
    """auto → AMCT on an Ascend host where amct_pytorch imports, torchao elsewhere; an explicit choice is honoured
    or refused in one line (AMCT missing, the LLM flow off the NPU, or fp32: AMCT's INT8 runs on fp16/bf16 only)."""
    if requested not in ("auto", "amct", "torchao"):
        raise StageError(f"quantize.backend: {requested!r} is not one of auto, amct, torchao")
    if requested == "auto":
        requested = "amct" if amct_error is None and device_kind == "npu" else "torchao"
    if requested == "amct":
        if amct_error is not None:
            raise StageError(
                f"quantize.backend amct: amct_pytorch is not importable ({amct_error}); install the "
                "AMCT package from CANN (or build hicann/amct) on the Ascend host, or use "
                "quantize.backend=torchao"
            )
        if flow == "llm" and device_kind != "npu":
            raise StageError(
                f"quantize.amct_flow llm: amct.quantize/convert run on Ascend A2/A3 NPUs only, this "
                f"host is {device_kind}; use quantize.amct_flow=ptq (ONNX) or quantize.backend=torchao"
            )
        if dtype == "fp32":
            raise StageError(
                "quantize.dtype fp32: AMCT's INT8 quantization supports fp16/bf16 models only "
                "(hicann/amct quantize docs); set quantize.dtype=bf16 or fp16"
            )
    return requested


# The defaults: a tied model has no lm_head layer of its own (the embedding computes it), so "lm_head" may match none.
DEFAULT_SKIPS = ("lm_head", "embed")


def unmatched_skips(layers: list[Layer], skip_layers) -> None:
    """A quantize.skip_layers entry that matches no layer (a typo: `lm_hed`) would quantize what the user meant to
    keep without a word: one line naming it and the nearest layer names."""
    import difflib

    names = sorted({n for layer in layers for n in (layer.name, hf_name(layer.name))})
    for p in skip_layers:
        if p and p not in DEFAULT_SKIPS and not any(p in n for n in names):
            parts = sorted({part for n in names for part in n.split(".") if not part.isdigit()})
            near = difflib.get_close_matches(p, sorted(set(names) | set(parts)), n=3, cutoff=0.5)
            raise StageError(
                f"quantize.skip_layers: {p!r} matches no layer (entries match as substrings of the layer names"
                + (f"; did you mean {', '.join(map(repr, near))}?" if near else f", e.g. {names[0]!r}")
                + ")"
            )


# AMCT's classic PTQ (create_quant_config → quantize_model, hicann/amct classic/graph_based; the API snapshot in
# tests/fixtures/npu_api: create_quant_config(config_file, model, input_data, skip_layers, batch_num,
# activation_offset, config_defination) takes no method) quantizes weights and activations to INT8, the activations
# calibrated: W8A8, the method of ours it implements. Weight-only or SmoothQuant would be a label on another result.
PTQ_FLOW_METHOD = "int8_dynamic"


def check_flow_method(backend: str, flow: str, method: str) -> None:
    """One line when the AMCT flow cannot do `method` (before any model is loaded)."""
    if backend == "amct" and flow == "ptq" and method != PTQ_FLOW_METHOD:
        raise StageError(
            f"quantize.method {method}: quantize.amct_flow=ptq (AMCT create_quant_config) has no method setting and "
            f"always quantizes weights and activations to INT8 (W8A8, quantize.method={PTQ_FLOW_METHOD}); set "
            f"quantize.method={PTQ_FLOW_METHOD}, or quantize.amct_flow=llm for {method}"
        )


def select_layers(layers: list[Layer], backend: str, flow: str, method: str, skip_layers) -> list[str]:
    """Names of the layers to quantize; every other layer holding a weight matrix must be listed in skip_layers
    (else a one-line error: the method cannot quantize it and silently leaving it FP would misreport the size)."""
    supported = SUPPORTED[(backend, flow if backend == "amct" else None)]
    label = f"{backend} {flow} {method}" if backend == "amct" else f"{backend} {method}"
    chosen = []
    for layer in layers:
        if is_skipped(layer.name, skip_layers):
            continue
        experts = layer.type == EXPERTS and backend == "torchao"
        if layer.type not in supported and not experts:
            if len(layer.shape) >= 2:
                raise StageError(
                    f"quantize: layer {layer.name} ({layer.type}) is not supported by {label} "
                    f"(supports {', '.join(supported)}); add it to quantize.skip_layers"
                )
            continue
        if backend == "amct":
            _check_amct_layer(layer, flow, method)
        if experts and method != "int8_weight_only":
            raise StageError(
                f"quantize: MoE experts {layer.name} are quantized INT8 weight-only only (torchao), not "
                f"{method}; use quantize.method=int8_weight_only or add it to quantize.skip_layers"
            )
        chosen.append(layer.name)
    if not chosen:
        raise StageError(
            f"quantize: no layer left to quantize with {label} (quantize.skip_layers="
            f"{list(skip_layers)} skips them all)"
        )
    return chosen


def _check_amct_layer(layer: Layer, flow: str, method: str) -> None:
    """AMCT's documented constraints: shared weights are never quantized; the LLM flow's INT8 kernels need
    32-aligned K and N for weight-only, and K % 16 == 0, N % 8 == 0 for W8A8."""
    if layer.shared:
        raise StageError(
            f"quantize: layer {layer.name} shares its weight (tied embeddings), which AMCT does not "
            "quantize; add it to quantize.skip_layers"
        )
    if flow != "llm" or len(layer.shape) != 2:
        return
    n, k = layer.shape
    if method == "int8_weight_only" and (k % 32 or n % 32):
        raise StageError(
            f"quantize: layer {layer.name} weight {n}x{k} is not 32-aligned, which AMCT INT8 "
            "weight-only requires; add it to quantize.skip_layers"
        )
    if method in ("int8_dynamic", "smoothquant") and (k % 16 or n % 8):
        raise StageError(
            f"quantize: layer {layer.name} weight {n}x{k} needs K % 16 == 0 and N % 8 == 0 for AMCT "
            "W8A8; add it to quantize.skip_layers"
        )


def gate_advice(method: str, backend: str) -> str:
    """What to try when INT8 misses the accuracy gate, most effective first for the method used."""
    tips = []
    if method != "smoothquant":
        tips.append("SmoothQuant W8A8 (quantize.method=smoothquant) to move activation outliers into the weights")
    tips.append("skip the most sensitive layers (add e.g. 'layers.0.' or 'down_proj' to quantize.skip_layers)")
    tips.append(
        "quantization-aware training from the QAT hand-off config (qat/retrain.cfg, "
        "amct.create_quant_retrain_model on Ascend)"
        if backend == "amct"
        else "quantization-aware training (QAT): train with model.converters=[qat_int8, npu_fused] (INT8 rounding from "
        "the first step), or from the hand-off config in qat/"
    )
    return "; ".join(tips)
