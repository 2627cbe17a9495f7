"""The model of a pipeline run: a preset (or a local HF directory's config.json) plus the `model.*` overrides."""

from __future__ import annotations

from tasks.config import repo_path
from tasks.errors import ConfigError
from tasks.model.config import VOCAB_FROM_TOKENIZER, TransformerConfig, get_preset
from tasks.model.hf_config import read_hf_config

_OVERRIDES = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "vocab_size",
    "rope_theta",
    "max_seq_len",
    "n_experts",
    "top_k",
    "moe_ffn_dim",
)
# Set even when 0 (0 is meaningful): applied when the pipeline config gives a value >= 0 (-1 = the preset's).
_OVERRIDES_SIGNED = ("aux_loss_coef", "capacity_factor")


def from_pipeline(cfg, vocab_size: int | None = None) -> TransformerConfig:
    """The model of a PipelineConfig: preset (or HF config.json) + non-zero `model.*` overrides.

    `vocab_size` is the tokenizer's size: it fills the embedding of small presets and must fit in any model.
    """
    mc = cfg.model
    if mc.hf_path:
        tcfg = read_hf_config(repo_path(mc.hf_path))
    else:
        tcfg = get_preset(mc.preset)
        if vocab_size and mc.preset in VOCAB_FROM_TOKENIZER:
            tcfg.vocab_size = vocab_size
    for name in _OVERRIDES:
        value = getattr(mc, name)
        if value:
            setattr(tcfg, name, type(getattr(tcfg, name))(value))
    for name in _OVERRIDES_SIGNED:
        value = getattr(mc, name, -1)
        if value >= 0:
            setattr(tcfg, name, float(value))
    tcfg.validate()
    if vocab_size and vocab_size > tcfg.vocab_size and mc.hf_path:
        raise ConfigError(
            f"model.hf_path: the shard set's tokenizer has {vocab_size} tokens but the checkpoint's "
            f"embedding only {tcfg.vocab_size}; shard with the checkpoint's own tokenizer "
            f"(data.tokenizer={mc.hf_path})"
        )
    if vocab_size and vocab_size > tcfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size: tokenizer has {vocab_size} tokens but the model embedding only "
            f"{tcfg.vocab_size}; set model.vocab_size >= {vocab_size} (or 0 for a small preset)"
        )
    seq_len = cfg.data.seq_len
    if seq_len > tcfg.max_seq_len:
        raise ConfigError(
            f"data.seq_len: {seq_len} exceeds model max_seq_len {tcfg.max_seq_len}; set model.max_seq_len >= {seq_len}"
        )
    return tcfg
