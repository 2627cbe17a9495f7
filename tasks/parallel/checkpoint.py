"""DCP checkpoints: model, optimizer, LR schedule, loader position, RNG and step, in `<dir>/step-N/`.

A checkpoint counts only once complete: every rank writes into `step-N.tmp/`, all ranks meet at a barrier, then
rank 0 writes `meta.json` and renames the directory to `step-N` — a crash at any point leaves only a `.tmp`
directory that is ignored and removed later. Model and optimizer tensors are saved by parameter name (DCP), so a
checkpoint loads into any other dp/tp/pp layout (reshard on load). Per-rank state that has no name-based form —
the loader position (global: any layout resumes it; JSON) and the RNG state (per rank, restored when the world size
is the same; tensors only) — sits beside it, every file loadable with `torch.load(weights_only=True)`: nothing in a
checkpoint runs code. meta.json records the shard set's tokenizer identity and manifest digest (both checked on
resume and before a finished run is handed back: tasks/stages/train.py). For multi-node runs
the directory must be on a filesystem every node sees.

Verification: meta.json records every file's size and sha256 at save (`files`). Before a resume the launcher picks
the newest checkpoint that verifies (`latest_verified`), says which newer ones it skipped and why, and rank 0 hands
that decision to every rank (one broadcast: no rank looks at the directory while rank 0 may be renaming in it).
Pruning keeps the newest `keep` checkpoints and always the one just saved (hashed at save), so the last verified
checkpoint is never deleted, and the `pinned` step (early stopping's best checkpoint, tasks/train/validation.py).

Asynchronous saves (`train.async_checkpoint`, `save_async`): training waits only while DCP's `async_save` stages a copy
of the state in host memory (pinned where the device has it: CUDA; torch's stager pins only there); the files, the
hashes, meta.json and the rename happen in a background thread on a gloo process group of their own (torchtitan's
async checkpointing does the same: the training collectives never interleave with the save's). The same protocol
as a synchronous save, so the same guarantees: until the rename, only `step-N.tmp` exists, which nothing trusts.
One save is in flight at a time; the trainer takes it as its last good checkpoint only once it completed on every
rank (tasks/train/trainer.Trainer.harvest).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.fsutil import atomic_write_json, fsync_dir, sha256_file
from tasks.model.model_dir import shard_tokenizer

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


def step_of(path: str | Path) -> int:
    return int(_STEP_DIR.match(Path(path).name).group(1))


def latest(ckpt_dir: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(ckpt_dir)
    return found[-1] if found else None


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text(encoding="utf-8"))


# Config that shapes the training trajectory: changed between a checkpoint and its resume, the curve differs from
# an uninterrupted run (a warning, not an error: extending steps or changing the layout is legitimate).
_NOT_SHAPING = {
    "train": {
        "steps",
        "checkpoint_every",
        "log_every",
        "keep_checkpoints",
        "timeout_s",
        "micro_batch",
        "divergence_factor",
        "async_checkpoint",
        "compile",
        "eval_every",
        "eval_samples",
        "early_stop_patience",
        "rehearsal_steps",  # measures the first steps' memory and time against the plan: trains nothing differently
    }
}
SHAPING_SECTIONS = ("model", "train", "data")
_DATA_SHAPING = {"seq_len", "vocab_size", "tokenizer", "inputs", "max_documents"}
# With the qat_int8 model converter listed, these choose what training fake-quantizes (tasks/quant/fake_quant.py).
_QAT_SHAPING = ("method", "skip_layers")


def shaping_config(config: dict) -> dict:
    """{section.key: value} of the settings that shape training (see _NOT_SHAPING)."""
    out = {}
    for sec in SHAPING_SECTIONS:
        for k, v in (config.get(sec) or {}).items():
            if _shapes(f"{sec}.{k}"):
                out[f"{sec}.{k}"] = v
    if "qat_int8" in (config.get("model") or {}).get("converters", ()):
        out.update({f"quantize.{k}": (config.get("quantize") or {}).get(k) for k in _QAT_SHAPING})
    return out


def _shapes(key: str) -> bool:
    """Whether setting `key` ('section.key') shapes training (quantize.* keys: shaping_config decides)."""
    sec, _, k = key.partition(".")
    if sec not in SHAPING_SECTIONS:
        return sec == "quantize"
    return k not in _NOT_SHAPING.get(sec, ()) and (sec != "data" or k in _DATA_SHAPING)


def config_changes(path: Path, config: dict) -> list[str]:
    """'key: old → new' for each training-shaping setting that differs from what checkpoint `path` was saved with
    (a key an older version counted as shaping, recorded in its meta.json, is judged by today's rule; a key its
    meta.json lacks, a field added since, counts as that field's default: what the run trained as)."""
    saved = read_meta(path).get("shaping")
    if saved is None:
        return []
    saved = {k: v for k, v in saved.items() if _shapes(k)}
    now = shaping_config(config)
    saved |= {k: _field_default(k) for k in now.keys() - saved.keys()}
    return [
        f"{k}: {saved.get(k)!r} → {now.get(k)!r}" for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)
    ]


