"""Enumerate (dp, tp, pp, zero, recompute, micro-batch, schedule), estimate memory and step time, rank, explain.

Rank layout: TP innermost (inside a node), then PP, DP outermost — so a TP group never leaves a node, PP crosses
nodes once tp·pp exceeds a node, and DP crosses nodes once the world does.

Step time (communication is added to compute except where the trainer overlaps it; ranks compare like with like):
- compute: FLOPs / (world × peak × efficiency), FLOPs = tokens × memory.flops_per_token (6 × matmul params +
  12·L·h·s attention),
  plus the recomputed forward (full: 2 × layer params + 4·L·h·s per token; selective: the attention core 4·L·h·s,
  or nothing with fused attention, where selective recomputes element-wise ops only) of the layers recompute wraps
  (with parallel.recompute_every k, those whose index is a multiple of k: memory.recomputed_share); where pp
  (× virtual stages) does not divide the layers, training splits them unevenly (tasks/parallel/pp.layer_ranges) and
  the rank with the most layers (the first) bounds the step: the layers' compute, TP traffic and DP shard are its;
- pipeline bubble: compute × (m + p − 1)/m for GPipe and 1F1B (bubble fraction (p − 1)/(m + p − 1)),
  × (1 + (p − 1)/(v·m)) for interleaved 1F1B (Narayanan et al. 2021, §2.2);
- TP: 4 all-reduces of s·b·h activations per layer and micro-batch (2 forward, 2 backward; 2 more forward with full
  recompute), ring cost 2(t−1)/t × bytes / intra-node bandwidth (SP's all-gather + reduce-scatter move the same);
- PP: one activation send forward and one gradient send backward per micro-batch and (virtual) stage boundary;
- DP (ring, (d−1)/d × bytes per reduce-scatter or all-gather), as tasks/parallel runs it: ZeRO 0/1 all-reduce the
  fp32 gradients (2 passes) in buckets launched from backward hooks (tasks/parallel/dp.py), so only what backward
  (2/3 of the compute) cannot hide is exposed — at least the last bucket's share —, and ZeRO-1's owners then
  broadcast their updated fp32 parameters (an all-gather's volume, after the update: exposed); ZeRO-2
  reduce-scatters the gradients and all-gathers the 16-bit parameters once; ZeRO-3 all-gathers them for every
  micro-batch's forward and backward (ZeRO paper §7: 1.5× the all-reduce volume with one micro-batch), except
  under PP, where FSDP keeps them gathered through the step (Layout.reshard_after_forward): ZeRO-2's traffic.
  `dp_comm_s` is the DP traffic's time, `dp_exposed_s` what of it the step waits for.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from tasks.planner.cluster import Cluster
from tasks.layout import DP_BUCKET_BYTES, DP_FIRST_BUCKET_BYTES, Layout, check
from tasks.planner.memory import PRECISION_BYTES, estimate, flops_per_token, rank_layers, recomputed_share
from tasks.shape import TransformerConfig
from tasks.units import GB

FP32_PEAK_FRACTION = 0.5  # fp32 matmuls run as TF32/HF32 at about half the 16-bit peak on A100/H100/910B
GRAD_REDUCE_BYTES = 4  # gradients are reduced in fp32 (Megatron's bf16 default; FSDP2 reduce_dtype here)
BACKWARD_SHARE = 2 / 3  # of a step's compute: backward costs twice the forward (6N = 2N forward + 4N backward)


@dataclass
class Problem:
    cluster: Cluster
    shape: TransformerConfig | None  # None: only `n_params` is known (model-state sums)
    seq_len: int
    global_batch: int
    n_params: float = 0.0
    precision: str = "bf16"
    optimizer: str = "adamw"
    micro_batches: list = field(default_factory=list)  # empty: powers of two that divide the per-rank batch
    microbatches: int = 0  # > 0 (parallel.microbatches set): only micro-batch = per-rank batch / this is tried
    zero_stages: list = field(default_factory=lambda: [0, 1, 2, 3])
    recompute: list = field(default_factory=lambda: ["none", "selective", "full"])
    schedules: list = field(default_factory=lambda: ["1f1b", "gpipe", "interleaved1f1b"])
    virtual: int = 2
    recompute_every: int = 1  # parallel.recompute_every: recompute only layers whose index is a multiple of it
    sequence_parallel: bool = True
    flash_attention: bool = True  # the model's SDPA is a fused kernel on every backend
    efficiency: float = 0.4
    pins: dict = field(default_factory=dict)  # {"dp"|"tp"|"pp": n} fixes that degree
    tp_refused: str = ""  # why training refuses tp > 1 with this config (train.compile, qat_int8), else ""
    kept_schedule: str = ""  # parallel.pp_schedule training keeps whatever pp the plan picks (explicit or pinned)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problem(pb: Problem, dp: int, tp: int, pp: int) -> str | None:
    """Why (dp, tp, pp) cannot run at all, or None."""
    c, sh = pb.cluster, pb.shape
    if dp * tp * pp != c.world:
        return f"dp {dp} × tp {tp} × pp {pp} = {dp * tp * pp} ≠ world {c.world} devices"
    if tp > 1 and pb.tp_refused:
        return pb.tp_refused
    if tp > c.devices_per_node:
        return f"tp {tp} spans nodes ({c.devices_per_node} devices per node)"
    if c.devices_per_node % tp:
        return f"tp {tp} does not divide {c.devices_per_node} devices per node"
    if sh is not None:
        if sh.n_heads % tp:
            return f"tp {tp} does not divide {sh.n_heads} heads"
        if sh.n_kv_heads % tp:
            return f"tp {tp} does not divide {sh.n_kv_heads} KV heads"
        if pp > sh.n_layers:  # training splits the layers unevenly (pp.layer_ranges) but gives each stage one
            return f"pp {pp} exceeds the {sh.n_layers} layers (a pipeline stage holds at least one)"
        if sh.tie_embeddings and pp > 1:  # the trainer (tasks/layout.check) keeps a tied embedding on one stage
            return f"tied embeddings need pp = 1 (pp {pp})"
    if pb.sequence_parallel and tp > 1 and pb.seq_len % tp:
        return f"tp {tp} does not divide seq len {pb.seq_len} (sequence parallel)"
    if pb.global_batch % dp:
        return f"dp {dp} does not divide global batch {pb.global_batch}"
    return None


def train_problem(pb, lay: Layout) -> str | None:
    """Why the training stage would refuse `lay` (its own check, tasks.layout.check, and tp > 1 where the config
    refuses tensor parallelism: `pb.tp_refused`), or None: the plan never chooses a layout training refuses.
    Shared by the dense and the mixture-of-experts search."""
    if lay.tp > 1 and getattr(pb, "tp_refused", ""):
        return pb.tp_refused
    if pb.shape is None:  # a bare parameter count: no shape to check
        return None
    c = pb.cluster
    problems = check(lay, pb.shape, pb.seq_len, c.world, f"{c.nodes}×{c.devices_per_node} {c.name} devices")
    return problems[0] if problems else None


def schedule_problem(pb: Problem, lay: Layout) -> str | None:
    p, m = lay.pp, lay.n_microbatches
    if p == 1:  # no pipeline: a kept interleaved schedule is train_problem's (it needs pp >= 2)
        return None
    # torch.distributed.pipelining.Schedule1F1B refuses it; training (tasks.layout.check) also for interleaved 1F1B
    if lay.pp_schedule in ("1f1b", "interleaved1f1b") and m < p:
        return f"{lay.pp_schedule} needs >= {p} micro-batches per rank, got {m}"
    if lay.pp_schedule == "interleaved1f1b":  # uneven stages train (pp.layer_ranges); more than layers: train_problem
        rounds = max(1, m // p)  # ScheduleInterleaved1F1B's own check
        if m % rounds:
            return f"interleaved: {m} micro-batches is not a multiple of {rounds} rounds"
    return None


def _ring(bytes_: float, n: int, gbps: float, factor: float = 2.0) -> float:
    """Seconds for a ring collective over n ranks: all-reduce factor 2, all-gather / reduce-scatter factor 1."""
    return 0.0 if n <= 1 or bytes_ <= 0 else factor * (n - 1) / n * bytes_ / (gbps * GB)


def _last_bucket_bytes(total: float) -> float:
    """Size of the last gradient bucket of tasks/parallel/dp.py (a first bucket of 1 MiB, then 25 MiB ones): what
    is all-reduced after backward's last gradient, so never hidden."""
    if total <= DP_FIRST_BUCKET_BYTES:
        return total
    rest = total - DP_FIRST_BUCKET_BYTES
    return rest - DP_BUCKET_BYTES * math.floor((rest - 1) / DP_BUCKET_BYTES) if rest > 1 else rest


