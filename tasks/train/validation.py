"""The validation loss during training, and early stopping on it.

`plan` (the train stage, before launch) fixes what is evaluated: the first `batches` global batches of the shard
set's val split in its stored order (data_prep writes each split's windows in a seeded random order), disjoint from
training; every `every` steps and at the last. The `Validation` hook (every rank) holds its share of that slice on the
device — dp rank r takes the same slice of each global batch as the training loader would, the tensor and pipeline
ranks of one replica the same rows — and evaluates it with the step's own forward (`TrainStep.validate`: micro-batches
or the pipeline schedule's `eval`, autocast as in training, no_grad, the model in eval mode, MoE router statistics
paused), reduced like the training loss: the same value on every rank and in every layout, up to float rounding.
Nothing of the training changes: no RNG is drawn, the training loader is not touched, the model has no dropout.

Early stopping (`train.early_stop_patience` N > 0): each evaluation that improves on the best writes a checkpoint of
its step, kept by pruning (`CheckpointManager.pinned`); after N evaluations without improvement the run finishes
cleanly at that step (its checkpoint records `early_stop`, so a rerun does not train on), and the best checkpoint is
the one exported: the weights the validation loss chose, not the last ones, which by then are worse on held-out data.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from tasks.train.hooks import Hook


def plan(train_cfg, lay, manifest: dict) -> tuple[dict | None, list[str]]:
    """(the validation plan for the launch spec, or None when off; warnings, one line each). The slice is
    train.eval_samples rounded up to whole global batches, at most the val split's whole global batches."""
    if not train_cfg.eval_samples:
        if train_cfg.eval_every:  # a cadence asked for with nothing to evaluate: said, not silently dropped
            return None, [
                f"train.eval_every {train_cfg.eval_every} is not used: train.eval_samples 0 turns the validation loss "
                "off; set train.eval_samples (e.g. 64) to evaluate, or leave train.eval_every out"
            ]
        return None, []
    g = lay.global_batch
    have = manifest["splits"].get("val", {}).get("samples", 0)
    version = manifest.get("version", "the shard set")
    if have < g:
        return None, [
            f"validation loss off: the val split of {version} holds {have} sequences, less than one global batch of "
            f"{g} (train.global_batch); rebuild the shards with a larger data.val_fraction, or set "
            "train.eval_samples=0 to silence this"
        ]
    want = math.ceil(train_cfg.eval_samples / g)
    n = min(want, have // g)
    notes = []
    if n < want:
        notes.append(
            f"the val split of {version} holds {have} sequences: the validation loss uses {n * g} of them, not the "
            f"{want * g} train.eval_samples {train_cfg.eval_samples} asks for"
        )
    every = train_cfg.eval_every or max(1, train_cfg.steps // 10)
    return {"every": every, "batches": n, "samples": n * g, "split_samples": have}, notes


def due(step: int, every: int, last: int) -> bool:
    return step % every == 0 or step == last


class Validation(Hook):
    """`metrics["val.loss"]` at every evaluation step (every rank, before rank 0 logs); the best (step, loss) over the
    run — a resumed run starts from the evaluations logged up to its step — into summary.json; early stopping."""

    def __init__(self, plan: dict, patience: int = 0):
        self.every, self.n_batches, self.patience = plan["every"], plan["batches"], patience
        self.batches: list = []  # this rank's share of the slice, on the device
        self.best: tuple[int, float] | None = None  # (step, val.loss)
        self.since_best = 0  # evaluations since the best
        self.samples = 0  # validation samples per evaluation (on_start)

    def on_start(self, trainer) -> None:
        from data_prep.loader import ShardLoader

        lay = trainer.lay
        loader = ShardLoader(
            trainer.spec["shard_dir"],
            "val",
            batch_size=lay.local_batch,
            dp_rank=trainer.coords["dp"],
            dp_world=lay.dp,
            num_workers=0,
            shuffle=False,  # the split's stored order: the same slice at every evaluation, in every layout
        )
        stream = iter(loader)
        self.batches = [tuple(t.to(trainer.device) for t in next(stream)) for _ in range(self.n_batches)]
        self.samples = self.n_batches * lay.global_batch  # the slice every evaluation of this run scores
        other = []
        for row in trainer.history:  # a resumed run: the evaluations before its first step
            if row.get("val.loss") is None:
                continue
            # one that scored another slice (train.eval_samples or global_batch changed) is no loss to compare with;
            # a row without val.samples predates it and counts as before
            if row.get("val.samples", self.samples) != self.samples:
                other.append(row)
                continue
            self.record(row["step"], row["val.loss"])
        if other and trainer.rank == 0:
            print(
                f"validation: {len(other)} earlier evaluation(s) (steps {other[0]['step']}–{other[-1]['step']}) scored "
                f"{other[0]['val.samples']} samples, this run scores {self.samples}: not compared for the best "
                "checkpoint or early stopping",
                flush=True,
            )
        if self.patience and self.best:
            trainer.ckpt.pinned = self.best[0]

    def record(self, step: int, loss: float) -> bool:
        """Count an evaluation; True when it is a new best (strictly lower)."""
        if self.best is None or loss < self.best[1]:
            self.best, self.since_best = (step, loss), 0
            return True
        self.since_best += 1
        return False

    def evaluate(self, trainer) -> float:
        from tasks.model.moe import stats_paused

        for part in trainer.parts:
            part.eval()
        try:
            with stats_paused():  # not training tokens: the router statistics of the step stay the step's
                return trainer.step_fn.validate(self.batches)
        finally:
            for part in trainer.parts:
                part.train()

    def after_step(self, trainer, step: int, metrics: dict) -> None:
        if not due(step, self.every, trainer.cfg.train.steps):
            return
        trainer.call("on_phase", step, "validate")
        t0 = time.perf_counter()
        metrics["val.loss"] = loss = self.evaluate(trainer)
        metrics["val.time_s"] = time.perf_counter() - t0  # not in step_time_s: the evaluation's own cost
        metrics["val.samples"] = self.samples  # which slice (a resume with another one does not compare losses)
        improved = self.record(step, loss)
        if not self.patience:
            return
        if improved:  # checkpointed at this step (train_step) and kept by pruning until a better one comes
            trainer.ckpt.pinned = step
            trainer.save_now = True
        elif self.since_best >= self.patience:
            best_step, best = self.best
            trainer.finish_early(
                f"val.loss {loss:.4f} has not improved on {best:.4f} (step {best_step}) for {self.since_best} "
                f"evaluations (train.early_stop_patience {self.patience})"
            )

    def best_checkpoint(self, trainer) -> Path | None:
        if self.best is None:
            return None
        path = trainer.ckpt.dir / f"step-{self.best[0]}"
        return path if (path / "meta.json").is_file() else None

    def on_end(self, trainer, summary: dict) -> None:
        best = self.best_checkpoint(trainer)
        summary["validation"] = {
            "every": self.every,
            "samples": self.samples,
            "best_step": self.best[0] if self.best else None,
            "best_loss": self.best[1] if self.best else None,
            "best_checkpoint": str(best) if best else None,
            "early_stop_patience": self.patience,
        }
        if not self.patience:
            return
        if best is not None:
            trainer.export_from = str(best)
        elif self.best is not None and trainer.rank == 0:
            print(
                f"early stopping: the best step {self.best[0]} has no checkpoint (written before early stopping was "
                "on); exporting the newest",
                flush=True,
            )
