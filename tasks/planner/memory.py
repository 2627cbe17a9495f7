"""Per-device training memory, in bytes, from plain shape numbers (testable without the model package).

Model states follow the ZeRO paper (Rajbhandari et al. 2020, §3.1 and Figure 1): mixed precision keeps a 16-bit
copy of the parameters (2 B) and gradients (2 B) plus K bytes of optimizer state per parameter; for AdamW K = 12
(fp32 master copy + momentum + variance). ZeRO-1 shards the K bytes over data-parallel ranks, ZeRO-2 also the
gradients, ZeRO-3 also the parameters. "Transformer Math 101" (EleutherAI, 2023) lists the same per-parameter
figures: params 2 B (bf16/fp16) or 4 B (fp32), gradients 2 B or 4 B, AdamW 12 B and SGD with momentum 8 B
(fp32 copy + momentum). In pure fp32 training the parameters already are the fp32 copy, so the optimizer adds only
its moments (AdamW 8 B, SGD 4 B): fp32 + AdamW = 4 + 4 + 8 = 16 B per parameter, the same total as mixed precision.
(Megatron keeps fp32 gradients, 18 B per parameter.) `model_state_bytes` is that textbook model; the planner's
estimates use `runtime_state_bytes`, which models exactly what tasks/parallel runs for each ZeRO stage (fp32
parameters and gradients, FSDP2 for stages 2/3, replicated parameters for 0/1).

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Table 2, per transformer layer (s sequence, b micro-batch, h hidden, a heads, t tensor-parallel degree):
  no parallelism        sbh(34 + 5as/h)          TP + selective recompute        sbh(10 + 24/t)
  TP                    sbh(10 + 24/t + 5as/(ht)) TP + SP + selective recompute  sbh(34/t)
  TP + SP               sbh(34/t + 5as/(ht))      full recompute                 2sbh
derived from its §4.1 per-tensor count (16-bit activations, 1-byte dropout masks, a GeLU MLP of width 4h). We keep
that count but let the MLP width be `ffn` and, for gated (SwiGLU) MLPs, store the four ffn-wide tensors eager
PyTorch autograd keeps (gate and up projections, silu(gate), and the down projection's input) instead of GeLU's two.
With ffn = 4h and a GeLU MLP the formulas are exactly Table 2.
"""

from __future__ import annotations

from tasks.layout import Layout, stages_per_rank
from tasks.shape import TransformerConfig

PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIMIZER_STATE_BYTES = {  # (mixed precision, pure fp32) bytes per parameter: see the module docstring
    "adamw": (12, 8),
    "sgd": (8, 4),
}


def flops_per_token(
    shape: TransformerConfig | None, seq_len: int, n_params: float = 0.0, causal: bool = False
) -> float:
    """Training FLOPs per token (forward + backward), the one formula behind the planner's step time and the
    trainer's/benchmarks' MFU. `shape`: a TransformerConfig, or None (then 6 × `n_params`).

    6 × the parameters that multiply (every weight but the embedding lookup; the output projection multiplies tied
    or not) + attention scores and values, 12 · L · h · seq (Kaplan et al. 2020, §2.1; Narayanan et al. 2021, eq. 3
    without recomputation). `causal=True` counts attention as a causal kernel executes it: each query attends to
    (seq + 1) / 2 keys on average, so the attention term is scaled by (seq + 1) / (2 · seq)."""
    if shape is None:
        return 6.0 * n_params
    matmul_params = shape.n_layers * shape.layer_params + shape.dim + shape.embedding_params
    n_moe = shape.n_moe_layers
    if n_moe:  # MoE: a token multiplies its top-k experts, the router and the shared expert
        matmul_params += n_moe * (moe_layer_params(shape, active=True) - 3 * shape.dim * shape.ffn_dim)
    return token_flops(matmul_params, shape.n_layers, shape.dim, seq_len, causal)


def moe_layer_params(tcfg: TransformerConfig, active: bool = False) -> int:
    """One MoE layer's feed-forward parameters: router, routed experts (all, or the top-k a token uses), shared
    expert and its gate."""
    d = tcfg.dim
    experts = tcfg.top_k if active else tcfg.n_experts
    shared = 3 * d * tcfg.shared_ffn_dim + d if tcfg.shared_ffn_dim else 0
    return d * tcfg.n_experts + experts * 3 * d * tcfg.moe_ffn_dim + shared


