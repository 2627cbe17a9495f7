"""TransformerConfig: the shape of one decoder-only model (Llama / Qwen2 family), presets by name; its parameter
and FLOP counts come from tasks.planner.memory (ModelShape, flops_per_token), the one copy of those formulas.

Presets hold shapes only (no weights). `from_pipeline` applies the pipeline's `model.*` overrides on top of a preset
(or of a local HF directory's config.json when `model.hf_path` is set).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tasks.errors import ConfigError
from tasks.planner.memory import flops_per_token, shape_of  # noqa: F401 (flops_per_token: re-exported)

FAMILIES = ("llama", "qwen2")


@dataclass
class TransformerConfig:
    family: str = "llama"         # llama | qwen2 (decides the HF architecture on export)
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    vocab_size: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 512        # RoPE table length
    qkv_bias: bool = False        # Qwen2: bias on q/k/v projections only
    tie_embeddings: bool = False  # output projection shares tok_embeddings.weight

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> "TransformerConfig":
        problems = []
        if self.family not in FAMILIES:
            problems.append(f"model.family: {self.family!r} is not one of {', '.join(FAMILIES)}")
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                problems.append(f"model.{name}: {getattr(self, name)} must be >= 1")
        if self.n_heads >= 1 and self.dim % self.n_heads:
            problems.append(f"model.n_heads: {self.n_heads} does not divide model.dim {self.dim}")
        elif self.n_heads >= 1 and self.head_dim % 2:
            problems.append(f"model.dim / model.n_heads = {self.head_dim} must be even for RoPE")
        if self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads:
            problems.append(f"model.n_heads: {self.n_heads} is not divisible by model.n_kv_heads {self.n_kv_heads}")
        if self.rope_theta <= 0:
            problems.append(f"model.rope_theta: {self.rope_theta} must be > 0")
        if problems:
            raise ConfigError(problems)
        return self


_LLAMA3 = dict(family="llama", vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=8192)
_QWEN2 = dict(family="qwen2", rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=32768, qkv_bias=True)

PRESETS: dict[str, TransformerConfig] = {
    "debug": TransformerConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256,
                               max_seq_len=256),
    "demo": TransformerConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=2048,
                              max_seq_len=512),
    "qwen2-0.5b": TransformerConfig(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864,
                                    vocab_size=151936, tie_embeddings=True, **_QWEN2),
    "qwen2-1.5b": TransformerConfig(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960,
                                    vocab_size=151936, tie_embeddings=True, **_QWEN2),
    "qwen2-7b": TransformerConfig(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944,
                                  vocab_size=152064, **_QWEN2),
    "llama3-8b": TransformerConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, **_LLAMA3),
    "llama3-70b": TransformerConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, **_LLAMA3),
    # Llama-2-13B shapes (no GQA, 32k SentencePiece vocabulary).
    "llama-13b": TransformerConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824,
                                   vocab_size=32000, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=4096),
}
# Small presets take their vocabulary from the project's tokenizer; published models keep their own.
VOCAB_FROM_TOKENIZER = ("debug", "demo")


def get_preset(name: str) -> TransformerConfig:
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return dataclasses.replace(PRESETS[name])


_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "rope_theta", "max_seq_len")


def from_pipeline(cfg, vocab_size: int | None = None) -> TransformerConfig:
    """The model of a PipelineConfig: preset (or HF config.json) + non-zero `model.*` overrides.

    `vocab_size` is the tokenizer's size: it fills the embedding of small presets and must fit in any model.
    """
    mc = cfg.model
    if mc.hf_path:
        from tasks.model.hf_io import read_hf_config

        from tasks.config import repo_path

        tcfg = read_hf_config(repo_path(mc.hf_path))
    else:
        tcfg = get_preset(mc.preset)
        if vocab_size and mc.preset in VOCAB_FROM_TOKENIZER:
            tcfg.vocab_size = vocab_size
    for name in _OVERRIDES:
        value = getattr(mc, name)
        if value:
            setattr(tcfg, name, type(getattr(tcfg, name))(value))
    tcfg.validate()
    if vocab_size and vocab_size > tcfg.vocab_size:
        raise ConfigError(f"model.vocab_size: tokenizer has {vocab_size} tokens but the model embedding only "
                          f"{tcfg.vocab_size}; set model.vocab_size >= {vocab_size} (or 0 for a small preset)")
    seq_len = cfg.data.seq_len
    if seq_len > tcfg.max_seq_len:
        raise ConfigError(f"data.seq_len: {seq_len} exceeds model max_seq_len {tcfg.max_seq_len}; "
                          f"set model.max_seq_len >= {seq_len}")
    return tcfg


def num_params(tcfg: TransformerConfig, include_embedding: bool = True) -> int:
    """Parameter count (a tied output projection counts once): planner.memory.ModelShape's count of this shape."""
    shape = shape_of(tcfg)
    return shape.num_params - (0 if include_embedding else shape.embedding_params)