def _field_default(key: str):
    """The default of config field `key` ('section.key'), as the config's to_dict() writes it; None if none is known.
    A new field's default keeps what the code did before it (docs/contributing.md: "A config field")."""
    from tasks.config import PipelineConfig

    sec, _, k = key.partition(".")
    section = PipelineConfig.model_fields.get(sec)
    field = section.annotation.model_fields.get(k) if section is not None else None
    if field is None or field.is_required():
        return None
    value = field.get_default(call_default_factory=True)
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


def resume_problem(path: Path, config: dict) -> str | None:
    """The one-line refusal when checkpoint `path` cannot carry on under `config`, else None: another
    train.optimizer (its state has other tensors and settings: the load failed on every rank, at every retry), or
    another model.hf_path (a resume continues the checkpoint's weights: the new path's would be ignored)."""
    from data_prep.config import repo_path

    saved = read_meta(path).get("shaping") or {}
    was, now = saved.get("train.optimizer"), (config.get("train") or {}).get("optimizer")
    if was is not None and was != now:
        return (
            f"checkpoint {path} was trained with train.optimizer {was}, this config asks for {now}: its optimizer "
            f"state does not load into another optimizer; set train.optimizer={was} to resume it, or use --fresh to "
            "start over, or a new --run-dir"
        )
    was, now = saved.get("model.hf_path"), (config.get("model") or {}).get("hf_path")
    if was is not None and now and (not was or repo_path(was) != repo_path(now)):
        return (
            f"checkpoint {path} was trained from model.hf_path {was or '(none: random init)'}, this config names "
            f"{now}: a resume continues the checkpoint's weights, never {now}'s; use --fresh (or a new --run-dir) "
            f"to start from {now}, or set model.hf_path back to resume"
        )
    return None


def shard_digest(shard_dir: str | os.PathLike) -> str | None:
    """The shard set's identity (sha256 of its manifest.json, data_prep.manifest.digest); None without one."""
    from data_prep.manifest import MANIFEST, digest

    return digest(shard_dir) if (Path(shard_dir) / MANIFEST).is_file() else None


def shard_set_problem(path: Path, shard_dir: str | os.PathLike) -> str | None:
    """The one-line problem when checkpoint `path` was trained on another shard set than `shard_dir` (their manifest
    digests differ); None when they agree or the checkpoint recorded none (written before digests were recorded)."""
    recorded = read_meta(path).get("manifest_digest")
    now = shard_digest(shard_dir)
    if not recorded or now is None or recorded == now:
        return None
    return (
        f"checkpoint {path} was trained on shard set {recorded[:12]}… (manifest sha256), but {shard_dir} is shard "
        f"set {now[:12]}…; train on the shard set it was trained on, or use --fresh to start over, or a new --run-dir"
    )


def file_table(path: Path, rank: int = 0, world: int = 1) -> dict[str, dict]:
    """{relative name: {bytes, sha256}} of every file of a checkpoint directory except meta.json; with world > 1,
    rank's share of them (largest first, dealt round-robin: the ranks hash the model's shards side by side)."""
    path = Path(path)
    files = sorted(
        (p for p in path.rglob("*") if p.is_file() and p.name != "meta.json"), key=lambda p: (-p.stat().st_size, str(p))
    )
    return dict(
        sorted(
            (str(p.relative_to(path)), {"bytes": p.stat().st_size, "sha256": sha256_file(p)})
            for p in files[rank::world]
        )
    )


