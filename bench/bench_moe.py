"""Mixture-of-experts figures (CPU, fp32), each beside its baseline in this run.

- moe.tokens_per_s_ratio_vs_dense_same_active_params: training tokens/s (forward, backward, AdamW) of a MoE model
  (8 experts, top-2, a shared expert) over a dense model of the same active parameters per token (the dense
  SwiGLU width = top_k × expert width + shared width, so both multiply the same number of weights per token, but
  for the router and the shared expert's gate).
  Below 1 is the routing, sorting, gather/scatter and per-expert kernels' overhead; the MoE model holds ~2× the
  parameters (moe.params_ratio_vs_dense).
- moe.grouped_mm_speedup_vs_loop: the same MoE step with torch._grouped_mm over the per-expert loop.
- moe.ep2_all_to_all_share: with expert parallelism over 2 gloo ranks (dp2·ep2, FSDP), the share of the training
  step spent inside the all-to-alls (token counts, dispatch, combine, forward + backward; wall clock, mean of the two
  ranks) — and moe.ep2_planner_all_to_all_share, the planner's α-β prediction for the same layout on the cpu-laptop
  cluster (calls × per-call latency + bytes / bandwidth, tasks/planner/moe.py).
  The measured time splits in two (each call's entry times on both ranks, one monotonic clock):
  moe.ep2_all_to_all_wait_share, the rank waiting inside the call for its peer to arrive (the other rank still
  computing: uneven expert loads, a busy host), and moe.ep2_all_to_all_transfer_share, the rest — the exchange
  itself, which is what the α-β model describes. In milliseconds per step: moe.ep2_all_to_all_transfer_ms_per_step
  vs moe.ep2_planner_all_to_all_ms_per_step (free of the planner's compute estimate, which the shares also
  contain); moe.ep2_all_to_all_calls_per_step counts the calls (the planner's count: 5 per MoE layer).
- moe.gloo_all_to_all_latency_us: α measured on the same 2 ranks, the median of a 1 KB all_to_all_single (the
  cpu-laptop preset's intra_latency_us); moe.gloo_all_to_all_gbps: β, bytes leaving a rank per second in one
  isolated token all-to-all of the step's size, α subtracted (the preset's intra_gbps);
  moe.ep2_alpha_beta_measured_ms_per_step: the planner's α-β formula with these two measured figures. Measured
  transfer above it is the exchange slowed inside the step (gloo's transport threads competing for the 2 cores
  with the ranks' compute, FSDP's own collectives and other jobs), which neither figure of an isolated call holds.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

SEQ, BATCH, STEPS = 128, 8, 6
MOE = dict(
    family="qwen2_moe",
    dim=256,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=1024,
    vocab_size=2048,
    max_seq_len=SEQ,
    qkv_bias=True,
    n_experts=8,
    top_k=2,
    moe_ffn_dim=256,
    shared_ffn_dim=512,
)


def _dense():
    from tasks.model import TransformerConfig

    return TransformerConfig(
        family="qwen2",
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=2 * 256 + 512,
        vocab_size=2048,
        max_seq_len=SEQ,
        qkv_bias=True,
    )


def _tokens_per_s(tcfg, steps=STEPS) -> float:
    import torch

    from tasks.model import build_model, lm_loss, materialize

    model = materialize(build_model(tcfg), "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, tcfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])  # first step warms up
    return BATCH * SEQ / times[len(times) // 2]


def _ep_worker(rank: int, world: int, port: int, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    from tasks.model import TransformerConfig, build_model, lm_loss, materialize
    from tasks.parallel import ep as ep_mod
    from tasks.parallel.fsdp import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = ep_mod.build_mesh("cpu", 1, world, 1, world)
    model = build_model(TransformerConfig(**MOE), "meta")
    ep_mod.apply_ep(model, mesh, world)
    apply_fsdp(model, mesh["dp"], "fp32", True, mesh["dp_rep"])  # ZeRO-3: reshard after forward
    materialize(model, "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randint(0, MOE["vocab_size"], (BATCH // world, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    total = a2a = 0.0
    calls = []
    for step in range(STEPS + 1):
        dist.barrier()
        ep_mod.A2A_LOG = [] if step else None
        before, t0 = ep_mod.A2A_SECONDS[0], time.perf_counter()
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step:
            total += time.perf_counter() - t0
            a2a += ep_mod.A2A_SECONDS[0] - before
            calls += ep_mod.A2A_LOG
    ep_mod.A2A_LOG = None

    # α: a 1 KB all-to-all between the same ranks (128 fp32 each way); β: one of the step's token all-to-alls
    # (BATCH / world sequences × SEQ × top-k rows of dim fp32, half leaving the rank); medians of 50 after 10 warm-up.
    def median_call(n: int) -> float:
        send, recv, times = torch.ones(n), torch.empty(n), []
        for i in range(60):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send)
            if i >= 10:
                times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    lat = median_call(2 * 128)
    rows = BATCH // world * SEQ * MOE["top_k"]
    big = median_call(rows * MOE["dim"])
    gbps = rows * MOE["dim"] * 4 / world / max(big - lat, 1e-9) / 1e9
    everyone = [None] * world
    dist.all_gather_object(everyone, {"calls": calls, "total": total, "a2a": a2a, "lat": lat, "gbps": gbps})
    if rank == 0:
        shares = {"share": 0.0, "wait": 0.0, "transfer": 0.0, "transfer_s": 0.0}
        for me in everyone:
            # the i-th call of every rank is the same collective: whoever entered before the last waited for it
            wait = sum(max(o["calls"][i][0] for o in everyone) - t0 for i, (t0, _) in enumerate(me["calls"]))
            shares["share"] += me["a2a"] / me["total"] / world
            shares["wait"] += wait / me["total"] / world
            shares["transfer"] += (me["a2a"] - wait) / me["total"] / world
            shares["transfer_s"] += (me["a2a"] - wait) / STEPS / world
        with open(out, "w") as f:
            json.dump(
                {
                    **shares,
                    "calls_per_step": len(calls) / STEPS,
                    "latency_s": everyone[0]["lat"],
                    "gbps": everyone[0]["gbps"],
                },
                f,
            )
    dist.destroy_process_group()


def _ep_share() -> dict:
    """Two gloo ranks as two processes running this file (`--ep-rank R PORT OUT`)."""
    import json
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ep.json")
        procs = [
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--ep-rank", str(r), str(port), out], env=env, cwd=root
            )
            for r in range(2)
        ]
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            raise RuntimeError(f"EP bench ranks exited {codes}")
        with open(out) as f:
            return json.load(f)


def run() -> dict:
    from tasks.model import TransformerConfig, num_params
    from tasks.model.moe import GroupedExperts
    from tasks.planner.cluster import get_cluster
    from tasks.layout import Layout
    from tasks.planner.moe import MoeProblem, step_time

    moe, dense = TransformerConfig(**MOE), _dense()
    # equal but for the router and the shared-expert gate (dim · (E + 1) per layer, < 0.5 %)
    assert abs(num_params(moe, active=True) / num_params(dense) - 1) < 0.005
    moe_tps, dense_tps = _tokens_per_s(moe), _tokens_per_s(dense)
    GroupedExperts.use_grouped_mm = False
    try:
        loop_tps = _tokens_per_s(moe)
    finally:
        GroupedExperts.use_grouped_mm = True
    pb = MoeProblem(get_cluster("cpu-laptop"), moe, SEQ, BATCH, precision="fp32")
    predicted = step_time(pb, Layout(dp=2, ep=2, zero=3, recompute="none", micro_batch=BATCH // 2, microbatches=1))
    ep = _ep_share()
    return {
        "moe.tokens_per_s_ratio_vs_dense_same_active_params": round(moe_tps / dense_tps, 3),
        "moe.grouped_mm_speedup_vs_loop": round(moe_tps / loop_tps, 3),
        "moe.params_ratio_vs_dense": round(num_params(moe) / num_params(dense), 2),
        "moe.ep2_all_to_all_share": round(ep["share"], 3),
        "moe.ep2_all_to_all_wait_share": round(ep["wait"], 3),
        "moe.ep2_all_to_all_transfer_share": round(ep["transfer"], 3),
        "moe.ep2_planner_all_to_all_share": round(predicted["all_to_all_share"], 3),
        "moe.ep2_all_to_all_transfer_ms_per_step": round(ep["transfer_s"] * 1e3, 2),
        "moe.ep2_planner_all_to_all_ms_per_step": round(predicted["all_to_all_s"] * 1e3, 2),
        "moe.ep2_all_to_all_calls_per_step": ep["calls_per_step"],
        "moe.ep2_planner_all_to_all_calls_per_step": predicted["all_to_all_calls"],
        "moe.gloo_all_to_all_latency_us": round(ep["latency_s"] * 1e6, 1),
        "moe.gloo_all_to_all_gbps": round(ep["gbps"], 3),
        # the same α-β formula with this host's α and β measured on isolated calls instead of the preset's
        "moe.ep2_alpha_beta_measured_ms_per_step": round(
            1e3
            * (
                predicted["all_to_all_calls"] * ep["latency_s"]
                + predicted["all_to_all_transfer_s"] * get_cluster("cpu-laptop").intra_gbps / ep["gbps"]
            ),
            2,
        ),
    }


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 5 and sys.argv[1] == "--ep-rank":
        _ep_worker(int(sys.argv[2]), 2, int(sys.argv[3]), sys.argv[4])
    else:
        print(run())
