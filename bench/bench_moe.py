"""Mixture-of-experts figures (CPU, fp32), each beside its baseline in this run.

- moe.tokens_per_s_ratio_vs_dense_same_active_params: training tokens/s (forward, backward, AdamW) of a MoE model
  (8 experts, top-2, a shared expert) over a dense model of the same active parameters per token (the dense
  SwiGLU width = top_k × expert width + shared width, so both multiply the same number of weights per token, but
  for the router and the shared expert's gate).
  Below 1 is the routing, sorting, gather/scatter and per-expert kernels' overhead; the MoE model holds ~3× the
  parameters.
- moe.grouped_mm_speedup_vs_loop: the same MoE step with torch._grouped_mm over the per-expert loop.
- moe.ep2_all_to_all_share: with expert parallelism over 2 gloo ranks (dp2·ep2, FSDP), the share of the training
  step spent inside the token all-to-alls (dispatch + combine, forward + backward; rank 0's wall clock) — and
  moe.ep2_planner_all_to_all_share, the planner's prediction for the same layout on the cpu-laptop cluster.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time

SEQ, BATCH, STEPS = 128, 8, 6
MOE = dict(family="qwen2_moe", dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=1024, vocab_size=2048,
           max_seq_len=SEQ, qkv_bias=True, n_experts=8, top_k=2, moe_ffn_dim=256, shared_ffn_dim=512)


def _dense():
    from tasks.model import TransformerConfig

    return TransformerConfig(family="qwen2", dim=256, n_layers=4, n_heads=4, n_kv_heads=2,
                             ffn_dim=2 * 256 + 512, vocab_size=2048, max_seq_len=SEQ, qkv_bias=True)


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
    apply_fsdp(model, mesh["dp"], "fp32", 3, mesh["dp_rep"])
    materialize(model, "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randint(0, MOE["vocab_size"], (BATCH // world, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    total = a2a = 0.0
    for step in range(STEPS + 1):
        dist.barrier()
        before, t0 = ep_mod.A2A_SECONDS[0], time.perf_counter()
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step:
            total += time.perf_counter() - t0
            a2a += ep_mod.A2A_SECONDS[0] - before
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"share": a2a / total}, f)
    dist.destroy_process_group()


def _ep_share() -> float:
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
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ep-rank", str(r), str(port), out],
                                  env=env, cwd=root) for r in range(2)]
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            raise RuntimeError(f"EP bench ranks exited {codes}")
        with open(out) as f:
            return json.load(f)["share"]


def run() -> dict:
    from tasks.model import TransformerConfig, num_params
    from tasks.model.moe import GroupedExperts
    from tasks.planner.cluster import get_cluster
    from tasks.planner.moe import MoeLayout, MoeProblem, moe_shape_of, step_time

    moe, dense = TransformerConfig(**MOE), _dense()
    # equal but for the router and the shared-expert gate (dim · (E + 1) per layer, < 0.5 %)
    assert abs(num_params(moe, active=True) / num_params(dense) - 1) < 0.005
    moe_tps, dense_tps = _tokens_per_s(moe), _tokens_per_s(dense)
    GroupedExperts.use_grouped_mm = False
    try:
        loop_tps = _tokens_per_s(moe)
    finally:
        GroupedExperts.use_grouped_mm = True
    pb = MoeProblem(get_cluster("cpu-laptop"), moe_shape_of(moe), SEQ, BATCH, precision="fp32")
    predicted = step_time(pb, MoeLayout(2, 2, 3, "none", BATCH // 2, 1))["all_to_all_share"]
    return {"moe.tokens_per_s_ratio_vs_dense_same_active_params": round(moe_tps / dense_tps, 3),
            "moe.grouped_mm_speedup_vs_loop": round(moe_tps / loop_tps, 3),
            "moe.params_ratio_vs_dense": round(num_params(moe) / num_params(dense), 2),
            "moe.ep2_all_to_all_share": round(_ep_share(), 3),
            "moe.ep2_planner_all_to_all_share": round(predicted, 3)}


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 5 and sys.argv[1] == "--ep-rank":
        _ep_worker(int(sys.argv[2]), 2, int(sys.argv[3]), sys.argv[4])
    else:
        print(run())
