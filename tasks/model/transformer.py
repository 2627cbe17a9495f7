"""One decoder-only transformer for the Llama and Qwen2 families, with torchtitan's module names.

RMSNorm → attention (GQA, RoPE in HF's half-split layout, optional q/k/v bias) → RMSNorm → SwiGLU. Layers live in an
`nn.ModuleDict` keyed "0".."L-1" so a pipeline stage can delete the ones it does not own. Heads are counted from the
weight shapes at run time, so tensor-parallel sharding of wq/wk/wv needs no model change.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from tasks.model.config import TransformerConfig
from tasks.model.ffn import FeedForward
from tasks.model.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in fp32 (as HF does) so BF16 activations keep their scale.
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def rope_table(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """[max_seq_len, 2, head_dim // 2]: cos and sin of position × inverse frequency, fp32.

    Real-valued (not complex) because DTensor and some NPU kernels do not handle complex tensors. On meta (build_model)
    the shape only: arange of a meta tensor would import torch._dynamo (see `embedding`); materialize writes the table.
    """
    if torch.empty(0, device=device).is_meta:
        return torch.empty(max_seq_len, 2, head_dim // 2, device=device)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [b, s, h, d]; rotate pairs (i, i + d/2) — HF's rotate_half layout, so HF weights need no permutation."""
    cos, sin = rope[:, 0].unsqueeze(1), rope[:, 1].unsqueeze(1)  # [s, 1, d/2]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    # Hooks that model converters replace (tasks/model/npu_kernels.py, tasks/quant/export.py): RoPE and the
    # attention kernel itself. Same numerics whichever implementation runs.
    rotate = staticmethod(apply_rope)

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def __init__(self, c: TransformerConfig):
        super().__init__()
        self.head_dim = c.head_dim
        kv_dim = c.n_kv_heads * c.head_dim
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=c.qkv_bias)
        self.wk = nn.Linear(c.dim, kv_dim, bias=c.qkv_bias)
        self.wv = nn.Linear(c.dim, kv_dim, bias=c.qkv_bias)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)

    def forward(self, x, rope):
        b, s, _ = x.shape
        # The table covers max_seq_len; slice it here, where x is the full sequence even when the residual
        # stream outside attention is sharded along the sequence (tensor + sequence parallelism).
        rope = rope[:s]
        # -1: the local head count (all heads, or this rank's share under tensor parallelism).
        q = self.rotate(self.wq(x).view(b, s, -1, self.head_dim), rope).transpose(1, 2)
        k = self.rotate(self.wk(x).view(b, s, -1, self.head_dim), rope).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if q.size(1) != k.size(1):  # GQA: each KV head serves n_heads / n_kv_heads consecutive query heads
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        out = self.attend(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TransformerBlock(nn.Module):
    def __init__(self, c: TransformerConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        if c.is_moe_layer(layer):  # mixture of experts (tasks/model/moe.py) in place of the dense SwiGLU
            self.moe = MoE(c)
        else:
            self.feed_forward = FeedForward(c.dim, c.ffn_dim)

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        ffn = self.moe if "moe" in self._modules else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class _OwnGrad(torch.autograd.Function):
    """Identity whose backward hands on a copy of the gradient (the same values) that nothing else references."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g.clone(memory_format=torch.contiguous_format)


class _TiedLinear(torch.autograd.Function):
    """`F.linear(x, weight)` without a bias, whose backward runs the two `mm`s the linear backward runs, on the same
    operands, and returns their results as they are. For the column-major `weight.t()` that `F.linear` multiplies by,
    torch's mm_mat2_backward (torch/csrc/autograd/FunctionsManual.cpp) computes the weight gradient as
    `grad.t().mm(x).t()` and the transpose's backward transposes it back: the same values as `grad.t().mm(x)` bit
    for bit, but a view of it, which autograd's input buffer does not add to in place. Here it is a tensor of its own,
    so the in-place sum needs no copy (`_OwnGrad` copies a vocab × hidden gradient every backward)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        grad_x = g2.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        return grad_x, g2.t().mm(x.reshape(-1, x.shape[-1]))


class TiedOutput(nn.Linear):
    """The output projection of a model with tied embeddings. Its weight is the embedding's, whose two gradients
    autograd sums in its input buffer (torch/csrc/autograd/input_buffer.cpp accumulate): in place only when one of
    them is a dense tensor that the buffer alone references (tensor and storage), out of place otherwise. The linear
    backward's weight gradient does not qualify (a view), so the output projection's gradient, the embedding's
    (aten::embedding_dense_backward, dense vocab × hidden) and their sum coexisted: the backward's peak over its
    start was 3.0 gradients (vocab 151936, hidden 896, one process); handing on a gradient the buffer owns makes the
    sum in place and the peak 2.0 (it and the embedding's meet before the sum). Same values, bit for bit. On plain
    tensors without autocast `_TiedLinear` computes that gradient as a tensor of its own; a DTensor (tensor
    parallelism), another tensor subclass, autocast (whose casts sit between the weight and the matmul) or the meta
    device takes `_OwnGrad`'s copy instead."""

    def forward(self, x):
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(x)
        plain = type(self.weight) in (torch.Tensor, nn.Parameter) and type(x) is torch.Tensor
        # meta has no autocast state to ask (torch.is_autocast_enabled("meta") raises): the fallback, shapes only
        if plain and self.bias is None and x.device.type != "meta" and not torch.is_autocast_enabled(x.device.type):
            return _TiedLinear.apply(x, self.weight)
        return F.linear(x, _OwnGrad.apply(self.weight), self.bias)


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding on the current device; on meta without its own random init: normal_ of a meta tensor runs a
    Python reference wrapped in torch._disable_dynamo, whose first call imports torch._dynamo and parts of inductor
    (~2.5 s of CPU in every rank and stage process that builds a model on meta; materialize writes every weight)."""
    weight = torch.empty(num, dim)
    return nn.Embedding(num, dim, _weight=weight) if weight.is_meta else nn.Embedding(num, dim)


class Transformer(nn.Module):
    def __init__(self, tcfg: TransformerConfig):
        super().__init__()
        self.config = tcfg.validate()
        self.tok_embeddings = embedding(tcfg.vocab_size, tcfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(tcfg, i) for i in range(tcfg.n_layers)})
        self.norm = RMSNorm(tcfg.dim, tcfg.norm_eps)
        self.output = (TiedOutput if tcfg.tie_embeddings else nn.Linear)(tcfg.dim, tcfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer(
            "rope_cache", rope_table(tcfg.head_dim, tcfg.max_seq_len, tcfg.rope_theta), persistent=False
        )

    def tie_weights(self) -> None:
        """Share the embedding with the output projection (again after to_empty, which allocates them apart)."""
        if self.config.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_rope(self, device=None) -> None:
        """Recompute the RoPE table in fp32 (after to_empty, or after a dtype cast rounded it)."""
        c = self.config
        device = device if device is not None else self.rope_cache.device
        self.rope_cache = rope_table(c.head_dim, c.max_seq_len, c.rope_theta, device=device)

    def init_weights(self, seed: int = 0) -> None:
        """Seeded random init of this module's parameters — local shards only, identical for every layout
        (tasks.model.init.RandomInit: seeded per parameter name and row chunk)."""
        from tasks.model.init import RandomInit, init_local

        init_local(self, RandomInit(seed, self.config.n_layers, self.config.tie_embeddings))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build_model(tcfg: TransformerConfig, device="meta") -> Transformer:
    """The model's structure on `device` (meta: no memory, for planning and for sharding before materialising)."""
    with torch.device(device):
        return Transformer(tcfg)


def materialize(model: Transformer, device, seed: int = 0, source=None) -> Transformer:
    """Allocate (after sharding, if any) on `device` — each rank only its local shards — then write the weights
    (seeded random init, or `source`, e.g. tasks.model.init.HFWeights) and the RoPE table."""
    from tasks.model.init import init_local

    model.to_empty(device=device)
    model.tie_weights()
    if source is None:
        model.init_weights(seed)
    else:
        init_local(model, source)
    model.init_rope()
    return model
