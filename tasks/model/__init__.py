"""The decoder-only model (Llama / Qwen2 families): config and presets, module, loss, HF import/export.

The torch-free names (config, presets, from_pipeline) are imported here; the module, loss and HF I/O on first use
(PEP 562), so importing a light submodule (`tasks.model.model_dir`, `tasks.model.config`) does not import torch: a
stage that refuses a bad config answers in a fraction of a second, not after torch's ~2 s import."""

from importlib import import_module

from tasks.model.config import PRESETS, TransformerConfig, flops_per_token, get_preset, num_params
from tasks.model.resolve import from_pipeline

_LAZY = {
    "load_hf": "hf_io",
    "save_hf": "hf_io",
    "lm_loss": "loss",
    "Transformer": "transformer",
    "build_model": "transformer",
    "materialize": "transformer",
}

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


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"tasks.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'tasks.model' has no attribute {name!r}")
