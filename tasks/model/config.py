"""The model's config is tasks.shape.TransformerConfig, the one model-shape type (presets, `from_preset`,
`from_hf_config`), re-exported here with tasks.planner.memory's counts of it (num_params, flops_per_token)."""

from tasks.planner.memory import flops_per_token, moe_layer_params, num_params
from tasks.shape import FAMILIES, PRESETS, STANDALONE_VOCAB, TransformerConfig, get_preset

__all__ = [
    "FAMILIES",
    "PRESETS",
    "STANDALONE_VOCAB",
    "TransformerConfig",
    "flops_per_token",
    "get_preset",
    "moe_layer_params",
    "num_params",
]
