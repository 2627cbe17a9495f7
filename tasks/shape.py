"""TransformerConfig: the one model-shape type. The model builds it, the planner (dense and MoE) sizes it, the pipeline
config's `model` section resolves to it; presets by name, as litgpt's `Config.from_name(name, **overrides)`:

    TransformerConfig.from_preset("qwen2-0.5b", n_layers=2)      # a preset, some fields changed (None = keep)
    TransformerConfig.from_hf_config("/models/Qwen2-0.5B")       # a local Hugging Face directory's config.json

A preset with `vocab_size` None (the CPU-sized debug, demo, moe-demo) has no vocabulary of its own: the shard set's
tokenizer decides it (`from_preset(name, tokenizer_vocab=n)`, the one place that fills it); without a tokenizer (tests,
benchmarks, `plan --model`) it gets its STANDALONE_VOCAB size. Published presets keep their own vocabulary.

Torch-free and planner-free (a shared layer, like tasks.layout): the shape's own sizes are here (`layer_params`,
`embedding_params`, `expert_params`); whole-model counts, FLOPs and bytes are tasks.planner.memory's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tasks.errors import ConfigError, StageError

FAMILIES = ("llama", "qwen2", "qwen2_moe")
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen2MoeForCausalLM": "qwen2_moe"}
BY_MODEL_TYPE = {family: arch for arch, family in ARCHITECTURES.items()}  # a config.json without `architectures`


@dataclass
class TransformerConfig:
    family: str = "llama"  # llama | qwen2 | qwen2_moe (decides the HF architecture on export)
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    vocab_size: int | None = 2048  # None only in a preset: the shard set's tokenizer decides (from_preset)
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

    @classmethod
    def from_preset(cls, name: str, *, tokenizer_vocab: int | None = None, **overrides) -> "TransformerConfig":
        """Preset `name` with `overrides` (field → value; None keeps the preset's). A preset without a vocabulary
        takes `tokenizer_vocab` (the shard set's tokenizer's size), or without one its STANDALONE_VOCAB size."""
        if problem := preset_problem(name):
            raise ConfigError(problem)
        tcfg = PRESETS[name].override(**overrides)
        if tcfg.vocab_size is None:
            tcfg.vocab_size = tokenizer_vocab or STANDALONE_VOCAB[name]
        return tcfg

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike, **overrides) -> "TransformerConfig":
        """The shape in a local Hugging Face directory's config.json, with `overrides` (None keeps its value)."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise StageError(f"{path}: not a Hugging Face model directory (no config.json)")
        try:
            shape = config_from_hf(json.loads(cfg_path.read_text()))
        except (json.JSONDecodeError, KeyError) as e:
            raise StageError(f"{cfg_path}: unreadable config ({type(e).__name__}: {e})") from None
        except StageError as e:  # what the model cannot represent: which file says it (same type, same retry)
            raise type(e)(f"{cfg_path}: {e}") from None
        return shape.override(**overrides)

    def override(self, **overrides) -> "TransformerConfig":
        """A copy with the fields in `overrides` changed (None: unchanged); an unknown field fails in one line."""
        unknown = sorted(set(overrides) - set(self.__dataclass_fields__))
        if unknown:
            raise ConfigError(
                f"model: unknown field {', '.join(unknown)} (known: {', '.join(self.__dataclass_fields__)})"
            )
        changes = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, **{"mlp_only_layers": list(self.mlp_only_layers), **changes})

    def capacity_note(self) -> str | None:
        """The one line for a MoE model trained with a capacity factor (the train stage's launch warnings, the
        export's log; the export's llm-pipeline.json records the factor: tasks.model.moe.note_capacity), else None:
        transformers' Qwen2MoeSparseMoeBlock has no capacity, so the export, and the quantize and evaluate stages
        that load it, compute the dropless function, not the one trained (what DeepSpeed's eval_capacity_factor,
        ST-MoE's 2.0 at evaluation, do deliberately: here it is said)."""
        if not (self.n_experts and self.capacity_factor > 0):
            return None
        return (
            f"model.capacity_factor {self.capacity_factor:g}: training drops the expert assignments above "
            f"ceil({self.capacity_factor:g} · tokens · top_k / experts) per expert (moe_dropped_frac; its validation "
            "loss too), but the Hugging Face export (Qwen2MoeForCausalLM has no capacity), transformers and the "
            "quantize and evaluate stages route every token: they compute the dropless model, not the one trained; "
            "set model.capacity_factor 0 to train what is exported"
        )

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def layer_params(self) -> int:
        """One dense layer: attention (q/k/v bias for Qwen2), the SwiGLU MLP of width ffn_dim, two norm weights."""
        h, kv = self.dim, self.n_kv_heads * (self.dim // self.n_heads)
        attn = 2 * h * h + 2 * h * kv + (h + 2 * kv if self.qkv_bias else 0)
        return attn + 3 * h * self.ffn_dim + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def expert_params(self) -> int:
        """The routed experts of all MoE layers (the part expert parallelism splits)."""
        return self.n_moe_layers * self.n_experts * 3 * self.dim * self.moe_ffn_dim

    def validate(self) -> "TransformerConfig":
        problems = []
        if self.family not in FAMILIES:
            problems.append(f"model.family: {self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.vocab_size is None:
            problems.append(
                "model.vocab_size: unset (a preset without a vocabulary takes the tokenizer's: from_preset)"
            )
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"model.{name}: {value} must be >= 1")
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


def config_from_hf(hf: dict, rope_scaling_ok: bool = False) -> TransformerConfig:
    """TransformerConfig from a config.json dict; anything this model cannot represent fails in one line.
    `rope_scaling_ok`: a scaled RoPE (Llama-3.1's rope_type llama3, …) is read as the plain shape it has, for a
    planner's what-if (memory and step time do not depend on it); hf_refusal() still says training refuses it."""
    arch, family = _hf_family(hf)
    moe = _moe_from_hf(hf) if family == "qwen2_moe" else {}
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    heads = hf["num_attention_heads"]
    bad = [k for k in _unsupported(hf, family) if not (rope_scaling_ok and k.startswith("rope_type"))]
    if bad:
        raise StageError(_refusal(arch, bad))
    return TransformerConfig(
        family=family,
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=hf.get("max_position_embeddings", MAX_POSITIONS_DEFAULT[family]),
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **moe,
    )


def _refusal(arch: str, bad: list[str]) -> str:
    return (
        f"{arch}: unsupported setting {', '.join(bad)} (this model computes unscaled RoPE, SiLU and no such "
        "bias or window: it would silently compute another function); use a checkpoint without it, or add it to "
        "the model (docs/contributing.md, A model family)"
    )


def hf_refusal(hf: dict) -> str:
    """Training's refusal of a config.json whose settings this model cannot compute (config_from_hf's line), else
    "" (an unsupported architecture included: config_from_hf refuses that before anything is read)."""
    arch, family = _hf_family(hf)
    bad = _unsupported(hf, family)
    return _refusal(arch, bad) if bad else ""


def _hf_family(hf: dict) -> tuple[str, str]:
    """(architecture, family) of a config.json; an architecture this model does not have fails in one line."""
    # transformers falls back to model_type when `architectures` is missing (a hand-written config.json): so do we
    arch = (hf.get("architectures") or [BY_MODEL_TYPE.get(hf.get("model_type"))])[0]
    if arch not in ARCHITECTURES:
        raise StageError(
            f"unsupported architecture {arch or hf.get('model_type')!r} (supported: {', '.join(ARCHITECTURES)}; "
            "a new family: docs/contributing.md, A model family)"
        )
    return arch, ARCHITECTURES[arch]


def _unsupported(hf: dict, family: str) -> list[str]:
    """The settings of a config.json this model would compute otherwise than transformers does."""
    # Both keys may be there (transformers 5 writes rope_parameters, older files rope_scaling): any scaling refuses.
    types = [d.get("rope_type", d.get("type")) for d in (hf.get("rope_parameters"), hf.get("rope_scaling")) if d]
    rope_type = next((t for t in types if t not in (None, "default")), "default")
    heads = hf["num_attention_heads"]
    windowed = _windowed_layers(hf, family)
    unsupported = {
        f"hidden_act {hf.get('hidden_act')!r}": hf.get("hidden_act", "silu") not in SILU_ACTS,
        f"rope_type {rope_type!r}": rope_type != "default",
        "attention_bias (o_proj bias)": family == "llama" and hf.get("attention_bias", False),
        # transformers' Qwen2 / Qwen2-MoE MLPs are bias-free whatever mlp_bias says (only LlamaMLP reads it)
        "mlp_bias": family == "llama" and hf.get("mlp_bias", False),
        "head_dim != hidden_size / heads": hf.get("head_dim") not in (None, hf["hidden_size"] // heads),
        f"use_sliding_window (layers not full attention: {', '.join(windowed)})": bool(windowed),
    }
    return [k for k, v in unsupported.items() if v]


# max_position_embeddings where a config.json leaves it out: its Config class's default, as transformers reads it
# (LlamaConfig 2048; Qwen2Config and Qwen2MoeConfig 32768)
MAX_POSITIONS_DEFAULT = {"llama": 2048, "qwen2": 32768, "qwen2_moe": 32768}

# hidden_act names transformers' ACT2FN maps to SiLU (transformers/activations.py: "silu", and "swish" as nn.SiLU)
SILU_ACTS = ("silu", "swish")


def _windowed_layers(hf: dict, family: str) -> list[str]:
    """The layers ("index type") transformers would not run with full causal attention: for Qwen2 / Qwen2-MoE their
    `layer_types`, from config.json or as their Config derives it from use_sliding_window, sliding_window and
    max_window_layers (a use_sliding_window no layer takes up is full attention there, as here). LlamaConfig has no
    window (transformers ignores the key): a Llama config setting it, likely a mislabelled windowed model, is
    refused."""
    n = hf["num_hidden_layers"]
    use = hf.get("use_sliding_window", False)
    if family == "llama":
        return [f"0..{n - 1} use_sliding_window"] if use else []
    if family not in ("qwen2", "qwen2_moe"):  # a family added to FAMILIES without its rule here
        raise StageError(
            f"{family}: no rule for which layers slide: add how its Config sets each layer's attention to "
            "tasks/shape.py _windowed_layers (docs/contributing.md, A model family)"
        )
    types = hf.get("layer_types")
    if types is None and family == "qwen2":  # Qwen2Config: sliding_window None unless use_sliding_window
        window = hf.get("sliding_window", 4096) if use else None
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
    elif types is None:  # Qwen2MoeConfig: every other layer below max_window_layers
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if use and (i + 1) % 2 and i < first else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        return [f"0..{n - 1} layer_types {types!r} (not one type per layer)"]
    types = [{"attention": "full_attention"}.get(t, t) for t in types]  # transformers' legacy name
    return [f"{i} {t}" for i, t in enumerate(types) if t != "full_attention"]


def _moe_from_hf(hf: dict) -> dict:
    if hf.get("num_experts", 60) < 1:
        raise StageError("Qwen2MoeForCausalLM: num_experts 0 (a dense model) is not supported; export it as Qwen2")
    if not hf.get("shared_expert_intermediate_size", 5632):
        raise StageError("Qwen2MoeForCausalLM: shared_expert_intermediate_size 0 is not supported")
    # Defaults are Qwen2MoeConfig's own (transformers), used when a key is absent.
    return dict(
        n_experts=hf.get("num_experts", 60),
        top_k=hf.get("num_experts_per_tok", 4),
        moe_ffn_dim=hf.get("moe_intermediate_size", 1408),
        shared_ffn_dim=hf.get("shared_expert_intermediate_size", 5632),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=list(hf.get("mlp_only_layers") or []),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


_LLAMA3 = dict(family="llama", vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=8192)
_QWEN2 = dict(family="qwen2", rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=32768, qkv_bias=True)
_QWEN2_MOE = dict(_QWEN2, family="qwen2_moe", vocab_size=151936, aux_loss_coef=0.001, norm_topk_prob=False)

PRESETS: dict[str, TransformerConfig] = {
    # CPU-sized: vocab_size None, the shard set's tokenizer decides.
    "debug": TransformerConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=None, max_seq_len=256
    ),
    "demo": TransformerConfig(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=None, max_seq_len=512
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
    # CPU-sized MoE: 8 experts, top-2, a shared expert, every layer sparse; vocabulary from the tokenizer.
    "moe-demo": TransformerConfig(
        family="qwen2_moe",
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        vocab_size=None,
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
# The vocabulary of a preset without one when no tokenizer is given (tests, benchmarks, `plan --model`).
STANDALONE_VOCAB = {"debug": 256, "demo": 2048, "moe-demo": 2048}


def preset_problem(name: str) -> str | None:
    """The one line for a model preset no one registers, else None."""
    return None if name in PRESETS else f"model.preset: unknown preset {name!r} (known: {', '.join(PRESETS)})"


def get_preset(name: str) -> TransformerConfig:
    """TransformerConfig.from_preset(name): a fresh copy (no list shared with PRESETS)."""
    return TransformerConfig.from_preset(name)
