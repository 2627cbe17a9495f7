"""Hugging Face names and config.json: our parameter names ↔ HF's (Llama / Qwen2 / Qwen2-MoE) and TransformerConfig
→ config.json (config.json → TransformerConfig is tasks.shape's `from_hf_config`, re-exported here as read_hf_config).
Torch-free: tensors are read and written by tasks.model.init / hf_io / hf_export."""

from __future__ import annotations

import os
import re

from tasks.errors import StageError
from tasks.shape import ARCHITECTURES, TransformerConfig, config_from_hf  # noqa: F401 (re-exported)


_FAMILY_ARCH = {v: k for k, v in ARCHITECTURES.items()}
# HF name (layer part after "model.layers.{i}.") → ours (after "layers.{i}.")
_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    # Qwen2-MoE sparse layers (tasks/model/moe.py)
    "mlp.gate": "moe.router",
    "mlp.shared_expert.gate_proj": "moe.shared.w1",
    "mlp.shared_expert.down_proj": "moe.shared.w2",
    "mlp.shared_expert.up_proj": "moe.shared.w3",
    "mlp.shared_expert_gate": "moe.shared_gate",
}
# Routed experts: HF stores one tensor per expert, we stack them ([E, ...] per projection).
_EXPERT_PROJ = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")
_OUR_EXPERT = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])$")
_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)$")


def hf_to_ours(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def hf_expert(name: str) -> tuple[str, int] | None:
    """HF per-expert tensor name → (our stacked parameter, expert index), None for any other name."""
    m = _HF_EXPERT.match(name)
    return (f"layers.{m.group(1)}.moe.experts.{_EXPERT_PROJ[m.group(3)]}", int(m.group(2))) if m else None


def is_expert_stack(name: str) -> bool:
    return _OUR_EXPERT.match(name) is not None


def expert_hf_name(name: str, j: int) -> str:
    """Our stacked expert parameter and an expert index → that expert's HF tensor name."""
    m = _OUR_EXPERT.match(name)
    proj = {v: k for k, v in _EXPERT_PROJ.items()}[m.group(2)]
    return f"model.layers.{m.group(1)}.mlp.experts.{j}.{proj}.weight"


def ours_to_hf(name: str) -> str:
    top = {v: k for k, v in _TOP_NAMES.items()}
    if name in top:
        return top[name]
    m = _OUR_LAYER.match(name)
    inverse = {v: k for k, v in _LAYER_NAMES.items()}
    if not m or m.group(2) not in inverse:
        raise StageError(f"save_hf: parameter {name!r} has no Hugging Face name")
    return f"model.layers.{m.group(1)}.{inverse[m.group(2)]}.{m.group(3)}"


def to_hf_config(tcfg: TransformerConfig, dtype="float32") -> dict:
    """config.json for `tcfg`; `dtype` a torch.dtype or its name."""
    if tcfg.family == "llama" and tcfg.qkv_bias:
        raise StageError("save_hf: Llama has no q/k/v-only bias; use family qwen2 for a model with qkv_bias")
    if tcfg.family == "qwen2_moe" and not tcfg.shared_ffn_dim:
        raise StageError("save_hf: Qwen2MoeForCausalLM always has a shared expert; set model shared_ffn_dim > 0")
    if tcfg.family == "qwen2" and not tcfg.qkv_bias:
        raise StageError("save_hf: Qwen2 always has q/k/v bias; set qkv_bias or use family llama")
    dtype_name = str(dtype).removeprefix("torch.")
    cfg = {
        "architectures": [_FAMILY_ARCH[tcfg.family]],
        "model_type": tcfg.family,
        "hidden_size": tcfg.dim,
        "intermediate_size": tcfg.ffn_dim,
        "num_hidden_layers": tcfg.n_layers,
        "num_attention_heads": tcfg.n_heads,
        "num_key_value_heads": tcfg.n_kv_heads,
        "head_dim": tcfg.head_dim,
        "vocab_size": tcfg.vocab_size,
        "max_position_embeddings": tcfg.max_seq_len,
        "rms_norm_eps": tcfg.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": tcfg.tie_embeddings,
        # Both spellings: transformers 5 reads rope_parameters, older readers (4.x, vLLM) rope_theta.
        "rope_theta": tcfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": tcfg.rope_theta},
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "use_cache": True,
    }
    if tcfg.family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False)
    if tcfg.family == "qwen2_moe":
        cfg.update(
            qkv_bias=tcfg.qkv_bias,
            num_experts=tcfg.n_experts,
            num_experts_per_tok=tcfg.top_k,
            moe_intermediate_size=tcfg.moe_ffn_dim,
            shared_expert_intermediate_size=tcfg.shared_ffn_dim,
            norm_topk_prob=tcfg.norm_topk_prob,
            decoder_sparse_step=tcfg.decoder_sparse_step,
            mlp_only_layers=list(tcfg.mlp_only_layers),
            router_aux_loss_coef=tcfg.aux_loss_coef,
            output_router_logits=False,
        )
    return cfg


def read_hf_config(path: str | os.PathLike) -> TransformerConfig:
    return TransformerConfig.from_hf_config(path)
