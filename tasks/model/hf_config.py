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


def hf_names(tcfg: TransformerConfig) -> set[str]:
    """Every tensor name a checkpoint of `tcfg` may hold (`lm_head.weight` too when tied: HF re-ties it, some files
    store it anyway); the model reads each (tests/test_hf_audit.py holds this to the built model's own names)."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(tcfg.n_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
        if tcfg.qkv_bias:
            names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
        if not tcfg.is_moe_layer(i):
            names |= {f"{p}mlp.{proj}.weight" for proj in _EXPERT_PROJ}
            continue
        names.add(p + "mlp.gate.weight")
        names |= {f"{p}mlp.experts.{j}.{proj}.weight" for j in range(tcfg.n_experts) for proj in _EXPERT_PROJ}
        if tcfg.shared_ffn_dim:
            names |= {f"{p}mlp.shared_expert.{proj}.weight" for proj in _EXPERT_PROJ}
            names.add(p + "mlp.shared_expert_gate.weight")
    return names


def unused_tensors(tcfg: TransformerConfig, names) -> list[str]:
    """The tensors among `names` (a checkpoint's) that a model of `tcfg` would not read: weights config.json does
    not describe (q/k/v biases of a Qwen2 labelled Llama, an o_proj bias with attention_bias false, layers past
    num_hidden_layers, experts past num_experts), dropped in silence if loading went on. The RoPE table some old
    checkpoints saved (`rotary_emb.inv_freq`) is recomputed, not unused."""
    wanted = hf_names(tcfg)
    return sorted(n for n in names if n not in wanted and "rotary_emb.inv_freq" not in n)


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
    if tcfg.family not in ("llama", "qwen2", "qwen2_moe"):  # added to FAMILIES without its keys below
        raise StageError(
            f"save_hf: no config.json keys for family {tcfg.family}: write the ones whose transformers default differs "
            "from what this model computes in tasks/model/hf_config.py to_hf_config (docs/contributing.md)"
        )
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
    """The shape in `path`'s config.json, held to what a model can be (StageError in one line naming the file): the
    one reader of a checkpoint's config.json (load_hf, verify, HFWeights, and the pipeline's tasks.model.resolve)."""
    try:
        shape = TransformerConfig.from_hf_config(path)
    except (TypeError, AttributeError, ValueError) as e:  # not an object, a number written as a string, …
        raise StageError(
            f"{os.path.join(path, 'config.json')}: unreadable config ({type(e).__name__}: {e}); fix the checkpoint's "
            "config.json (transformers' save_pretrained writes a valid one)"
        ) from None
    return checked_hf_shape(path, shape)


# TransformerConfig fields (as validate() names them, model.<field>) → the config.json key that set them
_HF_KEYS = {
    "model.n_kv_heads": "num_key_value_heads",
    "model.n_heads": "num_attention_heads",
    "model.dim": "hidden_size",
    "model.n_layers": "num_hidden_layers",
    "model.ffn_dim": "intermediate_size",
    "model.vocab_size": "vocab_size",
    "model.max_seq_len": "max_position_embeddings",
    "model.rope_theta": "rope_theta",
    "model.n_experts": "num_experts",
    "model.top_k": "num_experts_per_tok",
    "model.moe_ffn_dim": "moe_intermediate_size",
    "model.mlp_only_layers": "mlp_only_layers",
}


def checked_hf_shape(path: str | os.PathLike, shape: TransformerConfig) -> TransformerConfig:
    """`shape` (read from `path`'s config.json) validated before any model.* override applies: a checkpoint whose own
    config.json is impossible (num_key_value_heads not dividing num_attention_heads: transformers cannot run it
    either) is named by its file and its keys, not as a model.* setting the user never made."""
    from tasks.errors import ConfigError

    try:
        return shape.validate()
    except ConfigError as e:
        said = str(e)
        for ours, theirs in _HF_KEYS.items():
            said = said.replace(ours, theirs)
        raise StageError(
            f"{os.path.join(path, 'config.json')}: not a valid model ({said}); fix the checkpoint's config.json"
        ) from None
