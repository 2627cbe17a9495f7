"""manifest.json: the shard set's table of contents, written last; what the loader and later stages trust.

Format "llm-pipeline-shards/1" (keys sorted, so the same build gives the same bytes):
  version, format, seq_len, sample_tokens (= seq_len + 1), dtype, vocab_size, eos_token, eos_id,
  tokenizer {file, sha256, source}, source {inputs, files, fingerprint}, config (the settings that shaped the bytes),
  stats (CorpusStats counters), shard_multiple, warnings [..],
  splits {train|val: {samples, tokens, dropped_samples, shards: [{name, samples, tokens, bytes, sha256}]}}.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from data_prep.errors import CorruptShardError, DataPrepError

FORMAT = "llm-pipeline-shards/1"
MANIFEST = "manifest.json"
_REQUIRED = ("version", "format", "seq_len", "dtype", "vocab_size", "eos_id", "tokenizer", "splits")


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def digest(shard_dir: str | Path) -> str:
    """sha256 of manifest.json: the shard set's identity (it lists every shard's sha256)."""
    return hashlib.sha256((Path(shard_dir) / MANIFEST).read_bytes()).hexdigest()


def load_manifest(shard_dir: str | Path) -> dict:
    """Read and check a shard set's manifest; every problem is a one-line DataPrepError."""
    path = Path(shard_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataPrepError(f"{shard_dir} is not a shard set (no {MANIFEST}); run the shard stage first") from None
    except (OSError, ValueError) as e:
        raise DataPrepError(f"{path} is unreadable ({e})") from None
    missing = [k for k in _REQUIRED if k not in manifest] if isinstance(manifest, dict) else list(_REQUIRED)
    if missing:
        raise DataPrepError(f"{path} lacks {', '.join(missing)}")
    if manifest["format"] != FORMAT:
        raise DataPrepError(f"{path}: format {manifest['format']!r} is not {FORMAT!r}; rebuild the shard set")
    return manifest


def shards(manifest: dict, split: str) -> list[dict]:
    if split not in manifest["splits"]:
        raise DataPrepError(
            f"shard set {manifest['version']} has no split {split!r} (has {', '.join(manifest['splits'])})"
        )
    return manifest["splits"][split]["shards"]


def check_files(shard_dir: str | Path, manifest: dict, split: str, sha256: bool = False) -> None:
    """Every shard of the split exists with its manifest size (and, optionally, its sha256)."""
    from data_prep.writer import sha256_file

    for entry in shards(manifest, split):
        path = Path(shard_dir) / entry["name"]
        if not path.is_file():
            raise CorruptShardError(f"shard {path} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CorruptShardError(
                f"shard {path} is truncated or altered: {size} bytes, manifest says {entry['bytes']}"
            )
        if sha256 and sha256_file(path) != entry["sha256"]:
            raise CorruptShardError(f"shard {path} is corrupt: sha256 differs from the manifest")
