"""Evidence a failed run leaves for the launcher (tasks/stages/train.py, tasks/parallel/diagnosis.py): diagnosis.json
when the divergence guard stopped it (non-finite, diverged, dead model), failures/<kind>-rank-K.json for an
out-of-memory or a collective timeout."""

from __future__ import annotations

from pathlib import Path

from tasks.fsutil import atomic_write_json
from tasks.train.hooks import local

ADVICE = [
    "lower train.lr or lengthen train.warmup_steps, then rerun: it resumes from the last good checkpoint with the new "
    "schedule",
    "keep train.grad_clip > 0",
    "bf16 overflow: check the first parameter listed; try train.precision fp32 to compare",
    "bad data: inspect the batch of this step (loader position in the last checkpoint)",
]


def write_diagnosis(train_dir: Path, rank: int, verdict, parts, last_good: str | None) -> None:
    """The divergence guard stopped the run (`verdict`: a tasks.parallel.divergence.Divergence, the same on every
    rank): every rank names its parameters with non-finite gradients (a collective); rank 0 writes diagnosis.json
    with the verdict and the last good checkpoint (the launcher sets the condemned ones aside: `bad_from`)."""
    import torch
    import torch.distributed as dist
    from tasks import collectives

    bad = [
        n
        for part in parts
        for n, p in part.named_parameters()  # this rank's shard of each gradient
        if p.grad is not None and not torch.isfinite(local(p.grad)).all()
    ][:10]
    everyone = [None] * dist.get_world_size()
    collectives.all_gather_object(everyone, bad)
    if rank == 0:
        atomic_write_json(
            train_dir / "diagnosis.json",
            {
                **verdict.to_dict(),
                "last_good_checkpoint": last_good,
                "nonfinite_grads_by_rank": {str(r): names for r, names in enumerate(everyone) if names},
                "advice": ADVICE,
            },
        )


def write_failure(train_dir: Path, kind: str, rank: int, step: int, mem: dict, estimate, error: str) -> None:
    """failures/<kind>-rank-K.json: this rank's step, memory and first error line (kind: oom | timeout)."""
    atomic_write_json(
        train_dir / "failures" / f"{kind}-rank-{rank}.json",
        {
            "rank": rank,
            "step": step,
            "memory": mem,
            "estimate_bytes": estimate,
            "error": error.splitlines()[0][:500] if error else "",
        },
    )
