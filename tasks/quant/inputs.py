"""Where quantize/evaluate find their inputs (earlier stages' results, or CLI flags for a standalone run) and the
validation batches both stages draw from the shard set's val split."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tasks.errors import StageError


def model_dir(ctx, fallback: str | None = None) -> Path:
    train = ctx.inputs.get("train", {})
    path = getattr(ctx.args, "model_dir", None) or train.get("hf_dir") or fallback
    if not path and train.get("status") == "failed":  # a rerun of train that failed: its earlier result is kept
        earlier = (train.get("previous") or {}).get("hf_dir")
        raise StageError(
            f"{ctx.stage}: the train stage's last attempt here failed ({str(train.get('error', ''))[:300]}); rerun "
            "train (a finished run is reused, nothing retrained) or pass --model-dir"
            + (f" (the earlier finished run's export, kept in train.json's `previous`: {earlier})" if earlier else "")
        )
    if not path and train.get("status") in ("ok", "warn") and train.get("checkpoint"):  # train --no-export
        raise StageError(
            f"{ctx.stage}: the train stage here finished without an HF export (--no-export); rerun train without "
            "--no-export (the finished run is reused, only exported) or pass --model-dir"
        )
    if not path:
        raise StageError(f"{ctx.stage}: no trained model: run the train stage first or pass --model-dir")
    # absolute (a flag path is read from the working directory): evaluate, run from elsewhere, finds what is recorded
    path = Path(os.path.abspath(Path(path).expanduser()))
    if not (path / "config.json").is_file():
        raise StageError(
            f"{ctx.stage}: model checkpoint {path} is missing (no config.json there); "
            "rerun train or pass --model-dir to an HF export"
        )
    return path


def check_hf_path(cfg, ctx) -> None:
    """quantize and evaluate read the train stage's export; model.hf_path only says where training starts. A path
    that training here did not start from (a --set after train) would be ignored: one line naming --model-dir."""
    from tasks.config import repo_path

    train = ctx.inputs.get("train", {})
    if getattr(ctx.args, "model_dir", None) or not cfg.model.hf_path or "init_from" not in train:
        return
    asked = str(repo_path(cfg.model.hf_path))
    if asked != train["init_from"]:
        raise StageError(
            f"{ctx.stage}: model.hf_path {asked} is where training starts, and this run's model was trained from "
            f"{train['init_from'] or 'a random init'}; {ctx.stage} reads its export ({train.get('hf_dir')}): pass "
            f"--model-dir {asked} to {ctx.stage} that checkpoint, or rerun train with it"
        )


def fingerprint(path: Path) -> str:
    """Cheap identity of a model directory (names, sizes, mtimes): a retrained model in place is not reused."""
    stats = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(path).iterdir() if f.is_file())
    return hashlib.sha256(repr(stats).encode()).hexdigest()[:16]


def manifest_digest(shard_dir: Path) -> str:
    """Identity of the validation data: the shard set's manifest digest (sha256 of manifest.json, which lists every
    shard's sha256 and the tokenizer's), the same digest the shard stage logs as the MLflow dataset."""
    from data_prep.manifest import digest

    return digest(shard_dir)


# Calibration and evaluation never share a token: the val split's windows are cut by this recorded rule on each
# window's index in the packed token stream (windows do not overlap), logged to MLflow with the counts.
SPLIT_EVERY = 4
SPLIT_RULE = (
    f"val split, file order: window index % {SPLIT_EVERY} == 0 → calibration, otherwise → evaluation "
    "(windows are disjoint slices of the packed token stream)"
)
PARTS = ("calibration", "evaluation")


def in_part(key, part: str) -> bool:
    return (int(key) % SPLIT_EVERY == 0) == (part == "calibration")


def val_batches(shard_dir: Path, n: int, batch_size: int, part: str) -> list:
    """Up to `n` batches of `batch_size` sequences (the last may be short) of one part of the val split, in file
    order (no shuffle), as a list: every model sees the same tokens, run after run."""
    return val_part(shard_dir, n, batch_size, part)[0]


def val_part(shard_dir: Path, n: int, batch_size: int, part: str) -> tuple[list, dict]:
    """(batches, record of the split: rule, part, sequence count, the window indices used and their digest)."""
    import torch

    from data_prep.errors import DataPrepError
    from data_prep.loader import ShardLoader
    from data_prep.manifest import load_manifest

    if part not in PARTS:
        raise ValueError(f"part {part!r} is not one of {PARTS}")
    try:
        samples = load_manifest(shard_dir)["splits"].get("val", {}).get("samples", 0)
        loader = (
            ShardLoader(shard_dir, split="val", batch_size=1, num_workers=0, shuffle=False, with_keys=True)
            if samples
            else None
        )
    except DataPrepError as e:
        raise StageError(f"{part} data: {e}") from None
    rows, keys = [], []
    for inputs, targets, batch_keys in loader or ():
        if in_part(batch_keys[0], part):
            rows.append((inputs, targets))
            keys.append(int(batch_keys[0]))
            if len(rows) >= n * batch_size:
                break
    if len(rows) < batch_size:
        raise StageError(
            f"{part} set is empty: the val split of {shard_dir} has {samples} sequences, {len(rows)} of "
            f"them in the {part} part ({SPLIT_RULE}), fewer than one batch of {batch_size}; reshard "
            "with a larger data.val_fraction or corpus"
        )
    batches = [
        (torch.cat([r[0] for r in rows[i : i + batch_size]]), torch.cat([r[1] for r in rows[i : i + batch_size]]))
        for i in range(0, len(rows), batch_size)
    ]
    info = {
        "rule": SPLIT_RULE,
        "part": part,
        "sequences": len(keys),
        "tokens": sum(t.numel() for _, t in batches),
        "keys": keys,
        "keys_digest": hashlib.sha256(repr(keys).encode()).hexdigest()[:16],
    }
    return batches, info
