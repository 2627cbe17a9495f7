"""tiny_shard_set(): a small real shard set in seconds, for other areas' tests (smoke, train, evaluate…)."""

from __future__ import annotations

from pathlib import Path

from data_prep.build import build_shard_set
from data_prep.config import ShardConfig


def tiny_shard_set(
    out_dir: str | Path,
    seq_len: int = 32,
    vocab_size: int = 512,
    n_docs: int = 40,
    val_fraction: float = 0.1,
    shard_multiple: int = 4,
    shard_size_mb: float = 0.25,
) -> Path:
    """Build (or find cached) a shard set from the first `n_docs` files of the Python standard library.

    A byte-level BPE of `vocab_size` is trained on it; shards are a multiple of `shard_multiple` (2 ranks × 2
    workers by default). Returns the shard set directory (manifest.json, tokenizer.json, train-*/val-* tars).
    """
    cfg = ShardConfig(
        inputs=["stdlib"],
        out_dir=str(out_dir),
        max_documents=n_docs,
        vocab_size=vocab_size,
        seq_len=seq_len,
        val_fraction=val_fraction,
        shard_size_mb=shard_size_mb,
        shard_multiple=shard_multiple,
        tokenize_processes=1,
        progress=False,
    )
    return build_shard_set(cfg).shard_dir
