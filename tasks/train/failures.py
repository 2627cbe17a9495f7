"""Evidence a failed run leaves for the launcher (tasks/stages/train.py, tasks/parallel/diagnosis.py): diagnosis.json
for a non-finite loss or gradient, failures/<kind>-rank-K.json for an out-of-memory or a collective timeout."""

from __future__ import annotations

from pathlib import Path

from tasks.fsutil import atomic_write_json
from tasks.train.hooks import local

NONFINITE_ADVICE = [
    "lower train.lr or lengthen train.warmup_steps",
    "keep train.grad_clip > 0",
    "bf16 overflow: check the first parameter listed; try train.precision fp32 to compare",
    "bad data: inspect the batch of this step (loader position in the last checkpoint)",
]


def write_nonfinite(train_dir: Path, rank: int, step: int, loss, norm, parts, last_good) -> None:
    """Every rank names its parameters with non-finite gradients (a collective); rank 0 writes diagnosis.json."""
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
        what = "loss became non-finite" if not torch.isfinite(loss) else "gradient norm became non-finite"
        atomic_write_json(
            train_dir / "diagnosis.json",
            {
                "what": what,
                "step": step,
                "loss": float(loss),
                "grad_norm": float(norm),
                "last_good_checkpoint": last_good,
                "nonfinite_grads_by_rank": {str(r): names for r, names in enumerate(everyone) if names},
                "advice": NONFINITE_ADVICE,
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