def num_params(tcfg: TransformerConfig, include_embedding: bool = True, active: bool = False) -> int:
    """Parameter count (a tied output projection counts once): the dense layers, embedding, output projection and
    final norm, with each MoE layer's feed-forward replaced by its router, experts (all, or the top-k a token uses:
    `active`) and shared expert."""
    emb = tcfg.embedding_params
    total = tcfg.n_layers * tcfg.layer_params + emb + (0 if tcfg.tie_embeddings else emb) + tcfg.dim  # + final norm
    total -= 0 if include_embedding else emb
    n_moe = tcfg.n_moe_layers
    if n_moe:
        total += n_moe * (moe_layer_params(tcfg, active) - 3 * tcfg.dim * tcfg.ffn_dim)
    return total


def token_flops(matmul_params: float, layers: int, hidden: int, seq_len: int, causal: bool = False) -> float:
    """6 × the parameters a token multiplies + attention scores and values (12 · L · h · seq; see flops_per_token)."""
    attention = 12.0 * layers * hidden * seq_len * ((seq_len + 1) / (2 * seq_len) if causal else 1.0)
    return 6.0 * matmul_params + attention


def state_bytes_per_param(precision: str, optimizer: str) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter."""
    p = PRECISION_BYTES[precision]
    mixed, pure = OPTIMIZER_STATE_BYTES[optimizer]
    return p, p, (pure if precision == "fp32" else mixed)


def model_state_bytes(
    n_params: float, precision: str = "bf16", optimizer: str = "adamw", zero: int = 0, dp: int = 1
) -> dict[str, float]:
    """ZeRO §3.1: per-device params/grads/optimizer bytes for `n_params` replicated over `dp` ranks."""
    bp, bg, bo = state_bytes_per_param(precision, optimizer)
    return {
        "params_bytes": n_params * bp / (dp if zero >= 3 else 1),
        "grads_bytes": n_params * bg / (dp if zero >= 2 else 1),
        "optimizer_bytes": n_params * bo / (dp if zero >= 1 else 1),
    }


def runtime_state_bytes(
    n_params: float, precision: str = "bf16", optimizer: str = "adamw", zero: int = 0, dp: int = 1
) -> dict[str, float]:
    """Per-device model-state bytes of what the training stage runs (tasks/parallel), not the paper's scheme.

    Parameters and gradients are fp32 (the parameters are the master copy); the optimizer adds its fp32 moments
    (AdamW 8 B, SGD 4 B per parameter). ZeRO 0 (replicated, tasks/parallel/dp.py): everything whole. ZeRO 1: the
    moments sharded over dp. ZeRO 2 and 3 (FSDP2): parameters, gradients and moments sharded; ZeRO 2 also keeps
    every layer's gathered compute-dtype parameters from forward to backward (A bytes per parameter, counted in
    params_bytes); ZeRO 3 regathers one layer at a time (stage_breakdown's buffers_bytes). Mixed precision under
    ZeRO 0/1 is autocast, whose low-precision weight copies live until backward (A bytes per parameter).
    """
    A = PRECISION_BYTES[precision]
    moments = OPTIMIZER_STATE_BYTES[optimizer][1]
    d = max(1, dp)
    sharded = d if zero >= 2 else 1
    compute = 0.0
    if zero < 2 and A < 4:
        compute = A * n_params
    elif zero == 2 and (d > 1 or A < 4):
        compute = A * n_params
    return {
        "params_bytes": 4 * n_params / sharded + compute,
        "grads_bytes": 4 * n_params / sharded,
        "optimizer_bytes": moments * n_params / (d if zero >= 1 else 1),
    }


def layer_activation_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    ffn: int | None = None,
    gated: bool = False,
    act_bytes: int = 2,
    flash: bool = False,
    kv: int | None = None,
) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Table 2 / §4.1).

    `flash`: a fused attention kernel (FlashAttention; torch SDPA on CUDA/CPU, npu_fusion_attention on Ascend) keeps
    no s×s scores, only a fp32 log-sum-exp per head and position — the 5as/h term becomes 4a/h — and the count is
    the project's own implementation (torch DTensor TP, tasks/parallel/tp.py and ac.py): "selective" keeps the block
    input and every matmul and attention output and recomputes the element-wise ops (as torchtitan's op-level
    policy); under sequence parallelism the QKV and MLP matmul inputs are the all-gathered full-sequence tensors,
    which autograd keeps whole (Megatron, whose SP the paper counts, keeps them sharded and all-gathers them again in
    backward: sbh·2/t instead of sbh·2). Without `flash` it is the paper's: "selective" recomputes the attention
    core only. Either way recompute never keeps more than "none" (tests/test_planner_memory.py checks this over the
    planner's whole search space).
    """
    A, sp = act_bytes, sp and t > 1
    if recompute == "full":  # only the layer input is kept; under SP it is sharded along the sequence
        return A * s * b * h / (t if sp else 1)
    ffn = 4 * h if ffn is None else ffn
    # Attention core per sbh: softmax and dropout outputs (16-bit) + the dropout mask (1 B) = 5as/h at 2 B; a fused
    # kernel keeps only the fp32 log-sum-exp.
    core = 4 * a / h if flash else (2 * A + 1) * a * s / h
    if recompute == "selective" and flash:
        kv = a if kv is None else kv
        # Split by TP: q, k, v, the attention output (+ its log-sum-exp) and the gate/up (or GeLU-input) outputs.
        split = A * (2 + 2 * kv / a + (2 if gated else 1) * ffn / h) + core
        # The row-parallel outputs (wo, w2) are full-size partial sums; the block input is sharded under SP.
        return s * b * h * (2 * A + A / (t if sp else 1) + split / t)
    if recompute == "selective":
        core = 0.0
    # Not split by TP (per sbh): two norm inputs, the QKV and MLP inputs (16-bit each) + two 1-byte dropout masks.
    replicated = 4 * A + 2
    # Split by TP: Q, K, V and the output-projection input, plus the ffn-wide MLP tensors.
    split = 4 * A + (4 if gated else 2) * A * ffn / h
    if sp and flash:  # torch SP: the all-gathered QKV and MLP inputs are kept whole (see the docstring)
        return s * b * h * (2 * A + (replicated - 2 * A + split + core) / t)
    per_sbh = (replicated + split + core) / t if sp else replicated + (split + core) / t
    return s * b * h * per_sbh


def in_flight(schedule: str, pp: int, microbatches: int, stage: int, virtual: int = 1) -> float:
    """Micro-batches of activations (in units of one stage's layers) stage `stage` holds at its peak.

    GPipe runs every forward before any backward: all m. 1F1B: stage i holds p - i (the first stage p).
    Interleaved 1F1B (Megatron's warm-up count 2(p-i-1) + (v-1)p, plus the one in flight) holds that many chunks of
    L/(p·v) layers: on the first stage p(1 + (p-1)/(p·v)) stage-equivalents, Korthikanti's interleaving factor.
    """
    if pp == 1:
        return 1.0  # gradient accumulation: one micro-batch at a time
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(pp - stage, microbatches))
    chunks = min(2 * (pp - stage - 1) + (virtual - 1) * pp + 1, microbatches * virtual)
    return chunks / virtual


