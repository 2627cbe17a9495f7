"""Greedy decoding with a KV cache for tasks.model.Transformer, through the model's own modules (so a torchao- or
AMCT-quantized Linear is what runs): a prefill over the prompt, then one token per step attending to the cache.

Used by evaluation (greedy continuations) and the quantization benchmark (prefill and decode latency).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tasks.model.transformer import apply_rope


def _attend(attn, x, rope, cache, layer: int):
    b, s, _ = x.shape
    q = apply_rope(attn.wq(x).view(b, s, -1, attn.head_dim), rope).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(b, s, -1, attn.head_dim), rope).transpose(1, 2)
    v = attn.wv(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
    if layer in cache:
        k, v = torch.cat([cache[layer][0], k], dim=2), torch.cat([cache[layer][1], v], dim=2)
    cache[layer] = (k, v)
    if q.size(1) != k.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    # The prompt attends causally; a single new token attends to everything cached (all earlier positions).
    out = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1)
    return attn.wo(out.transpose(1, 2).reshape(b, s, -1))


@torch.no_grad()
def forward_cached(model, tokens: torch.Tensor, cache: dict, start: int) -> torch.Tensor:
    """Logits of `tokens` [b, s] at positions start..start+s-1, reading and extending `cache` (layer → (k, v))."""
    rope = model.rope_cache[start : start + tokens.size(1)]
    h = model.tok_embeddings(tokens)
    for i, block in enumerate(model.layers.values()):
        h = h + _attend(block.attention, block.attention_norm(h), rope, cache, i)
        ffn = block.moe if "moe" in block._modules else block.feed_forward  # mixture of experts: its MoE block
        h = h + ffn(block.ffn_norm(h))
    return model.output(model.norm(h))


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[b, new_tokens] argmax continuation of `prompt` [b, s] (prompt + new tokens must fit max_seq_len)."""
    if prompt.size(1) + new_tokens > model.config.max_seq_len:
        raise ValueError(
            f"prompt {prompt.size(1)} + {new_tokens} new tokens exceed max_seq_len {model.config.max_seq_len}"
        )
    cache: dict = {}
    logits = forward_cached(model, prompt, cache, 0)
    out = [logits[:, -1].argmax(-1, keepdim=True)]
    for i in range(new_tokens - 1):
        logits = forward_cached(model, out[-1], cache, prompt.size(1) + i)
        out.append(logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(out, dim=1)