def achieved_flops(c: Cluster, precision: str, efficiency: float) -> float:
    """FLOP/s one device achieves: its peak × efficiency. An accelerator's peak is its dense 16-bit one and fp32
    runs at FP32_PEAK_FRACTION of it (TF32/HF32 tensor cores); a CPU's peak is its fp32 matmul rate, which its
    bf16 does not beat (no AMX on the project's hosts: docs/benchmarks.md), so no fraction there."""
    fraction = FP32_PEAK_FRACTION if precision == "fp32" and c.kind != "cpu" else 1.0
    return c.peak_tflops * 1e12 * efficiency * fraction


def step_time(pb: Problem, lay: Layout) -> dict[str, float]:
    c, sh, s = pb.cluster, pb.shape, pb.seq_len
    tokens = pb.global_batch * s
    A = PRECISION_BYTES[pb.precision]
    peak = achieved_flops(c, pb.precision, pb.efficiency)
    per_token = flops_per_token(sh, s, pb.n_params)
    p, m = lay.pp, lay.n_microbatches
    if sh is None:
        layer_params = 0.0
        stage_layers = 0.0
    else:
        L, h = sh.n_layers, sh.dim
        attention_fwd = 4.0 * L * h * s
        # Recompute: full repeats the forward; selective the attention core (paper) or, with fused attention, only
        # element-wise ops (the project's policy keeps matmul and attention outputs), whose FLOPs we neglect.
        selective = 0.0 if lay.flash_attention else attention_fwd
        extra = {"full": 2.0 * L * sh.layer_params + attention_fwd, "selective": selective}.get(lay.recompute, 0.0)
        per_token += extra * recomputed_share(L, lay)  # parallel.recompute_every: only the wrapped layers
        layer_params = sh.layer_params
        # The slowest pipeline rank bounds the step: the one holding the most layers (tasks/parallel/pp.py splits
        # them unevenly when pp (× virtual stages) does not divide them; earlier stages take the remainder), so the
        # layers' share of the compute is that rank's layer count × pp, not all of them (the same when even).
        stage_layers = float(len(rank_layers(L, lay, 0)))
        outside = 6.0 * (sh.dim + sh.embedding_params)  # flops_per_token's non-layer part: final norm, output
        if stage_layers * p != L:
            per_token = outside + (per_token - outside) * stage_layers * p / L
    compute = tokens * per_token / (c.world * peak)
    if p == 1:
        bubble = 0.0
    elif lay.pp_schedule == "interleaved1f1b":
        bubble = (p - 1) / (lay.virtual_stages * m + p - 1)
    else:
        bubble = (p - 1) / (m + p - 1)
    pipeline = compute / (1 - bubble)

    tp_s = pp_s = 0.0
    if sh is not None:
        act = s * lay.micro_batch * sh.dim * A
        per_mb = 4 + (2 * recomputed_share(sh.n_layers, lay) if lay.recompute == "full" else 0)
        tp_s = per_mb * m * stage_layers * _ring(act, lay.tp, c.intra_gbps)
        pp_bw = c.inter_gbps if lay.tp * p > c.devices_per_node else c.intra_gbps
        chunks = lay.virtual_stages if lay.pp_schedule == "interleaved1f1b" else 1
        pp_s = 0.0 if p == 1 else 2 * m * chunks * act / (pp_bw * GB)
    shard = (stage_layers * layer_params + sh.embedding_params) / lay.tp if sh else pb.n_params / (lay.tp * p)
    dp_bw = c.inter_gbps if c.world > c.devices_per_node else c.intra_gbps
    grads = _ring(shard * GRAD_REDUCE_BYTES, lay.dp, dp_bw, 1.0)  # one reduce-scatter
    if lay.zero < 2:
        # bucketed all-reduce overlapping backward; ZeRO-1: + the owners' fp32 parameters, after the update
        last = _last_bucket_bytes(shard * GRAD_REDUCE_BYTES)
        exposed = max(_ring(last, lay.dp, dp_bw), 2 * grads - BACKWARD_SHARE * pipeline)
        owners = _ring(shard * 4, lay.dp, dp_bw, 1.0) if lay.zero == 1 else 0.0
        dp_s, dp_exposed = 2 * grads + owners, exposed + owners
    else:
        gather = _ring(shard * A, lay.dp, dp_bw, 1.0)  # one all-gather of the parameters
        dp_s = grads + (2 * m * gather if lay.reshard_after_forward else gather)
        dp_exposed = dp_s
    total = pipeline + tp_s + pp_s + dp_exposed
    return {
        "step_s": total,
        "compute_s": compute,
        "bubble": bubble,
        "tp_comm_s": tp_s,
        "pp_comm_s": pp_s,
        "dp_comm_s": dp_s,
        "dp_exposed_s": dp_exposed,
        "tokens_per_s": tokens / total,
    }


