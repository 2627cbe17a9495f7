"""Progress lines of a training run (issue 28): rank 0 prints them into its log (logs/rank-0.log), the launcher
(tasks/stages/train.py) relays them into the stage's log, from where they reach Airflow's task log and `make run`'s
screen (tasks.logs: every line starts with PROGRESS_MARK).

    progress: train step 40/300 (13%), loss 4.102, val loss 4.233, 5.1k tokens/s, MFU 31%, ETA 2m10s
    progress: waiting for checkpoint step-40…
    progress: checkpoint step-40: done after 2s
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from tasks.train.hooks import Hook

SECONDS = 30.0  # a progress line at least this often, whatever train.log_every


class _Print(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:  # as tasks.train.trainer.log (which imports this module)
        rank = os.environ.get("RANK", "0")
        print(f"[{time.strftime('%H:%M:%S')} rank {rank}] {record.getMessage()}", flush=True)


def rank_logger() -> logging.Logger:
    """The progress logger of a rank: its records printed like the trainer's own lines, not propagated."""
    logger = logging.getLogger("tasks.progress.rank")
    if not logger.handlers:
        logger.addHandler(_Print())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def waiting(what: str, rank: int):
    """tasks.logs.waiting on rank 0 (the rank whose log is relayed); nothing on the others."""
    from tasks.logs import waiting as wait

    return wait(what, logger=rank_logger()) if rank == 0 else contextlib.nullcontext()


class ProgressLines(Hook):
    """Rank 0: a progress line every `every` steps (train.log_every; 0 = by time only) or SECONDS, and at the last
    step — step/total, loss, the last val loss, tokens/s, MFU where the device's peak is known, ETA; and a waiting
    line while a checkpoint holds training up (the whole save, or with async checkpoints its staging; the last
    one until it is written)."""

    def __init__(self, total: int, every: int, seconds: float = SECONDS):
        self.total, self.every, self.seconds = total, every, seconds
        self.progress, self.val, self._wait = None, None, contextlib.ExitStack()

    def on_start(self, trainer) -> None:
        if trainer.rank != 0:
            return
        from tasks.logs import Progress

        self.progress = Progress("train", self.total, "step", self.every, self.seconds, logger=rank_logger())
        known = [r["val.loss"] for r in trainer.history if r.get("val.loss") is not None]
        self.val = known[-1] if known else None  # a resumed run: the last evaluation before its first step

    def after_step(self, trainer, step: int, metrics: dict) -> None:
        if self.progress is None:
            return
        if metrics.get("val.loss") is not None:  # the Validation hook, before this one, set it at this step
            self.val = metrics["val.loss"]
        self.progress.update(
            step,
            loss=metrics["loss"],
            val_loss=self.val,  # the label "val loss"
            tokens_per_s=metrics["tokens_per_s"],
            mfu=metrics.get("mfu"),
        )

    def on_phase(self, trainer, step: int, phase: str) -> None:
        if self.progress is None:
            return
        self._wait.close()  # the checkpoint no longer holds training up
        if phase == "checkpoint":
            background = " (staged, then written in the background)" if trainer.cfg.train.async_checkpoint else ""
            self._wait.enter_context(waiting(f"checkpoint step-{step}{background}", trainer.rank))
