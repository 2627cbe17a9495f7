"""Where quantize/evaluate find their inputs (earlier stages' results, or CLI flags for a standalone run) and the
validation batches both stages draw from the shard set's val split."""
from __future__ import annotations

import hashlib
from pathlib import Path

from tasks.errors import StageError


def model_dir(ctx, fallback: str | None = None) -> Path:
    path = getattr(ctx.args, "model_dir", None) or ctx.inputs.get("train", {}).get("hf_dir") or fallback
    if not path:
        raise StageError(f"{ctx.stage}: no trained model: run the train stage first or pass --model-dir")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise StageError(f"{ctx.stage}: model checkpoint {path} is missing (no config.json there); "
                         "rerun train or pass --model-dir to an HF export")
    return path


def fingerprint(path: Path) -> str:
    """Cheap identity of a model directory (names, sizes, mtimes): a retrained model in place is not reused."""
    stats = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(path).iterdir() if f.is_file())
    return hashlib.sha256(repr(stats).encode()).hexdigest()[:16]


def manifest_digest(shard_dir: Path) -> str:
    """Identity of the validation data: the shard set's manifest digest (sha256 of manifest.json, which lists every
    shard's sha256 and the tokenizer's), the same digest the shard stage logs as the MLflow dataset."""
    from data_prep.manifest import digest

    return digest(shard_dir)


def val_batches(shard_dir: Path, n: int, batch_size: int, what: str) -> list:
    """The first `n` batches of the val split in file order (no shuffle), as a list: every model sees the same
    tokens, run after run."""
    from data_prep.errors import DataPrepError
    from data_prep.loader import ShardLoader

    from data_prep.manifest import load_manifest

    try:
        samples = load_manifest(shard_dir)["splits"].get("val", {}).get("samples", 0)
        if samples < batch_size:
            raise StageError(f"{what} set is empty: the val split of {shard_dir} has {samples} sequences, fewer than "
                             f"one batch of {batch_size}; reshard with a larger data.val_fraction or corpus")
        loader = ShardLoader(shard_dir, split="val", batch_size=batch_size, num_workers=0, shuffle=False)
    except DataPrepError as e:
        raise StageError(f"{what} data: {e}") from None
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) >= n:
            break
    return batches