def fixed_micro_batch(micro_batches: list, microbatches: int, per_rank: int) -> tuple[list[int], str | None]:
    """([micro-batch], None) that `microbatches` (parallel.microbatches, set) splits the per-rank batch into, or
    ([], why) when it does not divide that batch or a fixed micro-batch (train.micro_batch, --micro-batch) disagrees.
    Shared by the dense and the mixture-of-experts search."""
    if per_rank % microbatches:
        return [], f"parallel.microbatches {microbatches} does not divide the {per_rank} sequences per dp rank"
    mb = per_rank // microbatches
    if micro_batches and mb not in micro_batches:
        return [], (
            f"micro-batch {micro_batches[0]} × parallel.microbatches {microbatches} ≠ the {per_rank} sequences "
            "per dp rank"
        )
    return [mb], None


def _micro_batches(pb: Problem, per_rank: int) -> list[int]:
    if pb.microbatches:
        return fixed_micro_batch(pb.micro_batches, pb.microbatches, per_rank)[0]
    if pb.micro_batches:
        return list(pb.micro_batches)
    fits = [mb for mb in (1, 2, 4, 8, 16, 32, 64) if per_rank % mb == 0]
    return fits if pb.shape is not None else fits[-1:]  # without a shape the micro-batch changes nothing