def rank_layers(n_layers: int, lay: Layout, stage: int) -> list[int]:
    """The global indices of the layers pipeline rank `stage` holds: tasks/parallel/pp.py's split (contiguous
    ranges, earlier stages take the remainder; with interleaved 1F1B the rank owns stages stage, stage + pp, …)."""
    if lay.pp <= 1:
        return list(range(n_layers))
    per_rank = stages_per_rank(lay.pp_schedule, lay.virtual_stages)
    base, extra = divmod(n_layers, lay.pp * per_rank)  # pp.layer_ranges (tasks.parallel imports torch lazily only)
    start = [s * base + min(s, extra) for s in range(lay.pp * per_rank + 1)]
    return [i for k in range(per_rank) for i in range(start[stage + k * lay.pp], start[stage + k * lay.pp + 1])]


def recomputed_share(n_layers: int, lay: Layout, stage: int | None = None) -> float:
    """Share of the layers (all of them, or those of pipeline rank `stage`) that activation checkpointing wraps:
    tasks/parallel/ac.apply_ac wraps the blocks whose layer index is a multiple of parallel.recompute_every, the
    index being the global one on every pipeline stage (tasks/parallel/pp.py keeps the names); the others keep
    all their activations. 0 without recompute."""
    if lay.recompute == "none":
        return 0.0
    layers = range(n_layers) if stage is None else rank_layers(n_layers, lay, stage)
    every = max(1, lay.recompute_every)
    return sum(1 for i in layers if i % every == 0) / max(1, len(layers))


