"""MoE router statistics of one step, summed over all ranks: the figures logged with each step (metrics.jsonl)."""

from __future__ import annotations

# Ascend/pytorch torch_npu/csrc/distributed/ProcessGroupHCCL.cpp, checkSupportedDataTypeOfAllReduce: HCCL all_reduce
# takes INT8, INT16, INT32, INT64, FP16, FP32 and BF16 — no FP64 (only Ascend950 adds it); HCCL and NCCL groups take
# tensors on their device only (torch_npu/_init/registry/distributed.py registers hccl for "npu"; NCCL for "cuda").
ROUTER_STATS_DTYPES = ("int64", "float32")


def reduce_router_stats(counts, aux_sum: float, device, tp: int = 1):
    """The one collective of the MoE statistics (every rank calls it): `counts` (int64: tokens per expert of every
    layer, then forwards with an aux loss, then dropped assignments) summed exactly as int64, the aux-loss sum as
    fp32, both on the run's device; divided by tp (the TP ranks of one replica route the same tokens).
    Returns (counts, aux_sum) on the host."""
    import torch
    from tasks import collectives

    counts = counts.to(device=device, dtype=torch.int64)
    aux = torch.tensor([aux_sum], dtype=torch.float32, device=device)
    collectives.all_reduce(counts)
    collectives.all_reduce(aux)
    return (counts // tp).cpu(), float(aux.item()) / tp


def moe_metrics(parts, layer_names: list[str], n_exp: int, tp: int = 1, device="cpu") -> dict:
    """Router statistics of this step summed over all ranks (a collective: every rank calls it): the
    load-balancing loss, the busiest expert's tokens over the mean (worst layer), dropped assignments
    (tasks.model.moe.summarise); {} for a dense model. `layer_names`: every MoE layer of the whole model, so that
    pipeline stages (each holding some of them) add up position by position."""
    import torch

    from tasks.model.moe import collect_stats, summarise

    if not layer_names:  # a dense model: no module to scan (every step; the trainer's overhead, bench_trainer)
        return {}
    st = collect_stats(parts)
    counts = torch.zeros(len(layer_names) * n_exp + 2, dtype=torch.int64)
    for i, name in enumerate(layer_names):
        if name in st["tokens"]:
            counts[i * n_exp : (i + 1) * n_exp] = st["tokens"][name].to(torch.int64)  # whole numbers held in fp64
    counts[-2:] = torch.tensor([st["calls"], st["dropped"]], dtype=torch.int64)
    counts, aux = reduce_router_stats(counts, st["aux_sum"], device, tp)
    tokens = {n: counts[i * n_exp : (i + 1) * n_exp].double() for i, n in enumerate(layer_names)}
    calls, dropped = counts[-2:].tolist()
    out = summarise(tokens, aux, calls, dropped)
    out["moe_tokens_per_expert"] = {
        n.removeprefix("layers.").removesuffix(".moe"): t.tolist() for n, t in tokens.items()
    }
    return out