def verify(path: Path) -> str | None:
    """None when the checkpoint is intact, else the one-line problem (missing/truncated/altered file).
    Checkpoints written before checksums were recorded (no `files` in meta.json) are trusted."""
    path = Path(path)
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({e})"
    files = meta.get("files")
    if files is None:
        return None
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{name} is truncated or altered ({size} bytes, {want['bytes']} recorded)"
    for name, want in sorted(files.items()):  # sizes first: a truncated file is named without hashing everything
        if sha256_file(path / name) != want["sha256"]:
            return f"{name} is corrupt (sha256 differs from the one recorded at save)"
    return None


def latest_verified(ckpt_dir: Path) -> tuple[tuple[int, Path] | None, list[str]]:
    """(newest checkpoint that verifies or None, ['step-N: problem' for each newer one skipped, newest first; a
    step-N directory without meta.json included])."""
    skipped = []
    found = None
    for step, path in reversed(complete_checkpoints(ckpt_dir)):
        problem = verify(path)
        if problem is None:
            found = (step, path)
            break
        skipped.append(f"{path.name}: {problem}")
    # A step-N directory without meta.json is no checkpoint (a save renames it into place only after writing it): one
    # newer than the one resumed was damaged, and is named rather than passed over in silence.
    ckpt_dir = Path(ckpt_dir)
    for p in ckpt_dir.iterdir() if ckpt_dir.is_dir() else ():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and not (p / "meta.json").is_file() and (found is None or int(m.group(1)) > found[0]):
            skipped.append(f"{p.name}: meta.json is missing")
    return found, sorted(skipped, key=lambda note: -step_of(note.split(":")[0]))


def cleanup_partial(ckpt_dir: Path) -> None:
    """Before a launch (one process only): drop `.tmp` directories of a killed save, restore a `.old` one."""
    for p in Path(ckpt_dir).glob("step-*.tmp"):
        shutil.rmtree(p, ignore_errors=True)
    for p in Path(ckpt_dir).glob("step-*.old"):  # killed between the two renames of save(): restore it
        final = p.with_suffix("")
        if final.exists():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.rename(final)


def _app_state(parts, optimizers):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = {}, {}
    for part, (opt, _) in zip(parts, optimizers):
        model_sd.update(get_model_state_dict(part))
        optim_sd.update(get_optimizer_state_dict(part, opt, options=opts))
    return {"model": model_sd, "optim": optim_sd}


@dataclass
class PendingSave:
    """A checkpoint being written in the background: its step, the path it will have, the future of its completion
    (raises the save's error) and how long staging held up training."""

    step: int
    path: Path
    future: object  # concurrent.futures.Future
    staged_s: float


_SAVE_GROUPS: dict = {}