def pins_problem(pins: dict, world: int) -> str:
    """Pinned degrees whose product leaves no whole data-parallel degree on `world` devices: more devices than there
    are ("exceeds"), or a count that does not divide them."""
    names = " × ".join(f"{k} {v}" for k, v in pins.items())
    product = math.prod(pins.values())
    if product > world:
        return f"pinned {names}{f' = {product}' if len(pins) > 1 else ''} exceeds world {world} devices"
    return f"pinned {names} does not divide world {world} devices"


def candidates(pb: Problem):
    """Yield (row, reason, layout): every combination; reason None when it can run (memory not yet checked),
    layout None when the row is rejected before a full layout exists."""
    c = pb.cluster
    if pb.pins and c.world % math.prod(pb.pins.values()):
        yield dict(pb.pins), pins_problem(pb.pins, c.world), None
        return
    if len(pb.pins) == 3 and math.prod(pb.pins.values()) != c.world:
        yield dict(pb.pins), layout_problem(pb, pb.pins["dp"], pb.pins["tp"], pb.pins["pp"]), None
        return
    for tp in _divisors(c.world):
        for pp in _divisors(c.world // tp):
            dp = c.world // (tp * pp)
            if any(pb.pins.get(k) and pb.pins[k] != v for k, v in (("dp", dp), ("tp", tp), ("pp", pp))):
                continue
            base = {"dp": dp, "tp": tp, "pp": pp}
            why = layout_problem(pb, dp, tp, pp)
            if why:
                yield base, why, None
                continue
            zeros = pb.zero_stages if dp > 1 else [min(pb.zero_stages)]  # ZeRO shards nothing on one rank
            recomputes = pb.recompute if pb.shape is not None else ["none"]  # no activations without a shape
            per_rank = pb.global_batch // dp
            if pb.microbatches:
                why = fixed_micro_batch(pb.micro_batches, pb.microbatches, per_rank)[1]
                if why:
                    yield {**base, "microbatches": pb.microbatches}, why, None
                    continue
            for mb in _micro_batches(pb, per_rank):
                if per_rank % mb:
                    yield (
                        {**base, "micro_batch": mb},
                        (f"micro-batch {mb} does not divide the {per_rank} sequences per dp rank"),
                        None,
                    )
                    continue
                # pp 1 runs no schedule, but one training keeps is checked (interleaved 1F1B needs pp >= 2)
                for sched in pb.schedules if pp > 1 else [pb.kept_schedule or "1f1b"]:
                    for zero in zeros:
                        for rc in recomputes:
                            lay = Layout(
                                dp=dp,
                                tp=tp,
                                pp=pp,
                                zero=zero,
                                recompute=rc,
                                recompute_every=pb.recompute_every,
                                pp_schedule=sched,
                                micro_batch=mb,
                                microbatches=per_rank // mb,
                                virtual_stages=pb.virtual if sched == "interleaved1f1b" else 1,
                                sequence_parallel=pb.sequence_parallel and tp > 1,
                                global_batch=pb.global_batch,
                                flash_attention=pb.flash_attention,
                            )
                            yield _row(lay), schedule_problem(pb, lay) or train_problem(pb, lay), lay


def _row(lay: Layout) -> dict:
    return {**asdict(lay), "pp_schedule": lay.pp_schedule if lay.pp > 1 else "none"}


def evaluate(pb: Problem, lay: Layout) -> dict:
    """The plan row of one runnable layout: the layout, its memory breakdown and step time."""
    mem = estimate(pb.shape, pb.seq_len, lay, pb.precision, pb.optimizer, pb.n_params, pb.cluster.reserve_gb * GB)
    return {**_row(lay), **mem, **step_time(pb, lay)}


_RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}


