"""DCP checkpoints: model, optimizer, LR schedule, loader position, RNG and step, in `<dir>/step-N/`.

A checkpoint counts only once complete: every rank writes into `step-N.tmp/`, all ranks meet at a barrier, then
rank 0 writes `meta.json` and renames the directory to `step-N` — a crash at any point leaves only a `.tmp`
directory that is ignored and removed later. Model and optimizer tensors are saved by parameter name (DCP), so a
checkpoint loads into any other dp/tp/pp layout (reshard on load). Per-rank state that has no name-based form —
the loader position (global: any layout resumes it) and the RNG state (per rank, restored when the world size
is the same) — sits beside it. For multi-node runs the directory must be on a filesystem every node sees.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from tasks.fsutil import atomic_write_json, fsync_dir

_STEP_DIR = re.compile(r"^step-(\d+)$")


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """[(step, path)] of complete checkpoints, oldest first."""
    if not Path(ckpt_dir).is_dir():
        return []
    found = []
    for p in Path(ckpt_dir).iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "meta.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(ckpt_dir: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(ckpt_dir)
    return found[-1] if found else None


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text(encoding="utf-8"))


def _app_state(parts, optimizers):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = {}, {}
    for part, (opt, _) in zip(parts, optimizers):
        model_sd.update(get_model_state_dict(part))
        optim_sd.update(get_optimizer_state_dict(part, opt, options=opts))
    return {"model": model_sd, "optim": optim_sd}


class CheckpointManager:
    def __init__(self, ckpt_dir: Path, keep: int, rank: int, coords: dict, dp: int, world: int):
        self.dir, self.keep, self.rank = Path(ckpt_dir), keep, rank
        self.coords, self.dp, self.world = coords, dp, world

    def remove_partial(self) -> None:
        """Rank 0, before training: a `.tmp` left by a killed run is garbage."""
        for p in self.dir.glob("step-*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
        for p in self.dir.glob("step-*.old"):  # killed between the two renames of save(): restore it
            final = p.with_suffix("")
            if final.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.rename(final)

    def save(self, step: int, parts, optimizers, loader, meta: dict) -> Path:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        tmp = self.dir / f"step-{step}.tmp"
        final = self.dir / f"step-{step}"
        dcp.save(_app_state(parts, optimizers), checkpoint_id=str(tmp))
        if self.coords["tp"] == 0 and self.coords["pp"] == 0:  # one writer per data-parallel replica
            torch.save(loader.state_dict(), tmp / f"loader-dp{self.coords['dp']}.pt")
        torch.save(_rng_state(), tmp / f"rng-rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            sched = optimizers[0][1].state_dict()
            atomic_write_json(tmp / "meta.json", {**meta, "step": step, "dp": self.dp, "world": self.world,
                                                   "lr_scheduler": sched, "saved_at": time.time()})
            old = self.dir / f"step-{step}.old"
            if final.exists():  # a rerun reached the same step again: the new one replaces it, and a crash
                final.rename(old)  # in between still leaves a complete checkpoint (step-N.old is found on resume)
            tmp.rename(final)
            fsync_dir(self.dir)
            shutil.rmtree(old, ignore_errors=True)
            self._prune()
        dist.barrier()
        return final

    def _prune(self) -> None:
        for _, path in complete_checkpoints(self.dir)[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path, parts, optimizers, loader) -> tuple[int, list[str]]:
        """Restore everything; returns (step, notes about state that could not be restored for this layout)."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        path = Path(path)
        meta = read_meta(path)
        state = _app_state(parts, optimizers)
        dcp.load(state, checkpoint_id=str(path))
        opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for part, (opt, sched) in zip(parts, optimizers):
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, opt, state["optim"], options=opts)
            sched.load_state_dict(meta["lr_scheduler"])
        notes = []
        # The loader position is global (the same on every dp rank, valid for any layout): dp rank 0's file.
        from data_prep.errors import DataPrepError

        try:
            loader.load_state_dict(torch.load(path / "loader-dp0.pt", weights_only=False))
        except DataPrepError as e:  # e.g. a per-rank position from an older checkpoint: the weights still resume
            notes.append(str(e))
        rng = path / f"rng-rank{self.rank}.pt"
        if meta["world"] == self.world and rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False))
        else:
            notes.append("world size changed: RNG states not restored")
        return int(meta["step"]), notes


def _rng_state() -> dict:
    import random

    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import random

    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
