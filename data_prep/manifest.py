"""manifest.json: the shard set's table of contents, written last; what the loader and later stages trust.

Format "llm-pipeline-shards/2" (keys sorted, so the same build gives the same bytes):
  version, format, seq_len, sample_tokens (= seq_len + 1), dtype, vocab_size, eos_token, eos_id,
  tokenizer {file, sha256 (of tokenizer.json), source, files [tokenizer.json, companions…],
             file_sha256 {name: sha256} (every tokenizer file), identity (tokenizer.identity of file_sha256)},
  source {inputs, files, fingerprint (sha256 of the inputs' contents, in order),
          ended {max_documents, last_file, files_not_read} (only when data.max_documents ended the corpus)},
  config (the settings that shaped the bytes), stats (CorpusStats counters), shard_multiple,
  warnings [..] (the inputs' lines — files a directory walk did not read … — then the build's),
  splits {train|val: {samples, tokens, token_stream, dropped_samples,
                      shards: [{name, samples, tokens, bytes, sha256, samples_crc32}]}}.
samples_crc32 is the crc32 of the shard's samples (key bytes, then payload bytes, in tar order): the loader checks it
on every shard it reads, before it hands out any sample of it (cheap: ~1 µs a sample).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from data_prep.errors import CorruptShardError, DataPrepError

FORMAT = "llm-pipeline-shards/2"
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
        if not Path(shard_dir).exists():
            raise DataPrepError(f"{shard_dir} does not exist; give the shard set's directory") from None
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


def check_tokenizer(shard_dir: str | Path, manifest: dict) -> None:
    """tokenizer.json and its companion files are the ones the shards were tokenized with (sha256 each): the token
    ids mean nothing under another tokenizer, even one of the same size. A companion file the manifest does not
    record (added after sharding, e.g. a tokenizer_config.json naming another EOS) is refused too: an HF export of a
    model trained on the shard set would carry it."""
    from data_prep.tokenizer import COMPANION_FILES

    recorded = manifest["tokenizer"].get("file_sha256")
    for name in COMPANION_FILES if recorded is not None else ():
        if name not in recorded and (Path(shard_dir) / name).is_file():
            raise DataPrepError(
                f"shard set {shard_dir}: {name} was added after sharding (the manifest records "
                f"{', '.join(recorded)}); the shards were tokenized without it: remove it or rebuild the shard set"
            )
    for name, want in (recorded or {}).items():
        path = Path(shard_dir) / name
        try:
            have = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            raise DataPrepError(
                f"shard set {shard_dir}: tokenizer file {name} is missing; the shards' token ids belong to it: "
                "restore it or rebuild the shard set"
            ) from None
        if have != want:
            raise DataPrepError(
                f"shard set {shard_dir}: {name} was changed after sharding (sha256 {have[:12]}…, the manifest "
                f"says {want[:12]}…); the shards' token ids belong to the original: restore it or rebuild the "
                "shard set"
            )


def check_files(shard_dir: str | Path, manifest: dict, split: str, sha256: bool = False) -> None:
    """The tokenizer is the manifest's, every shard of the split exists with its manifest size (and, optionally,
    its sha256). The samples' crc32 is the loader's to check, as it reads."""
    from data_prep.fsio import sha256_file

    check_tokenizer(shard_dir, manifest)
    for entry in shards(manifest, split):
        path = Path(shard_dir) / entry["name"]
        if not path.is_file():
            raise CorruptShardError(
                f"shard {path} is missing; rerun the shard stage to rebuild the set (or restore it)"
            )
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CorruptShardError(
                f"shard {path} is truncated or altered: {size} bytes, manifest says {entry['bytes']}; rerun the "
                "shard stage to rebuild the set (or restore it)"
            )
        if sha256 and sha256_file(path) != entry["sha256"]:
            raise CorruptShardError(
                f"shard {path} is corrupt: sha256 differs from the manifest; remove {shard_dir} and rerun the shard "
                "stage to rebuild it"
            )