def save_group(timeout_s: float):
    """The gloo process group of background saves (all ranks; one per process and default group). Every rank creates
    it at the same point (the first asynchronous save): new_group is collective."""
    from datetime import timedelta

    import torch.distributed as dist

    key = id(dist.group.WORLD)
    if key not in _SAVE_GROUPS:
        _SAVE_GROUPS[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return _SAVE_GROUPS[key]


class BufferStager:
    """The staging of an asynchronous save (dcp.async_save's `async_stager`): the state's tensors copied into host
    buffers allocated at the first save and reused by every later one (pinned on CUDA only, as torch's
    StateDictStager pins through torch.cuda alone; torch_npu does not patch it) — torchtitan's pattern
    (`_create_cpu_state_dict` once, then a copy per save): one `copy_` per tensor, nothing else.

    Why not torch's DefaultStager (torch 2.13, _state_dict_stager.StateDictStager): it reuses its storages too, but
    walks the state through a deepcopy at every save, and on the dp2 FSDP demo model (274 tensors, 8.5 MB a rank)
    that walk — DTensor.new_empty through DTensor's dispatch, grad-mode context managers — took 0.07-0.12 s per save
    on rank 0 for a 0.002 s copy (cProfile), 0.43× the whole synchronous save. Reusing the buffers is safe: a save
    starts only after the one before it completed (save_async waits). A state whose structure changed (keys,
    shapes, dtypes, DTensor layouts) gets new buffers. Non-tensor leaves (the optimizer's hyper-parameters: ints,
    floats, strings) are immutable and staged as they are, the containers around them rebuilt at each save."""

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory
        self._key, self._buffers, self._staged = None, [], []  # per tensor: host buffer, what the save sees

    @property
    def should_synchronize_after_execute(self) -> bool:  # stage() returns a finished copy: nothing to wait for
        return False

    def stage(self, state_dict: dict) -> dict:
        import torch

        with torch.no_grad():  # DTensor.to_local outside autograd: the local tensor itself, no view through a Function
            live: list = []
            key = _walk(state_dict, live)
            if key != self._key:
                self._allocate(state_dict, live)
                self._key = key
            for buf, (t, _) in zip(self._buffers, live):
                buf.copy_(t)
        staged = iter(self._staged)
        return _rebuild(state_dict, lambda: next(staged))

    def _allocate(self, state_dict: dict, live: list) -> None:
        """Host copies of every tensor (DTensors: their local shard, same mesh and placements), by torch's own
        helper (torchtitan's components/checkpoint.py uses it so: `_create_cpu_state_dict(..., pin_memory=True)`)."""
        from torch.distributed._state_dict_utils import _create_cpu_state_dict

        staged: list = []  # (called under stage's no_grad)
        _walk(_create_cpu_state_dict(state_dict, pin_memory=self.pin_memory), staged)
        if any(buf is t for (buf, _), (t, _) in zip(staged, live)):
            # _create_cpu_state_dict hands 0-dim DTensors back as they are: a staged copy that training would change
            raise RuntimeError("checkpoint staging: a tensor of the state was not copied (0-dim DTensor?)")
        self._buffers = [buf for buf, _ in staged]
        self._staged = [buf if dt is None else dt for buf, dt in staged]

    def close(self) -> None:
        self._key, self._buffers, self._staged = None, [], []


def _walk(obj, tensors: list):
    """What the staging buffers depend on (keys, each tensor's shape, dtype and DTensor layout); appends each tensor
    (local tensor, the DTensor or None) to `tensors`, depth first."""
    from torch import Tensor
    from torch.distributed.tensor import DTensor

    return _walk_in(obj, tensors, Tensor, DTensor)


def _walk_in(obj, tensors: list, Tensor, DTensor):
    if isinstance(obj, DTensor):
        local = obj.to_local()
        tensors.append((local, obj))
        return (tuple(obj.shape), obj.dtype, tuple(obj.placements), tuple(local.shape), id(obj.device_mesh))
    if isinstance(obj, Tensor):
        tensors.append((obj, None))
        return (tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return tuple((k, _walk_in(v, tensors, Tensor, DTensor)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return (type(obj), tuple(_walk_in(v, tensors, Tensor, DTensor) for v in obj))
    return None


def _rebuild(obj, staged, Tensor=None):
    """`obj` with each tensor replaced by `staged()` (depth first, as _walk), everything else as it is."""
    if Tensor is None:
        from torch import Tensor
    if isinstance(obj, Tensor):
        return staged()
    if isinstance(obj, dict):
        return {k: _rebuild(v, staged, Tensor) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, staged, Tensor) for v in obj)
    return obj


class CheckpointManager:
    def __init__(
        self,
        ckpt_dir: Path,
        keep: int,
        rank: int,
        coords: dict,
        dp: int,
        world: int,
        device_type: str = "cpu",
        timeout_s: float = 1900,
    ):
        self.dir, self.keep, self.rank = Path(ckpt_dir), keep, rank
        self.coords, self.dp, self.world = coords, dp, world
        self.device_type, self.timeout_s = device_type, timeout_s
        self.pending: PendingSave | None = None
        self.crash_at: int | None = None  # fault injection: this rank dies while writing the checkpoint of that step
        self._executor = self._stager = None
        self.pinned: int | None = None  # a step pruning keeps beyond the newest `keep` (the best, for early stopping)

    def remove_partial(self) -> None:
        """Rank 0, before training: a `.tmp` left by a killed run is garbage."""
        cleanup_partial(self.dir)

    def save(self, step: int, parts, optimizers, loader, meta: dict) -> Path:
        """Write step-N and return once it is complete on every rank."""
        import torch.distributed.checkpoint as dcp

        tmp, final, meta = self._begin(step, optimizers, loader, meta)
        dcp.save(_app_state(parts, optimizers), checkpoint_id=str(tmp))
        return self._complete(step, tmp, final, meta, None)

    def save_async(self, step: int, parts, optimizers, loader, meta: dict) -> PendingSave:
        """Stage step-N's state in host memory and return; the files are written, hashed and renamed into step-N in
        the background (after the save in flight, if any, has completed)."""
        from concurrent.futures import ThreadPoolExecutor

        import torch.distributed.checkpoint as dcp

        self.wait()
        group = save_group(self.timeout_s)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
            self._stager = BufferStager(pin_memory=self.device_type == "cuda")
        t0 = time.perf_counter()
        tmp, final, meta = self._begin(step, optimizers, loader, meta)
        upload = dcp.async_save(
            _app_state(parts, optimizers), checkpoint_id=str(tmp), process_group=group, async_stager=self._stager
        )
        staged = time.perf_counter() - t0

        def finish() -> Path:
            upload.result()
            return self._complete(step, tmp, final, meta, group)

        self.pending = PendingSave(step, final, self._executor.submit(finish), staged)
        return self.pending

    def wait(self) -> PendingSave | None:
        """Block until the save in flight (if any) is complete; it, or None. Its error is raised here."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.future.result()
        return pending

    def close(self) -> None:
        """Wait for the save in flight, then release the background thread and the staging buffers."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._stager.close()
                self._executor = self._stager = None

    def _begin(self, step: int, optimizers, loader, meta: dict) -> tuple[Path, Path, dict]:
        """step-N.tmp/ with this rank's loader position and RNG state, and (rank 0) meta.json's content, all as of
        now."""
        import torch

        tmp = self.dir / f"step-{step}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        if self.coords["tp"] == 0 and self.coords["pp"] == 0:  # one writer per data-parallel replica
            atomic_write_json(tmp / f"loader-dp{self.coords['dp']}.json", loader.state_dict())
        torch.save(_rng_state(), tmp / f"rng-rank{self.rank}.pt")  # tensors and ints only: loads weights_only
        if self.rank == 0:
            meta = {
                **meta,
                "step": step,
                "dp": self.dp,
                "world": self.world,
                "lr_scheduler": optimizers[0][1].state_dict(),
                "tokenizer": shard_tokenizer(loader.shard_dir),  # the token ids' meaning (checked on resume)
                "manifest_digest": shard_digest(loader.shard_dir),  # the shard set trained on (checked on resume)
                "saved_at": time.time(),
            }
        return tmp, self.dir / f"step-{step}", meta

    def _complete(self, step: int, tmp: Path, final: Path, meta: dict, group) -> Path:
        """Every rank's files are in `tmp`: hash them (each rank a share), rank 0 writes meta.json and renames the
        directory to step-N. `group`: the process group to meet on (None: the default one)."""
        import torch.distributed as dist

        from tasks import collectives

        if self.crash_at == step:  # fault injection (tasks/train/hooks.FaultInjection, "ckpt")
            print(f"[rank {self.rank}] fault injection: killed while writing {tmp.name}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        collectives.barrier(group=group)
        # Every rank hashes a share of the files (rank 0 alone hashed Qwen2-0.5B's 6.5 GB on 4 ranks in ~10 s).
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        shares = [None] * world
        collectives.all_gather_object(shares, file_table(tmp, rank, world), group=group)
        if self.rank == 0:
            files = dict(sorted((k, v) for share in shares for k, v in share.items()))
            atomic_write_json(tmp / "meta.json", {**meta, "files": files})
            old = self.dir / f"step-{step}.old"
            if final.exists():  # a rerun reached the same step again: the new one replaces it, and a crash
                final.rename(old)  # in between still leaves a complete checkpoint (step-N.old is found on resume)
            tmp.rename(final)
            fsync_dir(self.dir)
            shutil.rmtree(old, ignore_errors=True)
            self._prune(step)
        collectives.barrier(group=group)
        return final

    def _prune(self, saved: int) -> None:
        """Keep the newest `keep`, and always the one just saved (hashed at save: the last verified checkpoint),
        even when newer ones left by an earlier attempt (unverified, maybe corrupt) outnumber it, and the pinned one."""
        for step, path in complete_checkpoints(self.dir)[: -self.keep]:
            if step not in (saved, self.pinned):
                shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path, parts, optimizers, loader) -> tuple[int, list[str]]:
        """Restore everything (the lr schedule: this run's, from the saved step on — optim.load_schedule); returns
        (step, notes: the lr change, state that could not be restored for this layout)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from tasks.parallel.optim import load_schedule

        path = Path(path)
        meta = read_meta(path)
        state = _app_state(parts, optimizers)
        dcp.load(state, checkpoint_id=str(path))
        opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        changed = None
        for part, (opt, sched) in zip(parts, optimizers):
            # This run's hyper-parameters (train.weight_decay, the device's foreach…), as for the lr below: loading
            # the saved param_groups would otherwise bring back the saved run's values over a changed config.
            mine = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in opt.param_groups]
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, opt, state["optim"], options=opts)
            for group, hyper in zip(opt.param_groups, mine):
                group.update(hyper)
            changed = load_schedule(opt, sched, meta["lr_scheduler"]) or changed
        notes = [changed] if changed else []
        # The loader position is global (the same on every dp rank, valid for any layout): dp rank 0's file.
        from data_prep.errors import DataPrepError

        try:
            loader.load_state_dict(load_loader_state(path))
        except DataPrepError as e:  # e.g. a per-rank position from an older checkpoint: the weights still resume
            notes.append(str(e))
        rng = path / f"rng-rank{self.rank}.pt"
        if meta["world"] == self.world and rng.is_file():
            _set_rng_state(safe_load(rng))
        else:
            notes.append("world size changed: RNG states not restored")
        return int(meta["step"]), notes


def safe_load(path: Path):
    """torch.load with weights_only=True (tensors, numbers, strings, lists, dicts: no code runs); a file that needs
    pickle's full power is refused in one line (anyone able to write the run directory could run code through it)."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))  # torch's WeightsUnpickler names the class
        what = f"it holds {found.group(1)}" if found else re.sub(r"\x1b\[[0-9;]*m", "", str(e).splitlines()[0])[:160]
        raise UnsafeCheckpointError(
            f"{path}: refused, loading it needs unsafe unpickling ({what}); resume from a checkpoint written by this "
            "version, or start over with --fresh"
        ) from None


class UnsafeCheckpointError(RuntimeError):
    pass


def load_loader_state(path: Path) -> dict:
    """The loader position: loader-dp0.json, or an older checkpoint's loader-dp0.pt (a dict of plain values, which
    weights_only loads)."""
    path = Path(path)
    if (path / "loader-dp0.json").is_file():
        return json.loads((path / "loader-dp0.json").read_text(encoding="utf-8"))
    return safe_load(path / "loader-dp0.pt")


def unsafe_state(path: Path) -> str | None:
    """Launcher side, before a resume: the one-line refusal when the checkpoint's loader or RNG files cannot be read
    without unsafe unpickling (the ranks would fail on them one by one), else None."""
    path = Path(path)
    try:
        if not (path / "loader-dp0.json").is_file() and (path / "loader-dp0.pt").is_file():
            safe_load(path / "loader-dp0.pt")
        for rng in sorted(path.glob("rng-rank*.pt")):
            safe_load(rng)
    except UnsafeCheckpointError as e:
        return f"checkpoint {e}"
    return None


def _rng_state() -> dict:
    """RNG states as tensors and ints (Python's Mersenne Twister: its 625 words as an int64 tensor)."""
    import random

    import torch

    version, words, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python_version": version, "python": torch.tensor(words)}
    if gauss is not None:
        state["python_gauss"] = gauss
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import random

    import torch

    torch.set_rng_state(state["torch"])
    py = state["python"]
    if isinstance(py, torch.Tensor):
        py = (state["python_version"], tuple(py.tolist()), state.get("python_gauss"))
    random.setstate(py)  # older checkpoints stored random.getstate()'s tuple itself
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
