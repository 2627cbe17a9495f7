"""build_shard_set(): corpus → tokenizer → packed windows → shards → manifest, cached by source + config.

The version directory's name is a hash of the source fingerprint, the output-shaping config and the tokenizer
identity: the same source and config find the published directory and rewrite nothing (a cache hit); any change
gives a new version beside the old one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from tqdm import tqdm

from data_prep.clean import TRAIN, VAL, clean_documents
from data_prep.config import ShardConfig
from data_prep.corpus import CorpusStats, fingerprint, resolve_inputs
from data_prep.errors import DataPrepError
from data_prep.manifest import FORMAT, MANIFEST, digest, load_manifest, manifest_bytes
from data_prep.pack import TokenFile, plan_shards
from data_prep.tokenizer import (
    encode_stream,
    find_eos,
    load_tokenizer,
    token_dtype,
    tokenizer_companions,
    tokenizer_file,
    tokenizer_identity,
    train_bpe,
)
from data_prep.writer import ensure_writable, fresh_tmp_dir, out_dir_lock, publish, sha256_file, write_split

log = logging.getLogger(__name__)
BATCH_DOCS, BATCH_CHARS = 512, 1 << 20  # per encode task: big enough to amortise IPC, small enough to stream


@dataclass
class BuildResult:
    shard_dir: Path
    manifest: dict
    digest: str  # sha256 of manifest.json
    cache_hit: bool
    seconds: float  # this call, wall clock
    tokenizer_seconds: float = 0.0  # training the BPE (0 when loaded or cached)
    sharding_seconds: float = 0.0  # read → clean → tokenise → pack → write → publish

    @property
    def tokens(self) -> int:
        return sum(s["token_stream"] for s in self.manifest["splits"].values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.sharding_seconds if self.sharding_seconds else 0.0


def version_name(files: list[Path], cfg: ShardConfig) -> str:
    key = [FORMAT, fingerprint(files), cfg.config_hash(), tokenizer_identity(cfg.tokenizer)]
    return "shards-" + hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]


def build_shard_set(cfg: ShardConfig) -> BuildResult:
    started = time.perf_counter()
    cfg.validate()
    if not cfg.shard_multiple:  # 0 = automatic; alone, data_prep knows of one reader (the pipeline passes its own)
        cfg = cfg.model_copy(update={"shard_multiple": 1})
    files = resolve_inputs(cfg.inputs)
    out_dir = Path(cfg.out_dir)
    version = version_name(files, cfg)
    final = out_dir / version
    if (final / MANIFEST).is_file():
        return BuildResult(final, load_manifest(final), digest(final), True, time.perf_counter() - started)
    ensure_writable(out_dir)
    with out_dir_lock(out_dir):
        if (final / MANIFEST).is_file():  # another writer published it while we waited for the lock
            return BuildResult(final, load_manifest(final), digest(final), True, time.perf_counter() - started)
        if final.exists():
            raise DataPrepError(f"{final} exists but has no {MANIFEST} (not written by this tool?); remove it")
        tmp = fresh_tmp_dir(out_dir, version)
        try:
            manifest, tok_s, shard_s = _build(cfg, files, version, tmp)
            (tmp / MANIFEST).write_bytes(manifest_bytes(manifest))  # last: its presence means "complete"
            publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    result = BuildResult(final, manifest, digest(final), False, time.perf_counter() - started, tok_s, shard_s)
    log.info("shard set %s: %d tokens in %.1f s (%.0f tokens/s)", final, result.tokens, shard_s, result.tokens_per_s)
    return result


def _batches(docs: Iterable[tuple[str, str]], bar) -> Iterator[tuple[str, list[str]]]:
    """Group (split, text) into per-split batches, flushed in a deterministic order."""
    pending: dict[str, list[str]] = {TRAIN: [], VAL: []}
    chars = {TRAIN: 0, VAL: 0}
    for split, text in docs:
        pending[split].append(text)
        chars[split] += len(text)
        if len(pending[split]) >= BATCH_DOCS or chars[split] >= BATCH_CHARS:
            bar.update(len(pending[split]))
            yield split, pending[split]
            pending[split], chars[split] = [], 0
    for split in (TRAIN, VAL):
        if pending[split]:
            bar.update(len(pending[split]))
            yield split, pending[split]


def _empty_corpus(files: list[Path], stats: CorpusStats) -> DataPrepError:
    skipped = ", ".join(f"{k} {v}" for k, v in stats.as_dict().items() if v and k not in ("files", "documents_out"))
    return DataPrepError(f"empty corpus: no document kept from {len(files)} input file(s) ({skipped or 'all empty'})")


def _build(cfg: ShardConfig, files: list[Path], version: str, tmp: Path) -> tuple[dict, float, float]:
    t0 = time.perf_counter()
    if cfg.tokenizer == "train":  # on the train split only: nothing of val leaks into the vocabulary
        train_texts = (t for split, t in clean_documents(files, cfg, CorpusStats()) if split == TRAIN)
        tok = train_bpe(train_texts, cfg.vocab_size, cfg.eos_token or "<|endoftext|>")
        source = "train"
    else:
        tok = load_tokenizer(cfg.tokenizer)
        source = str(tokenizer_file(cfg.tokenizer).resolve())
    t1 = time.perf_counter()
    eos_name, eos_id = find_eos(tok, cfg.tokenizer, cfg.eos_token)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab, cfg.token_dtype)
    tok_files = ["tokenizer.json"]
    if cfg.tokenizer == "train":
        tok.save(str(tmp / "tokenizer.json"))
    else:  # as given, byte for byte, with its companion files (tokenizer_config.json …)
        shutil.copyfile(tokenizer_file(cfg.tokenizer), tmp / "tokenizer.json")
        for f in tokenizer_companions(cfg.tokenizer):
            shutil.copyfile(f, tmp / f.name)
            tok_files.append(f.name)

    stats = CorpusStats()
    streams = {s: TokenFile(tmp / f".{s}.tokens", dtype) for s in (TRAIN, VAL)}
    with tqdm(desc=f"tokenise {version}", unit="doc", disable=not cfg.progress, mininterval=2) as bar:
        batches = _batches(clean_documents(files, cfg, stats), bar)
        for split, ids in encode_stream(tok, eos_id, dtype, batches, cfg.tokenize_processes):
            streams[split].append(ids)
    for s in streams.values():
        s.close()
    if stats.documents_out == 0:
        raise _empty_corpus(files, stats)

    seed = int(cfg.config_hash()[:8], 16)
    window = cfg.seq_len + 1
    splits, warnings = {}, []
    for split, stream in streams.items():
        windows = stream.tokens // window
        if split == TRAIN and windows == 0:
            raise DataPrepError(
                f"seq_len {cfg.seq_len} is longer than the whole corpus: {stream.tokens} training "
                f"tokens make no window of {window}; lower data.seq_len or add documents"
            )
        plan = plan_shards(windows, cfg.seq_len, dtype, cfg.shard_size_mb, cfg.shard_multiple)
        if windows == 0 and cfg.val_fraction > 0:
            warnings.append(f"{split} split is empty ({stream.tokens} tokens < one window of {window})")
        if plan.warning:
            warnings.append(f"{split}: {plan.warning}")
        entries = write_split(tmp, split, stream.path, plan, cfg.seq_len, dtype, seed, cfg.tokenize_processes)
        stream.path.unlink()
        splits[split] = {
            "samples": plan.used,
            "tokens": plan.used * window,
            "token_stream": stream.tokens,
            "dropped_samples": plan.dropped,
            "shards": entries,
        }
    for w in warnings:
        log.warning("%s", w)
    manifest = {
        "format": FORMAT,
        "version": version,
        "seq_len": cfg.seq_len,
        "sample_tokens": window,
        "dtype": dtype.name,
        "vocab_size": vocab,
        "eos_token": eos_name,
        "eos_id": eos_id,
        "tokenizer": {
            "file": "tokenizer.json",
            "sha256": sha256_file(tmp / "tokenizer.json"),
            "source": source,
            **({"files": tok_files} if len(tok_files) > 1 else {}),
        },
        "source": {"inputs": list(cfg.inputs), "files": len(files), "fingerprint": fingerprint(files)},
        "config": cfg.key_fields(),
        "stats": stats.as_dict(),
        "shard_multiple": cfg.shard_multiple,
        "warnings": warnings,
        "splits": splits,
    }
    return manifest, t1 - t0, time.perf_counter() - t1
