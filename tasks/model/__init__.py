"""The decoder-only model (Llama / Qwen2 families): config and presets, module, loss, HF import/export."""

from tasks.model.config import PRESETS, TransformerConfig, flops_per_token, get_preset, num_params
from tasks.model.hf_io import load_hf, save_hf
from tasks.model.loss import lm_loss
from tasks.model.resolve import from_pipeline
from tasks.model.transformer import Transformer, build_model, materialize

__all__ = [
    "PRESETS",
    "TransformerConfig",
    "Transformer",
    "build_model",
    "materialize",
    "from_pipeline",
    "get_preset",
    "num_params",
    "flops_per_token",
    "lm_loss",
    "load_hf",
    "save_hf",
]
