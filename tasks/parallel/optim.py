"""AdamW (or plain SGD, `train.optimizer`) with linear warm-up then cosine decay, and gradient clipping that is exact
across FSDP, TP and PP.

One optimizer (and scheduler) per model part: pipeline ranks with interleaved stages hold several parts, and
DCP's flattened optimizer state dict then merges them by parameter name. On resume the schedule's position comes from
the checkpoint and the schedule itself from this run's config (`load_schedule`).
"""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based): linear warm-up, cosine to min_lr."""
    if lr <= 0:
        return 1.0
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return (min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))) / lr


def build_optimizers(parts, train_cfg, owned: set[str] | None = None):
    """[(optimizer, LambdaLR)] per model part — AdamW, or SGD without momentum for `train.optimizer: sgd`; with
    `owned` (ZeRO-1) each holds only the named parameters this rank owns (the owners broadcast the updates)."""
    import torch
    from torch.distributed.tensor import DTensor

    out = []
    for part in parts:
        params = [p for n, p in part.named_parameters() if p.requires_grad and (owned is None or n in owned)]
        meshes = {p.device_mesh if isinstance(p, DTensor) else None for p in params}
        # foreach kernels reject a mix of plain tensors and DTensors (or DTensors on different meshes).
        foreach = len(meshes) == 1
        if train_cfg.optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay, foreach=foreach)
        else:
            opt = torch.optim.AdamW(
                params,
                lr=train_cfg.lr,
                betas=(0.9, 0.95),
                eps=1e-8,
                weight_decay=train_cfg.weight_decay,
                foreach=foreach,
            )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, train_cfg.warmup_steps, train_cfg.steps, train_cfg.lr, train_cfg.min_lr)
        )
        out.append((opt, sched))
    return out


def resume_schedule(saved: dict, base_lrs: list[float], factor) -> tuple[dict, list[float]]:
    """The LR scheduler state to load on resume, and the lr each param group must start with.

    `saved`: the checkpoint's LambdaLR state_dict (its `base_lrs` are the lr of the run that saved it, and the
    optimizer state restores that run's current lr); `base_lrs`: the lrs of the optimizer built from *this* run's
    config (LambdaLR's `base_lrs` before loading); `factor(k)`: this config's schedule (lr_factor with
    train.warmup_steps, steps, lr, min_lr). The step count (`last_epoch`) is kept; base lrs and the schedule are
    this config's, so a changed train.lr/min_lr/warmup_steps/steps applies from the resumed step on."""
    state = dict(saved, base_lrs=list(base_lrs))
    step = int(saved["last_epoch"])
    state["_last_lr"] = [b * factor(step) for b in base_lrs]
    return state, list(state["_last_lr"])


def schedule_change(old_lr: float, new_lr: float, step: int) -> str | None:
    """The line the trainer logs when the resumed lr differs from the one the checkpoint would have continued with."""
    if math.isclose(old_lr, new_lr, rel_tol=1e-9, abs_tol=0.0):
        return None
    return f"resumed at step {step} with the schedule of this run's config: lr {old_lr:.6g} → {new_lr:.6g}"


def load_schedule(opt, sched, saved: dict) -> str | None:
    """On resume (tasks/parallel/checkpoint.py): the checkpoint's schedule position with this run's schedule. `sched`
    was built from this run's config (its lambda and base lrs), `opt` has just loaded the saved run's state (its lr);
    a changed train.lr/min_lr/warmup_steps/steps applies from the resumed step on. Returns schedule_change's line."""
    base = list(sched.base_lrs)  # this config's lr (LambdaLR keeps each group's initial lr)
    state, lrs = resume_schedule(saved, base, sched.lr_lambdas[0])
    sched.load_state_dict(state)
    for group, lr, b in zip(opt.param_groups, lrs, base):
        group["lr"], group["initial_lr"] = lr, b
    old = saved.get("_last_lr") or [None]
    return schedule_change(old[0], lrs[0], int(saved["last_epoch"])) if old[0] is not None and lrs else None


def grad_norm_and_clip(params, max_norm: float, pp_group=None):
    """Global L2 norm of all gradients, then scale them so the norm is at most `max_norm` (0 = no clipping; a
    non-finite norm leaves them unscaled: that step is not taken, and the diagnosis names the non-finite ones).

    Each rank sums the squares of its local shards; a DTensor's partial sums are all-reduced over the mesh axes
    it is sharded on (FSDP's dp, TP's tp) and not over the axes it is replicated on (a Partial gradient is summed
    into a Replicate one first: the square of a sum is not the sum of the squares); pipeline stages hold
    disjoint parameters, so their sums are added over the pp group. Grouping by axes avoids one collective per
    tensor and avoids torch's clip_grad_norm_, which fails on a mix of plain tensors and DTensors.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    from tasks import collectives

    locals_, buckets = [], {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            # ZeRO 0/1 with sequence parallelism: the norms' gradients are partial sums over tp (FSDP resolves them
            # for 2/3). Square the sum, not the parts: reduce them first (the optimizer then sees the same values).
            g = p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
        if isinstance(g, DTensor):
            # Shard and FSDP's _StridedShard (for which is_shard() is False) both split the tensor.
            groups = tuple(g.device_mesh.get_group(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())
            g = g.to_local()
        else:
            groups = ()
        locals_.append(g)
        sq = torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32).pow(2)
        buckets[groups] = buckets[groups] + sq if groups in buckets else sq
    device = locals_[0].device if locals_ else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, sq in buckets.items():
        for group in groups:
            collectives.all_reduce(sq, group=group)
        total += sq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        collectives.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    if max_norm > 0 and locals_:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        # A non-finite norm skips the step (the guard): leave the gradients as backward made them, for the diagnosis
        # (a NaN coefficient would make every gradient NaN, an inf norm's 0 would zero the finite ones).
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        torch._foreach_mul_(locals_, coef.to(locals_[0].dtype))
    return norm