def stage_breakdown(
    shape: TransformerConfig, seq_len: int, lay: Layout, stage: int, precision: str = "bf16", optimizer: str = "adamw"
) -> dict[str, float]:
    """Bytes on one device of pipeline stage `stage` (0 = holds the embedding, pp-1 = holds the output layer)."""
    t, p, A = lay.tp, lay.pp, PRECISION_BYTES[precision]
    first, last = stage == 0, stage == p - 1
    layers = len(rank_layers(shape.n_layers, lay, stage))  # its own count: pp need not divide the layers
    h, v = shape.dim, shape.vocab_size
    # Matrices and the vocabulary are split by TP; norm weights are replicated (2h per layer, h final norm).
    n = layers * ((shape.layer_params - 2 * h) / t + 2 * h)
    if first:
        n += shape.embedding_params / t
    if last:  # final norm + output projection (a tied one is the embedding itself unless the stages differ)
        n += h + (0 if shape.tie_embeddings and p == 1 else shape.embedding_params / t)
    # ZeRO-3 under PP keeps each layer gathered through the step (Layout.reshard_after_forward): ZeRO-2's memory.
    zero = 2 if lay.zero >= 3 and not lay.reshard_after_forward else lay.zero
    states = runtime_state_bytes(n, precision, optimizer, zero, lay.dp)

    s, b = seq_len, lay.micro_batch
    flight = in_flight(lay.pp_schedule, p, lay.n_microbatches, stage, lay.virtual_stages)

    def per_layer(recompute: str) -> float:
        return layer_activation_bytes(
            s,
            b,
            h,
            shape.n_heads,
            t,
            lay.sequence_parallel,
            recompute,
            shape.ffn_dim,
            True,
            A,
            lay.flash_attention,
            shape.n_kv_heads,
        )

    # parallel.recompute_every: only the wrapped layers keep the recompute mode's activations, the rest all of theirs
    share = recomputed_share(shape.n_layers, lay, stage)
    kept, whole = per_layer(lay.recompute), per_layer("none")
    act = (share * kept + (1 - share) * whole) * layers * flight
    if lay.recompute == "full" and share > 0:  # backward of one layer re-creates all of that layer's activations;
        # its kept input is one of them (the attention norm's input), so it is not counted twice
        act += whole - kept
    sp = lay.sequence_parallel and t > 1
    if first:  # Korthikanti §4.3: int64 input ids (8sb) and the embedding dropout mask (sbh, split under SP)
        act += (8 * s * b + s * b * h / (t if sp else 1)) * flight
    if last:  # final-norm and output-layer inputs (4sbh) + fp32 logits for the loss (4sbv, vocab-parallel)
        act += (4 * s * b * h / (t if sp else 1) + 4 * s * b * v / t) * flight
    # ZeRO-3 all-gathers each layer's full parameters before use: the current and the prefetched layer.
    gather = 2 * (shape.layer_params / t) * A if zero >= 3 and lay.dp > 1 else 0.0
    if zero >= 2 and lay.dp > 1:
        # FSDP2's root unit (embedding, output projection) stays gathered from forward through backward
        # (tasks/parallel/fsdp.py; under ZeRO 2 already in params_bytes), and its fp32 gradient is whole until the
        # reduce-scatter at the end of backward.
        root = (shape.embedding_params / t) * (
            (1 if first else 0) + (1 if last and not (shape.tie_embeddings and p == 1) else 0)
        )
        gather += root * (4 + (A if zero >= 3 else 0))
    g = A if zero >= 2 else 4  # gradient bytes: FSDP2's compute dtype (ZeRO 2/3), the fp32 parameter's (0/1)
    if first and t > 1 and not shape.tie_embeddings:
        # TP's vocabulary-sharded embedding (RowwiseParallel, tasks/parallel/tp.py; untied models): DTensor has no
        # vocab-sharded strategy for aten::embedding_dense_backward (torch/distributed/tensor/_ops/
        # _embedding_ops.py lists the column-wise and batch-sharded ones), so the backward builds the whole
        # vocab × hidden gradient as a Partial and reduce-scatters it to this rank's rows. Measured (Qwen2-0.5B
        # shapes with the vocabulary split, dp2×tp2, gloo): two whole-vocabulary gradients at once. (A tied
        # embedding is split along the hidden dimension instead, whose backward stays local.)
        gather += 2 * shape.embedding_params * g
    elif shape.tie_embeddings and first and last:
        # A tied embedding's two gradients: the output projection's (the vocab × hidden weight gradient, a tensor
        # of its own: tasks/model/transformer.TiedOutput) waits in autograd's input buffer while
        # aten::embedding_dense_backward allocates the embedding's dense vocab × hidden gradient; autograd then
        # adds it in place. Two gradient-sized tensors at once where the counts above hold one (measured on one
        # process, vocab 151936, hidden 896: the backward's peak over its start is 2.0 gradients).
        gather += (shape.embedding_params / t) * g  # split like the weight (vocab or hidden)
    return {**states, "activations_bytes": act, "buffers_bytes": gather}


