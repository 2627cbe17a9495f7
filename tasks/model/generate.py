"""Greedy decoding with a KV cache for tasks.model.Transformer, through the model's own modules (so a torchao- or
AMCT-quantized Linear is what runs): a prefill over the prompt, then one token per step attending to the cache.

Used by evaluation (greedy continuations, the lm-eval wrapper's shared-context scoring and batched generation) and
the quantization benchmark (prefill and decode latency). `pad` is the left padding of each row of a batch of
prompts of different lengths: padded keys are masked and each row's positions start at its first real token, as
Hugging Face's generate does with an attention mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tasks.model.transformer import apply_rope


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """apply_rope, also for a per-row table rope [b, s, 2, d/2] (left-padded rows are at different positions)."""
    if rope.dim() == 3:
        return apply_rope(x, rope)
    cos, sin = rope[:, :, 0].unsqueeze(2), rope[:, :, 1].unsqueeze(2)  # [b, s, 1, d/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


def _attend(attn, x, rope, cache, layer: int, mask):
    b, s, _ = x.shape
    q = _rotate(attn.wq(x).view(b, s, -1, attn.head_dim), rope).transpose(1, 2)
    k = _rotate(attn.wk(x).view(b, s, -1, attn.head_dim), rope).transpose(1, 2)
    v = attn.wv(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
    if layer in cache:
        ck, cv = cache[layer]
        k, v = torch.cat([ck.expand(b, -1, -1, -1), k], dim=2), torch.cat([cv.expand(b, -1, -1, -1), v], dim=2)
    cache[layer] = (k, v)
    if q.size(1) != k.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    # No mask: a prompt on an empty cache attends causally; a single new token attends to everything cached.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and s > 1)
    return attn.wo(out.transpose(1, 2).reshape(b, s, -1))


def _mask_and_rope(model, b: int, s: int, start: int, pad: torch.Tensor | None, device):
    """(attention mask [b|1, 1, s, start + s] or None, RoPE table rows) for `s` new tokens after `start` cached."""
    new = torch.arange(start, start + s, device=device)  # the new tokens' indices in the (cache + new) sequence
    if pad is None:
        rope = model.rope_cache[start : start + s]
        if start == 0 or s == 1:
            return None, rope
        keys = torch.arange(start + s, device=device)
        return (keys[None, :] <= new[:, None])[None, None], rope  # causal, offset by the cache
    pad = pad.to(device)
    rope = model.rope_cache[(new[None, :] - pad[:, None]).clamp(min=0)]  # [b, s, 2, d/2]
    keys = torch.arange(start + s, device=device)[None, None, :]
    causal = keys <= new[None, :, None]
    # padded keys masked; a padded query attends to itself only (a fully masked row would give NaN)
    mask = causal & ((keys >= pad[:, None, None]) | (keys == new[None, :, None]))
    return mask[:, None], rope


@torch.no_grad()
def hidden_cached(model, tokens: torch.Tensor, cache: dict, start: int, pad: torch.Tensor | None = None):
    """Final-norm hidden states [b, s, dim] of `tokens` after `start` cached tokens, reading and extending `cache`
    (layer → (k, v); a cache of batch 1 is shared by every row). `pad`: the left padding of each row [b] of a
    left-padded batch, passed on every call for that batch (prefill and each decode step)."""
    mask, rope = _mask_and_rope(model, tokens.size(0), tokens.size(1), start, pad, tokens.device)
    h = model.tok_embeddings(tokens)
    for i, block in enumerate(model.layers.values()):
        h = h + _attend(block.attention, block.attention_norm(h), rope, cache, i, mask)
        ffn = block.moe if "moe" in block._modules else block.feed_forward  # mixture of experts: its MoE block
        h = h + ffn(block.ffn_norm(h))
    return model.norm(h)


@torch.no_grad()
def forward_cached(model, tokens: torch.Tensor, cache: dict, start: int, pad: torch.Tensor | None = None):
    """Logits of `tokens` [b, s] at positions start..start+s-1, reading and extending `cache` (layer → (k, v))."""
    return model.output(hidden_cached(model, tokens, cache, start, pad))


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
