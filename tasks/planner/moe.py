"""Planner for mixture-of-experts models: memory and step time of (dp, ep, zero, recompute, micro-batch) layouts.

The trainer runs MoE with dp/FSDP and expert parallelism (ep carved from dp, tasks/parallel/ep.py), composed with TP
and PP; this planner searches the dp/ep part: tp = pp = 1, or the tp/pp the config pins, whose split of the states and
activations it does not model (its memory is then that of tp = pp = 1: an upper bound). Per device:

- model states (ZeRO §3.1 bytes per parameter, tasks.planner.memory): the non-expert parameters (attention, norms,
  embeddings, routers, shared experts, dense layers) over dp as for a dense model; the routed experts are first
  split over ep (each rank owns E/ep of them) and then ZeRO-sharded over their dp/ep replicas;
- activations per MoE layer and micro-batch: the attention and shared-expert part as a dense layer of width
  shared_ffn (Korthikanti et al. 2022 count, memory.layer_activation_bytes), plus the router's fp32 logits and
  probabilities (8·E bytes per token) and, per routed assignment (tokens × top_k × capacity, capacity 1 when
  dropless: the balanced expectation), the dispatched input and combined output (2h) and the four ffn-wide SwiGLU
  tensors (4·moe_ffn) in 16-bit;
- all-to-all buffers: one layer's send and receive buffers for dispatch (2 × assignments × h × 2 B), live while
  that layer runs;
- ZeRO-3 gather buffer: the current and prefetched layer's gathered parameters (its E/ep local experts included).

Step time: compute = tokens × (6 × active parameters + attention) / (world × peak × efficiency) (active: top_k
experts per token); all-to-all, α-β: calls × the link's per-call latency (cluster.*_latency_us) + bytes / the link's
bandwidth, per MoE layer and micro-batch 5 calls (the token counts, dispatch and combine forward; their reverse in
backward; + 3 under full recompute) of which 4 move tokens (+ 2), each assignments × h × 2 B of which (ep−1)/ep
leaves the device, over the intra-node link while ep fits in a node and the inter-node link otherwise (EP inside a
node preferred); DP = reduce-scatter + all-gather (ZeRO 1/2) or the
ZeRO-3 gathers of the non-expert states over dp and of the expert states over dp/ep, ring cost as in search.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tasks.layout import Layout
from tasks.planner.cluster import Cluster
from tasks.planner.memory import (
    PRECISION_BYTES,
    layer_activation_bytes,
    model_state_bytes,
    num_params,
    token_flops,
)
from tasks.planner.search import (
    GRAD_REDUCE_BYTES,
    _ring,
    _row,
    achieved_flops,
    feasible,
    fixed_micro_batch,
    pins_problem,
    train_problem,
)
from tasks.shape import TransformerConfig
from tasks.units import GB


@dataclass
class MoeProblem:
    cluster: Cluster
    shape: TransformerConfig  # a mixture of experts (n_experts > 0)
    seq_len: int
    global_batch: int
    precision: str = "bf16"
    optimizer: str = "adamw"
    capacity_factor: float = 0.0  # 0 = dropless
    zero_stages: list = field(default_factory=lambda: [1, 2, 3])
    recompute: list = field(default_factory=lambda: ["none", "full"])
    micro_batches: list = field(default_factory=list)
    microbatches: int = 0  # > 0 (parallel.microbatches set): only micro-batch = per-rank batch / this is tried
    recompute_every: int = 1  # parallel.recompute_every: recompute only layers whose index is a multiple of it
    flash_attention: bool = True
    efficiency: float = 0.4
    pins: dict = field(default_factory=dict)  # {"dp"|"ep": n}
    tp: int = 1  # pinned by the config: dp/ep are planned over world / (tp · pp) ranks
    pp: int = 1
    tp_refused: str = ""  # why training refuses tp > 1 with this config (train.compile, qat_int8), else ""
    # the config's own, handed to training unchanged (this planner does not choose them)
    sequence_parallel: bool = True
    pp_schedule: str = "1f1b"
    virtual_stages: int = 2


def _layer_bytes(pb: MoeProblem, lay: Layout, ffn: int, moe: bool = False) -> float:
    """One layer's activation bytes under `lay.recompute`: attention and a dense MLP of width `ffn`, plus, for a
    MoE layer (`moe`, `ffn` the shared expert's width), the router and routed experts' (none under full recompute)."""
    sh, A = pb.shape, PRECISION_BYTES[pb.precision]
    s, b, h = pb.seq_len, lay.micro_batch, sh.dim
    dense = layer_activation_bytes(
        s, b, h, sh.n_heads, 1, False, lay.recompute, ffn, True, A, pb.flash_attention, sh.n_kv_heads
    )
    if not moe or lay.recompute == "full":
        return dense
    assignments = s * b * sh.top_k * (pb.capacity_factor or 1.0)
    return dense + assignments * A * (2 * h + 4 * sh.moe_ffn_dim) + s * b * 8 * sh.n_experts


def _wrapped(sh: TransformerConfig, lay: Layout) -> list[bool]:
    """Per layer, whether recompute wraps it: tasks/parallel/ac.py wraps the layers whose index is a multiple of
    parallel.recompute_every (none without recompute)."""
    return [lay.recompute != "none" and i % max(1, lay.recompute_every) == 0 for i in range(sh.n_layers)]


def memory(pb: MoeProblem, lay: Layout) -> dict[str, float]:
    sh, A = pb.shape, PRECISION_BYTES[pb.precision]
    expert_params, moe_layers = sh.expert_params, sh.n_moe_layers
    dense_params = num_params(sh) - expert_params  # attention, norms, embeddings, routers, shared experts, dense MLPs
    dense = model_state_bytes(dense_params, pb.precision, pb.optimizer, lay.zero, lay.dp)
    experts = model_state_bytes(expert_params / lay.ep, pb.precision, pb.optimizer, lay.zero, lay.dp // lay.ep)
    states = {k: dense[k] + experts[k] for k in dense}
    s, b, h = pb.seq_len, lay.micro_batch, sh.dim
    cap = pb.capacity_factor or 1.0
    assignments = s * b * sh.top_k * cap
    # parallel.recompute_every: recompute wraps only the layers whose index is a multiple of it (tasks/parallel/
    # ac.py); the others keep all their activations
    wrapped = _wrapped(sh, lay)
    moe_rc = sum(1 for i in range(sh.n_layers) if wrapped[i] and sh.is_moe_layer(i))
    dense_rc = sum(wrapped) - moe_rc
    whole = replace(lay, recompute="none")
    act = (
        moe_rc * _layer_bytes(pb, lay, sh.shared_ffn_dim, True)
        + dense_rc * _layer_bytes(pb, lay, sh.ffn_dim)
        + (moe_layers - moe_rc) * _layer_bytes(pb, whole, sh.shared_ffn_dim, True)
        + (sh.n_layers - moe_layers - dense_rc) * _layer_bytes(pb, whole, sh.ffn_dim)
    )
    if lay.recompute == "full" and any(wrapped):  # one layer's activations re-created in backward
        act += layer_activation_bytes(
            s, b, h, sh.n_heads, 1, False, "none", sh.shared_ffn_dim, True, A, pb.flash_attention, sh.n_kv_heads
        ) + assignments * A * (2 * h + 4 * sh.moe_ffn_dim)
    act += (
        8 * s * b + s * b * h + 4 * s * b * h + 4 * s * b * sh.vocab_size
    )  # ids, embedding out, final norm, fp32 logits
    a2a = 2 * assignments * h * A if lay.ep > 1 else 0.0
    layer_params = (dense_params - sh.embedding_params * (1 if sh.tie_embeddings else 2)) / sh.n_layers + (
        expert_params / max(1, moe_layers) / lay.ep
    )
    gather = 2 * layer_params * A if lay.zero >= 3 and lay.dp > 1 else 0.0
    out = {
        **states,
        "activations_bytes": act,
        "all_to_all_bytes": a2a,
        "buffers_bytes": gather,
        "reserve_bytes": pb.cluster.reserve_gb * GB,
    }
    out["total_bytes"] = sum(out.values())
    return out


def estimate_for_run(
    tcfg: TransformerConfig,
    seq_len: int,
    micro_batch: int,
    dp: int = 1,
    ep: int = 1,
    zero: int = 0,
    recompute: str = "none",
    precision: str = "bf16",
    microbatches: int = 1,
    recompute_every: int = 1,
) -> int:
    """Estimated peak bytes the framework allocates on one device for a MoE run with tp = pp = 1 (no runtime
    reserve): memory() above for that layout, what smoke and train compare with the measured peak."""
    from tasks.planner.cluster import get_cluster

    cluster = replace(get_cluster("cpu-laptop"), reserve_gb=0.0)  # only the reserve is read from the cluster
    pb = MoeProblem(
        cluster,
        tcfg,
        seq_len,
        micro_batch * microbatches * dp,
        precision=precision,
        capacity_factor=tcfg.capacity_factor,
    )
    lay = Layout(
        dp=dp,
        ep=ep,
        zero=zero,
        recompute=recompute,
        recompute_every=recompute_every,
        micro_batch=micro_batch,
        microbatches=microbatches,
    )
    return int(memory(pb, lay)["total_bytes"])


def a2a_per_layer(recompute: str) -> tuple[int, int]:
    """(all-to-all calls, token transfers) of one MoE layer and micro-batch under expert parallelism
    (tasks/parallel/ep.py): forward = the token counts (E integers: latency only), dispatch, combine; backward =
    combine's and dispatch's reverse all-to-alls; full recompute runs the forward's three again in backward."""
    calls, transfers = 3 + 2, 2 + 2
    if recompute == "full":
        calls, transfers = calls + 3, transfers + 2
    return calls, transfers


def step_time(pb: MoeProblem, lay: Layout) -> dict[str, float]:
    c, sh, s = pb.cluster, pb.shape, pb.seq_len
    moe_layers = sh.n_moe_layers
    A = PRECISION_BYTES[pb.precision]
    tokens = pb.global_batch * s
    peak = achieved_flops(c, pb.precision, pb.efficiency)
    per_token = token_flops(num_params(sh, active=True), sh.n_layers, sh.dim, s)  # the one formula (planner.memory)
    wrapped = _wrapped(sh, lay)
    if lay.recompute == "full":  # one more forward: (2N + 4·L·h·s) on top of 6N + 12·L·h·s, of the wrapped layers
        per_token *= 1 + sum(wrapped) / sh.n_layers / 3
    compute = tokens * per_token / (c.world * peak)
    inside = lay.ep <= c.devices_per_node
    moe_rc = sum(1 for i, rc in enumerate(wrapped) if rc and sh.is_moe_layer(i))
    (calls, transfers), (rc_calls, rc_transfers) = a2a_per_layer("none"), a2a_per_layer(lay.recompute)
    calls = (moe_layers - moe_rc) * calls + moe_rc * rc_calls  # of all MoE layers, per micro-batch
    transfers = (moe_layers - moe_rc) * transfers + moe_rc * rc_transfers
    a2a_lat = a2a_bw_s = 0.0
    if lay.ep > 1:
        a2a_bw = c.intra_gbps if inside else c.inter_gbps
        alpha = (c.intra_latency_us if inside else c.inter_latency_us) * 1e-6
        per_mb = lay.micro_batch * s * sh.top_k * (pb.capacity_factor or 1.0) * sh.dim * A
        a2a_lat = lay.n_microbatches * calls * alpha
        a2a_bw_s = lay.n_microbatches * transfers * per_mb * (lay.ep - 1) / lay.ep / (a2a_bw * GB)
    a2a = a2a_lat + a2a_bw_s
    dp_bw = c.inter_gbps if c.world > c.devices_per_node else c.intra_gbps
    rep = lay.dp // lay.ep
    rep_bw = c.inter_gbps if lay.dp > c.devices_per_node else c.intra_gbps  # replicas are ep apart
    dp_s = 0.0
    expert_params = sh.expert_params
    dense_params = num_params(sh) - expert_params
    for n_params, n, bw in ((dense_params, lay.dp, dp_bw), (expert_params / lay.ep, rep, rep_bw)):
        grads = _ring(n_params * GRAD_REDUCE_BYTES, n, bw, 1.0)
        gather = _ring(n_params * A, n, bw, 1.0)
        dp_s += grads + (gather if lay.zero < 3 else 2 * lay.n_microbatches * gather)
    total = compute + a2a + dp_s
    return {
        "step_s": total,
        "compute_s": compute,
        "all_to_all_s": a2a,
        "all_to_all_latency_s": a2a_lat,
        "all_to_all_transfer_s": a2a_bw_s,
        "all_to_all_calls": lay.n_microbatches * calls if lay.ep > 1 else 0,
        "dp_comm_s": dp_s,
        "all_to_all_share": a2a / total if total else 0.0,
        "ep_intra_node": inside,
        "tokens_per_s": tokens / total,
    }


def layout_problem(pb: MoeProblem, dp: int, ep: int) -> str | None:
    sh, c = pb.shape, pb.cluster
    if sh.n_experts % ep:
        return f"ep {ep} does not divide the {sh.n_experts} experts"
    if dp % ep:
        return f"ep {ep} does not divide dp {dp}"
    if pb.global_batch % dp:
        return f"dp {dp} does not divide global batch {pb.global_batch}"
    if ep > c.devices_per_node and ep % c.devices_per_node:
        return f"ep {ep} spans nodes unevenly ({c.devices_per_node} devices per node)"
    return None


def candidates(pb: MoeProblem):
    if pb.cluster.world % (pb.tp * pb.pp):  # the pinned tp × pp leave no whole data-parallel degree
        yield (
            {"tp": pb.tp, "pp": pb.pp},
            pins_problem({"tp": pb.tp, "pp": pb.pp}, pb.cluster.world),
            None,
        )
        return
    dp = pb.cluster.world // (pb.tp * pb.pp)
    if pb.pins.get("dp") and pb.pins["dp"] != dp:
        yield (
            {"dp": pb.pins["dp"]},
            (
                f"pinned dp {pb.pins['dp']} ≠ world {pb.cluster.world} devices / tp {pb.tp} / "
                f"pp {pb.pp} = {dp} (dp × tp × pp fills the world)"
            ),
            None,
        )
        return
    pinned_ep = pb.pins.get("ep")
    if pinned_ep and (dp % pinned_ep or pb.shape.n_experts % pinned_ep):  # never reached by the loop below
        yield {"dp": dp, "ep": pinned_ep}, f"pinned {layout_problem(pb, dp, pinned_ep)}", None
        return
    for ep in [d for d in range(1, dp + 1) if dp % d == 0]:
        if pinned_ep and pinned_ep != ep:
            continue
        why = layout_problem(pb, dp, ep)
        if why:
            yield {"dp": dp, "ep": ep}, why, None
            continue
        per_rank = pb.global_batch // dp
        micro_batches = pb.micro_batches
        if pb.microbatches:  # parallel.microbatches set: only the micro-batch it splits the per-rank batch into
            micro_batches, why = fixed_micro_batch(pb.micro_batches, pb.microbatches, per_rank)
            if why:
                yield {"dp": dp, "ep": ep, "microbatches": pb.microbatches}, why, None
                continue
        for mb in micro_batches or [m for m in (1, 2, 4, 8, 16) if per_rank % m == 0]:
            if per_rank % mb:
                yield {"dp": dp, "ep": ep, "micro_batch": mb}, f"micro-batch {mb} does not divide {per_rank}", None
                continue
            for zero in pb.zero_stages:
                for rc in pb.recompute:
                    lay = layout(pb, dp=dp, ep=ep, zero=zero, recompute=rc, micro_batch=mb)
                    why = train_problem(pb, lay)  # what training refuses (pinned tp/pp vs heads, layers, …)
                    yield (_row(lay) if why else None), why, lay


def layout(pb: MoeProblem, dp: int, ep: int, zero: int, recompute: str, micro_batch: int) -> Layout:
    """The training layout of one candidate: the planned dp/ep/zero/recompute/micro-batch, the rest as pinned."""
    return Layout(
        dp=dp,
        tp=pb.tp,
        pp=pb.pp,
        ep=ep,
        zero=zero,
        recompute=recompute,
        recompute_every=pb.recompute_every,
        micro_batch=micro_batch,
        microbatches=pb.global_batch // dp // micro_batch,
        global_batch=pb.global_batch,
        sequence_parallel=pb.sequence_parallel and pb.tp > 1,
        pp_schedule=pb.pp_schedule,
        virtual_stages=pb.virtual_stages if pb.pp_schedule == "interleaved1f1b" else 1,
        flash_attention=pb.flash_attention,
    )


def evaluate(pb: MoeProblem, lay: Layout) -> dict:
    return {**_row(lay), **memory(pb, lay), **step_time(pb, lay)}


def search(pb: MoeProblem) -> dict:
    """{"plans": feasible plans best first (faster; ties to EP inside a node, then less memory), "rejected":
    [{..., "reason"}]}."""
    plans, rejected = feasible(pb, candidates(pb), evaluate)
    plans.sort(key=lambda p: (float(f"{p['step_s']:.3g}"), not p["ep_intra_node"], p["total_bytes"]))
    rejected.sort(key=lambda r: r.get("total_bytes", math.inf))
    return {"plans": plans, "rejected": rejected}


def _line(p: dict) -> str:
    return (
        f"dp{p['dp']}·ep{p['ep']} zero{p['zero']} {p['recompute']:<9} mb{p['micro_batch']}×{p['microbatches']}"
        f"  {p['total_bytes'] / GB:8.2f} GB  step {p['step_s']:.3g} s  all-to-all {p['all_to_all_share']:.0%}"
        f"{'' if p['ep_intra_node'] else ' (EP across nodes)'}"
    )


def _rejected_name(r: dict) -> str:
    keys = (("zero", "zero"), ("recompute", ""), ("micro_batch", "mb"))
    return " ".join([f"dp{r.get('dp')}·ep{r.get('ep')}"] + [f"{label}{r[k]}" for k, label in keys if k in r])


def render(result: dict, header: str, top_k: int = 10, rejected_k: int = 10) -> str:
    """Like tasks.planner.table.render: the top_k feasible plans, then the rejections by its rule."""
    from tasks.planner.table import rejected_lines

    lines = [header, "", f"feasible plans: {len(result['plans'])} (memory per device incl. the runtime reserve)"]
    lines += [f"  {i:>2} {_line(p)}" for i, p in enumerate(result["plans"][:top_k], 1)]
    if len(result["plans"]) > top_k:
        lines.append(f"    … {len(result['plans']) - top_k} more in plan.json")
    lines += rejected_lines(result["rejected"], lambda r: f"{_rejected_name(r)}: {r['reason']}", rejected_k)
    return "\n".join(lines)
