"""AMCT configurations, built as pure data in the exact shapes AMCT documents (hicann/amct, CANN 9.0).

- LLM flow (`amct.quantize(model, cfg)`): the dicts of `amct_pytorch/common/config/config.py`
  (INT8_MINMAX_WEIGHT_QUANT_CFG, INT8_SMOOTHQUANT_CFG), with `algorithm` and `skip_layers` as Python sets.
- QAT hand-off: the simplified `retrain.cfg` (retrain_config_pytorch.proto text) and the per-layer JSON that
  `create_quant_retrain_config` writes (docs/zh/api/create_quant_retrain_config.md).
"""

from __future__ import annotations

import json

from tasks.errors import StageError

METHODS = ("int8_weight_only", "int8_dynamic", "smoothquant")
_W_INT8_CHANNEL = {"type": "int8", "symmetric": True, "strategy": "channel"}
_A_INT8_TENSOR = {"type": "int8", "symmetric": True, "strategy": "tensor"}
# int8_dynamic: activations quantized per token at run time (AMCT quantize docs: "激活支持PER-TOKEN对称量化",
# inputs.strategy "token"; K % 16 == 0 and N % 8 == 0) — what torchao's int8 dynamic activation does too.
_A_INT8_TOKEN = {"type": "int8", "symmetric": True, "strategy": "token"}


def llm_quant_config(method: str, skip_layers, batch_num: int = 1, smooth_strength: float = 0.5) -> dict:
    """The `cfg` of `amct.quantize(model, cfg)`: weight-only INT8 minmax, W8A8 minmax or W8A8 SmoothQuant."""
    if method not in METHODS:
        raise StageError(f"quantize.method: {method!r} is not one of {', '.join(METHODS)}")
    if batch_num < 1:
        raise StageError(f"quantize.calibration_batches: {batch_num} must be >= 1")
    quant_cfg = {"weights": dict(_W_INT8_CHANNEL)}
    if method == "int8_dynamic":
        quant_cfg["inputs"] = dict(_A_INT8_TOKEN)
    elif method == "smoothquant":
        quant_cfg["inputs"] = dict(_A_INT8_TENSOR)
    algorithm = {"smoothquant": {"smooth_strength": smooth_strength}} if method == "smoothquant" else {"minmax"}
    return {"batch_num": batch_num, "quant_cfg": quant_cfg, "algorithm": algorithm, "skip_layers": set(skip_layers)}


def jsonable(cfg):
    """The config for logging (sets become sorted lists: JSON has no sets)."""
    if isinstance(cfg, dict):
        return {k: jsonable(v) for k, v in cfg.items()}
    if isinstance(cfg, (set, frozenset)):
        return sorted(cfg)
    return cfg


def qat_retrain_json(layers: list[tuple[str, str]], batch_num: int = 1) -> dict:
    """What `create_quant_retrain_config` writes for (name, type) layers: ULQ activations, ARQ weights, INT8;
    channel-wise weights except for Linear (as AMCT's own example has `fc` with channel_wise false)."""
    out = {"version": 1, "batch_num": batch_num}
    for name, type_name in layers:
        out[name] = {
            "retrain_enable": True,
            "retrain_data_config": {"algo": "ulq_quantize", "dst_type": "INT8"},
            "retrain_weight_config": {"algo": "arq_retrain", "channel_wise": type_name != "Linear", "dst_type": "INT8"},
        }
    return out


def qat_simplified_cfg(skip_layers, batch_num: int = 1) -> str:
    """The simplified QAT config (`config_defination` of create_quant_retrain_config), protobuf text format."""
    lines = [
        "# AMCT QAT hand-off, written because INT8 PTQ missed the accuracy gate.",
        "# On the Ascend host: amct.create_quant_retrain_config(config_file, model, input_data,",
        "#     config_defination='retrain.cfg'); then create_quant_retrain_model, fine-tune,",
        "#     save_quant_retrain_model",
        f"batch_num: {batch_num}",
        "retrain_data_quant_config: {",
        "    ulq_quantize: {",
        "        dst_type: INT8",
        "    }",
        "}",
        "retrain_weight_quant_config: {",
        "    arq_retrain: {",
        "        channel_wise: true",
        "        dst_type: INT8",
        "    }",
        "}",
    ]
    lines += [f"skip_layers: {json.dumps(name)}" for name in skip_layers]
    return "\n".join(lines) + "\n"
