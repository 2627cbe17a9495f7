"""MoE router statistics of one step, summed over all ranks: the figures logged with each step (metrics.jsonl)."""

from __future__ import annotations


def moe_metrics(parts, layer_names: list[str], n_exp: int, tp: int = 1) -> dict:
    """Router statistics of this step summed over all ranks (a collective: every rank calls it): the
    load-balancing loss, the busiest expert's tokens over the mean (worst layer), dropped assignments
    (tasks.model.moe.summarise); {} for a dense model. `layer_names`: every MoE layer of the whole model, so that
    pipeline stages (each holding some of them) add up position by position; the TP ranks of one replica route
    the same tokens, hence the division by tp."""
    import torch
    import torch.distributed as dist

    from tasks.model.moe import collect_stats, summarise

    st = collect_stats(parts)
    if not layer_names:
        return {}
    flat = torch.zeros(len(layer_names) * n_exp + 3, dtype=torch.float64)
    for i, name in enumerate(layer_names):
        if name in st["tokens"]:
            flat[i * n_exp : (i + 1) * n_exp] = st["tokens"][name]
    flat[-3:] = torch.tensor([st["aux_sum"], st["calls"], st["dropped"]], dtype=torch.float64)
    dist.all_reduce(flat)
    flat /= tp
    tokens = {n: flat[i * n_exp : (i + 1) * n_exp] for i, n in enumerate(layer_names)}
    aux, calls, dropped = flat[-3:].tolist()
    out = summarise(tokens, aux, round(calls), round(dropped))
    out["moe_tokens_per_expert"] = {
        n.removeprefix("layers.").removesuffix(".moe"): t.tolist() for n, t in tokens.items()
    }
    return out
