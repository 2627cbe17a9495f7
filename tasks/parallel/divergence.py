"""A blown-up run is stopped, never kept as good: the divergence guard and the checkpoints it condemns. Pure logic (no
torch.distributed): every rank's TrainStep calls the guard on the step's global loss and gradient norm, before the
update (tasks/train/trainer.py); the launcher sets the condemned checkpoints aside. The fix that follows (a lower lr)
applies from the resumed step on: tasks.parallel.optim.load_schedule.

The guard sees each step's loss and gradient norm *before* that step's update. A checkpoint `step-k` holds the
weights after k updates, which the loss of step k + 1 measures: a diverged loss (or a dead model) at step e condemns
the weights of step e - 1, so every checkpoint from step e - 1 on is set aside (`quarantine`) and the newest one
before it stays the last good one. A non-finite loss or gradient condemns nothing but the step itself (a bad batch
or a bf16 overflow: the weights that produced it may be fine), as before.
"""

from __future__ import annotations

import math
import shutil
import statistics
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

WINDOW = 20  # losses in the running median
FELL = 0.10  # "had fallen": the best loss so far at least 10 % below ln(V)
AT_LN_V = 0.01  # "at ln(V)": within 1 % of it (a model whose logits no longer depend on the input)
DIVERGED = ".diverged"


@dataclass
class Divergence:
    step: int
    what: str
    loss: float
    grad_norm: float
    bad_from: int  # checkpoints of this step and later hold the diverging weights

    def to_dict(self) -> dict:
        return asdict(self)


class DivergenceGuard:
    """check(step, loss, grad_norm) → None while training is healthy, else the Divergence that stops it.

    Rules, in order: a non-finite loss or gradient norm; a gradient norm of exactly 0 (nothing learns); a loss above
    `factor` × the median of the last WINDOW healthy losses; a loss at ln(V) after the best loss had fallen FELL
    below it. `factor` 0 turns the last two off (the first two always hold). `history`: the healthy losses of the
    steps before a resume (metrics.jsonl), so the median and the best loss survive a restart."""

    def __init__(self, vocab_size: int, factor: float = 10.0, history=()):
        self.ln_v, self.factor = math.log(vocab_size), factor
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.best = math.inf
        for loss in history:
            self._keep(loss)

    def _keep(self, loss: float) -> None:
        self.recent.append(loss)
        self.best = min(self.best, loss)

    def check(self, step: int, loss: float, grad_norm: float) -> Divergence | None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            what = "loss became non-finite" if not math.isfinite(loss) else "gradient norm became non-finite"
            return Divergence(step, what, loss, grad_norm, bad_from=step)
        if grad_norm == 0.0:
            return Divergence(step, "gradient norm is 0 (a dead model: nothing learns)", loss, grad_norm, step - 1)
        if self.factor and self.recent:
            median = statistics.median(self.recent)
            if loss > self.factor * median:
                what = f"loss diverged ({loss:.4g} > train.divergence_factor {self.factor:g} × median {median:.4g})"
                return Divergence(step, what, loss, grad_norm, step - 1)
            if self.best <= self.ln_v * (1 - FELL) and abs(loss - self.ln_v) <= AT_LN_V * self.ln_v:
                what = (
                    f"loss {loss:.4g} is back at ln(vocabulary) {self.ln_v:.4g} after falling to {self.best:.4g} "
                    "(a dead model: its predictions no longer depend on the input)"
                )
                return Divergence(step, what, loss, grad_norm, step - 1)
        self._keep(loss)
        return None


def quarantine(ckpt_dir: Path, bad_from: int) -> list[str]:
    """Rename every complete checkpoint of step >= bad_from to `step-N.diverged` (never resumed, never pruned as a
    good one, kept for inspection); returns their names. Launcher side, after the ranks have stopped."""
    from tasks.parallel.checkpoint import complete_checkpoints

    moved = []
    for step, path in complete_checkpoints(ckpt_dir):
        if step >= bad_from:
            target = path.with_name(path.name + DIVERGED)
            if target.exists():
                shutil.rmtree(target)
            path.rename(target)
            moved.append(path.name)
    return moved