def estimate(
    shape: TransformerConfig | None,
    seq_len: int,
    lay: Layout,
    precision: str = "bf16",
    optimizer: str = "adamw",
    n_params: float | None = None,
    reserve_bytes: float = 0.0,
) -> dict:
    """Per-device peak bytes: the worse of the first and the last pipeline stage, plus the runtime reserve. Each
    stage counts its own layers (rank_layers: pp need not divide them); the first holds the most of them (earlier
    stages take the remainder), the embedding and the most micro-batches in flight, so no middle stage needs more.

    With `shape` None only the model states of `n_params` parameters are known (split evenly over tp·pp).
    """
    if shape is None:
        parts = runtime_state_bytes(n_params / (lay.tp * lay.pp), precision, optimizer, lay.zero, lay.dp)
        parts.update(activations_bytes=0.0, buffers_bytes=0.0)
        worst, stage = parts, 0
    else:
        stages = [stage_breakdown(shape, seq_len, lay, i, precision, optimizer) for i in sorted({0, lay.pp - 1})]
        worst = max(stages, key=lambda d: sum(d.values()))
        stage = 0 if worst is stages[0] else lay.pp - 1
    out = {k: float(v) for k, v in worst.items()}
    out["reserve_bytes"] = float(reserve_bytes)
    out["total_bytes"] = sum(out.values())
    out["peak_stage"] = stage
    return out


def dense_estimate_for_run(
    tcfg: TransformerConfig,
    seq_len: int,
    micro_batch: int,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    zero: int = 0,
    recompute: str = "none",
    precision: str = "bf16",
    optimizer: str = "adamw",
    schedule: str = "1f1b",
    microbatches: int = 1,
    virtual: int = 1,
    sequence_parallel: bool = True,
    flash_attention: bool = True,
    recompute_every: int = 1,
) -> int:
    """Estimated peak bytes the framework allocates on one device for a run (no runtime reserve): what the smoke
    and training stages divide by the measured peak to log `memory.estimate_over_measured` (a dense model;
    tasks.planner.estimate_for_run sends a mixture-of-experts model to tasks.planner.moe)."""
    lay = Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        zero=zero,
        recompute=recompute,
        recompute_every=recompute_every,
        pp_schedule=schedule,
        micro_batch=micro_batch,
        microbatches=microbatches,
        virtual_stages=virtual,
        sequence_parallel=sequence_parallel,
        flash_attention=flash_attention,
    )
    return int(estimate(tcfg, seq_len, lay, precision, optimizer)["total_bytes"])
