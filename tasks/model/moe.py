"""Mixture-of-experts feed-forward (Qwen2-MoE layout): top-k softmax router, routed SwiGLU experts, shared expert.

The math is transformers' `Qwen2MoeSparseMoeBlock`: router logits = x · Wᵀ (model dtype), probabilities = softmax in
fp32, top-k of them (renormalised to sum 1 when `norm_topk_prob`), each token's output = Σ_k p_k · expert_k(x)
+ sigmoid(x · w_gate) · shared_expert(x).

Experts are stored stacked ([E, ffn, dim] for w1/w3, [E, dim, ffn] for w2: torchtitan's GroupedExperts) so FSDP
shards them along the expert dimension and expert parallelism (tasks/parallel/ep.py) gives each rank a block of
experts. Token assignments are sorted by expert and computed with `torch._grouped_mm` where it exists and the
strides allow (16-byte aligned rows), else with a loop over experts — the same result (tests/test_moe.py).

Dropless by default; with `capacity_factor` > 0 an expert takes at most ⌈cf · tokens · k / E⌉ assignments (first
come, in token order), the rest contribute nothing (the shared expert and the residual still carry the token).
transformers' Qwen2-MoE has no capacity: the export computes the dropless model, and says so (`note_capacity`).

Load balancing: each MoE layer adds `aux_loss_coef` × E · Σ_e f_e · P_e (Switch/HF form: f_e the fraction of the
sequence's top-k assignments that go to expert e, P_e the mean router probability), computed per sequence and
averaged over sequences — so data-parallel and micro-batch splits give the same loss (a per-batch statistic would
not). Its gradient is attached to the layer's output (Megatron's aux-loss scaler) so no training loop has to carry
it; `set_aux_scale` matches it to the micro-batch division of the LM loss, `set_loss_scaler` to FP16's loss scale.
With `aux_loss_coef` 0 nothing joins the loss, but the statistic is still computed for the log. Router statistics
(tokens per expert, the aux value, dropped assignments) accumulate in each layer for the trainer to log
(`collect_stats`).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from tasks.model.ffn import FeedForward

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


class _AuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, d(loss)/d(aux) = scale (the aux loss joins the total loss)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        ctx.meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def grouped_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """torch._grouped_mm runs here: it exists, the dtype is fp32/bf16 and every row stride is 16-byte aligned."""
    if _GROUPED_MM is None or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if any(type(w.data if isinstance(w, nn.Parameter) else w) is not torch.Tensor for w in weights):
        return False  # a tensor subclass (torchao INT8, DTensor shards are made local before): the loop
    align = 16 // x.element_size()
    return all(w.dtype == x.dtype for w in weights) and all(s % align == 0 for w in (x, *weights) for s in w.shape[-1:])


def expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int], grouped: bool) -> torch.Tensor:
    """Rows of `x` (sorted by expert, `counts` rows each) times wᵀ of their expert: w [E, out, in] → [rows, out]."""
    if grouped:
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return _GROUPED_MM(x, w.transpose(-2, -1), offs=offs)
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append(F.linear(x[start : start + n], w[e]))  # F.linear: also for INT8 weight tensors (torchao)
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, scale: float):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _recomputing() -> bool:
    """Inside backward (activation checkpointing re-running this forward): statistics were counted already."""
    return torch._C._current_graph_task_id() != -1


_PAUSED = [0]


@contextlib.contextmanager
def stats_paused():
    """Forwards that are not training steps (the pipeline schedule's shape inference on its first step) leave the
    router statistics alone."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


def _counting() -> bool:
    return not _PAUSED[0] and not _recomputing()


def _local(w: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


class GroupedExperts(nn.Module):
    """E SwiGLU experts in three stacked weights (HF per expert j: gate_proj = w1[j], up_proj = w3[j],
    down_proj = w2[j])."""

    use_grouped_mm = True  # False: the loop (tests compare the two)
    grad_scale = 1.0  # expert parallelism: 1 / ep (tasks/parallel/ep.py)

    def __init__(self, dim: int, ffn_dim: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) as this rank computes with them (local shards under EP; the qat_int8 converter's subclass
        fake-quantizes them)."""
        return tuple(_local(w) for w in (self.w1, self.w2, self.w3))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: rows sorted by (local) expert, counts[e] rows for expert e (this rank's experts under EP)."""
        w1, w2, w3 = self.expert_weights()
        if self.grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        grouped = self.use_grouped_mm and grouped_ok(x, w1, w2, w3)
        h = F.silu(expert_matmul(x, w1, counts, grouped)) * expert_matmul(x, w3, counts, grouped)
        return expert_matmul(h, w2, counts, grouped)


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = c.n_experts, c.top_k, c.norm_topk_prob
        self.aux_loss_coef, self.capacity_factor = c.aux_loss_coef, c.capacity_factor
        self.router = nn.Linear(c.dim, c.n_experts, bias=False)
        self.experts = GroupedExperts(c.dim, c.moe_ffn_dim, c.n_experts)
        self.shared = FeedForward(c.dim, c.shared_ffn_dim) if c.shared_ffn_dim else None
        self.shared_gate = nn.Linear(c.dim, 1, bias=False) if c.shared_ffn_dim else None
        self.aux_scale = 1.0  # set_aux_scale: 1 / micro-batches per step
        self.loss_scaler = None  # FP16: the step's LossScaler (set_loss_scaler): its scale multiplies the LM loss
        self.dispatcher = None  # tasks.parallel.ep.AllToAllDispatcher under expert parallelism
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stat_tokens = torch.zeros(self.n_experts, dtype=torch.float64, device="cpu")
        self.stat_aux, self.stat_calls, self.stat_dropped = 0.0, 0, 0  # stat_calls: forwards that computed aux

    def route(self, flat: torch.Tensor):
        logits = self.router(flat)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top_p, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        return probs, top_p.to(logits.dtype), top_i

    def aux_loss(self, probs: torch.Tensor, top_i: torch.Tensor, b: int) -> torch.Tensor:
        """E · Σ_e f_e · P_e per sequence, mean over the b sequences (fp32)."""
        probs = probs.view(b, -1, self.n_experts)
        assigned = F.one_hot(top_i.view(b, -1, self.top_k), self.n_experts).sum(2).float()  # [b, s, E]
        f = assigned.mean(1)  # per sequence: assignments per token to each expert
        p = probs.mean(1)
        return (self.n_experts * (f * p).sum(-1)).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        probs, top_p, top_i = self.route(flat)
        out = self.routed(flat, top_p, top_i)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        out = out.view(b, s, d)
        if self.training and torch.is_grad_enabled():
            if self.aux_loss_coef > 0:
                aux = self.aux_loss(probs, top_i, b)
                scale = self.aux_loss_coef * self.aux_scale
                if self.loss_scaler is not None:  # scaled like the LM loss, or unscaling would divide it away
                    scale *= self.loss_scaler.scale
                out = _AuxLoss.apply(out, aux, scale)
            else:  # off: no gradient, but moe_aux_loss still reports the balance (not a 0.0 that reads as perfect)
                with torch.no_grad():
                    aux = self.aux_loss(probs, top_i, b)
            self.count_aux(aux)
        return out

    def count_aux(self, aux: torch.Tensor) -> None:
        """The router statistics' aux loss (host-side: a float per forward)."""
        if _counting():
            self.stat_aux += float(aux.detach())
            self.stat_calls += 1

    def routed(self, flat: torch.Tensor, top_p: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        n_tok, k, n_exp = flat.shape[0], self.top_k, self.n_experts
        expert_of = top_i.reshape(-1)  # [T·k] assignment → expert
        order = torch.argsort(expert_of, stable=True)  # assignments grouped by expert, token order kept
        counts = torch.bincount(expert_of, minlength=n_exp)
        if _counting():
            self.stat_tokens += counts.detach().to("cpu", torch.float64)
        if self.capacity_factor > 0:
            cap = math.ceil(self.capacity_factor * n_tok * k / n_exp)
            starts = torch.cumsum(counts, 0) - counts
            pos = torch.arange(order.numel(), device=order.device) - starts[expert_of[order]]
            keep = pos < cap
            if _counting():
                self.stat_dropped += int((~keep).sum())
            order, counts = order[keep], counts.clamp(max=cap)
        token = order // k
        xs = flat[token]
        if self.dispatcher is not None:
            ys = self.dispatcher(xs, counts, self.experts)
        else:
            ys = self.experts(xs, counts.tolist())
        ys = ys * top_p.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add_(0, token, ys.to(flat.dtype))


def moe_layers(model) -> list[tuple[str, MoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def set_aux_scale(model, scale: float) -> None:
    for _, m in moe_layers(model):
        m.aux_scale = scale


def set_loss_scaler(model, scaler) -> None:
    """FP16 (tasks/train/loss_scale.py): the LM loss is multiplied by `scaler.scale` before backward and every
    gradient divided by it after; the aux loss's gradient must be scaled the same way (read at each forward: the
    scale changes between steps)."""
    for _, m in moe_layers(model):
        m.loss_scaler = scaler


def collect_stats(models, reset: bool = True) -> dict:
    """Router statistics since the last call, this process only: {layer: tokens per expert}, the mean aux loss,
    dropped assignments. `summarise` turns them (summed over ranks) into logged figures."""
    tokens, aux, calls, dropped = {}, 0.0, 0, 0
    for model in models:
        for name, m in moe_layers(model):
            tokens[name.replace("_checkpoint_wrapped_module.", "")] = m.stat_tokens.clone()
            aux += m.stat_aux
            calls += m.stat_calls
            dropped += m.stat_dropped
            if reset:
                m.reset_stats()
    return {"tokens": tokens, "aux_sum": aux, "calls": calls, "dropped": dropped}


def summarise(tokens: dict, aux_sum: float, calls: int, dropped: int) -> dict:
    """Logged figures: moe_aux_loss (mean over layers and forwards), moe_load_max_over_mean (the worst layer's
    busiest expert over the mean), moe_dropped_frac."""
    if not tokens:
        return {}
    ratios = [float(t.max() / t.mean()) for t in tokens.values() if float(t.sum()) > 0]
    total = sum(float(t.sum()) for t in tokens.values())
    return {
        "moe_aux_loss": aux_sum / calls if calls else 0.0,
        "moe_load_max_over_mean": max(ratios) if ratios else 0.0,
        "moe_dropped_frac": dropped / total if total else 0.0,
    }


def note_capacity(manifest, tcfg) -> None:
    """The export of a model trained with a capacity factor (tasks.model.hf_export): its warning line in the training
    job's log (TransformerConfig.capacity_note) and, in the export's llm-pipeline.json, `moe_capacity`: the factor
    it was trained with and that the exported model routes every token (HF Qwen2-MoE has no capacity)."""
    from pathlib import Path

    from tasks.fsutil import atomic_write_json

    note = tcfg.capacity_note()
    if note is None:
        return
    print(f"warning: {note}", file=sys.stderr, flush=True)
    body = json.loads(Path(manifest).read_text(encoding="utf-8"))
    body["moe_capacity"] = {"trained_capacity_factor": tcfg.capacity_factor, "exported_routes": "every token"}
    atomic_write_json(manifest, body)