def rank_key(plan: dict):
    # Faster first; ties (within rounding) go to the larger micro-batch — bigger GEMMs run nearer peak, which the
    # model does not see — then to less recompute (its element-wise share is not costed), then the smaller footprint.
    return (
        float(f"{plan['step_s']:.3g}"),
        -plan["micro_batch"],
        _RECOMPUTE_ORDER[plan["recompute"]],
        plan["total_bytes"],
    )


def feasible(pb, rows, evaluate_fn) -> tuple[list[dict], list[dict]]:
    """(plans that fit the device memory, rejections with their reason) from candidate (row, why, layout) rows;
    shared by the dense search and the MoE search (planner/moe.py)."""
    limit = pb.cluster.memory_gb * GB
    plans, rejected = [], []
    for row, why, lay in rows:
        if why:
            rejected.append({**row, "reason": why})
            continue
        plan = evaluate_fn(pb, lay)
        if plan["total_bytes"] > limit:
            rejected.append(
                {**plan, "reason": f"needs {plan['total_bytes'] / GB:.1f} GB > {pb.cluster.memory_gb:g} GB"}
            )
        else:
            plans.append(plan)
    return plans, rejected


def search(pb: Problem) -> dict:
    """{"plans": feasible plans best first, "rejected": [{..., "reason"}]}."""
    plans, rejected = feasible(pb, candidates(pb), evaluate)
    if pb.shape is None:  # TP/PP traffic is unknown without a shape: the least model parallelism that fits first
        plans.sort(key=lambda p: (p["tp"] * p["pp"], rank_key(p)))
    else:
        plans.sort(key=rank_key)
    rejected.sort(key=lambda r: r.get("total_bytes", float("inf")))
    return {"plans": plans, "rejected": rejected}
