"""TransformerConfig: the shape of one decoder-only model (Llama / Qwen2 / Qwen2-MoE family), presets by name; its
parameter and FLOP counts come from tasks.planner.memory (ModelShape, flops_per_token), the one copy of those formulas
(MoE layers: moe_layer_params, also there).

Presets hold shapes only (no weights). tasks.model.resolve.from_pipeline applies the pipeline's `model.*` overrides on
top of a preset (or of a local HF directory's config.json when `model.hf_path` is set).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tasks.errors import ConfigError
from tasks.planner.memory import flops_per_token, moe_layer_params, num_params, shape_of  # noqa: F401 (re-exported)

FAMILIES = ("llama", "qwen2", "qwen2_moe")


@dataclass
class TransformerConfig:
    family: str = "llama"  # llama | qwen2 | qwen2_moe (decides the HF architecture on export)
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    vocab_size: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 512  # RoPE table length
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections only
    tie_embeddings: bool = False  # output projection shares tok_embeddings.weight
    # Mixture of experts (family qwen2_moe, tasks/model/moe.py); n_experts = 0: a dense model. HF names in comments.
    n_experts: int = 0  # num_experts: routed experts per MoE layer
    top_k: int = 2  # num_experts_per_tok
    moe_ffn_dim: int = 0  # moe_intermediate_size: hidden size of one routed expert
    shared_ffn_dim: int = 0  # shared_expert_intermediate_size (0: no shared expert)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: list = field(default_factory=list)
    aux_loss_coef: float = 0.001  # router_aux_loss_coef: load-balancing loss weight (0 = off)
    capacity_factor: float = 0.0  # 0 = dropless; > 0: an expert takes at most ceil(cf · tokens · k / E) tokens

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

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
        problems += self._moe_problems()
        if problems:
            raise ConfigError(problems)
        return self

    def _moe_problems(self) -> list[str]:
        if (self.family == "qwen2_moe") != (self.n_experts > 0):
            return [
                f"model.n_experts: {self.n_experts} with family {self.family!r}: mixture of experts needs "
                f"family qwen2_moe and n_experts >= 1 (and qwen2_moe needs experts)"
            ]
        if not self.n_experts:
            return []
        problems = []
        if not 1 <= self.top_k <= self.n_experts:
            problems.append(f"model.top_k: {self.top_k} must be between 1 and model.n_experts {self.n_experts}")
        if self.moe_ffn_dim < 1:
            problems.append(f"model.moe_ffn_dim: {self.moe_ffn_dim} must be >= 1")
        if self.shared_ffn_dim < 0 or self.decoder_sparse_step < 1 or self.capacity_factor < 0:
            problems.append(
                "model: shared_ffn_dim >= 0, decoder_sparse_step >= 1 and capacity_factor >= 0 "
                f"(got {self.shared_ffn_dim}, {self.decoder_sparse_step}, {self.capacity_factor})"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= int(i) < self.n_layers]
        if bad:
            problems.append(f"model.mlp_only_layers: {bad} outside layers 0..{self.n_layers - 1}")
        return problems


_LLAMA3 = dict(family="llama", vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=8192)
_QWEN2 = dict(family="qwen2", rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=32768, qkv_bias=True)
_QWEN2_MOE = dict(_QWEN2, family="qwen2_moe", vocab_size=151936, aux_loss_coef=0.001, norm_topk_prob=False)

PRESETS: dict[str, TransformerConfig] = {
    "debug": TransformerConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=256
    ),
    "demo": TransformerConfig(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=2048, max_seq_len=512
    ),
    "qwen2-0.5b": TransformerConfig(
        dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936, tie_embeddings=True, **_QWEN2
    ),
    "qwen2-1.5b": TransformerConfig(
        dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960, vocab_size=151936, tie_embeddings=True, **_QWEN2
    ),
    "qwen2-7b": TransformerConfig(
        dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944, vocab_size=152064, **_QWEN2
    ),
    "llama3-8b": TransformerConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, **_LLAMA3),
    "llama3-70b": TransformerConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, **_LLAMA3),
    # Qwen/Qwen1.5-MoE-A2.7B config.json: hidden_size 2048, intermediate_size 5632, 24 layers, 16 heads (16 KV),
    # num_experts 60, num_experts_per_tok 4, moe_intermediate_size 1408, shared_expert_intermediate_size 5632,
    # norm_topk_prob false, decoder_sparse_step 1, router_aux_loss_coef 0.001, vocab 151936 (14.3B total, 2.7B active).
    "qwen1.5-moe-a2.7b": TransformerConfig(
        dim=2048,
        n_layers=24,
        n_heads=16,
        n_kv_heads=16,
        ffn_dim=5632,
        n_experts=60,
        top_k=4,
        moe_ffn_dim=1408,
        shared_ffn_dim=5632,
        **dict(_QWEN2_MOE, max_seq_len=8192),
    ),
    # Qwen/Qwen2-57B-A14B config.json: hidden_size 3584, intermediate_size 18944, 28 layers, 28 heads (4 KV),
    # num_experts 64, num_experts_per_tok 8, moe_intermediate_size 2560, shared_expert_intermediate_size 20480.
    "qwen2-57b-a14b": TransformerConfig(
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_dim=18944,
        n_experts=64,
        top_k=8,
        moe_ffn_dim=2560,
        shared_ffn_dim=20480,
        **_QWEN2_MOE,
    ),
    # CPU-sized MoE: 8 experts, top-2, a shared expert, every layer sparse.
    "moe-demo": TransformerConfig(
        family="qwen2_moe",
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        vocab_size=2048,
        max_seq_len=512,
        qkv_bias=True,
        n_experts=8,
        top_k=2,
        moe_ffn_dim=128,
        shared_ffn_dim=256,
    ),
    # Llama-2-13B shapes (no GQA, 32k SentencePiece vocabulary).
    "llama-13b": TransformerConfig(
        dim=5120,
        n_layers=40,
        n_heads=40,
        n_kv_heads=40,
        ffn_dim=13824,
        vocab_size=32000,
        rope_theta=10000.0,
        norm_eps=1e-5,
        max_seq_len=4096,
    ),
}
# Small presets take their vocabulary from the project's tokenizer; published models keep their own.
VOCAB_FROM_TOKENIZER = ("debug", "demo", "moe-demo")


def get_preset(name: str) -> TransformerConfig:
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    preset = PRESETS[name]
    return dataclasses.replace(preset, mlp_only_layers=list(preset.mlp_only_layers))  # no list shared with PRESETS
