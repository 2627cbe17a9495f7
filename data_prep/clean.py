"""Cleaning: newline normalisation, length filters, exact de-duplication, and the train/val split by content hash."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Iterator

from data_prep.config import ShardConfig
from data_prep.corpus import CorpusStats, iter_documents

TRAIN, VAL = "train", "val"
SPLITS = (TRAIN, VAL)


def normalize(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n").strip("\n")


def doc_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=16).digest()


def split_of(digest: bytes, val_fraction: float) -> str:
    """The same document always lands in the same split, whatever else is in the corpus."""
    return VAL if int.from_bytes(digest[8:], "big") < val_fraction * 2**64 else TRAIN


def cleaned(
    files: list[Path], cfg: ShardConfig, stats: CorpusStats, digests: list[str] | None = None
) -> Iterator[tuple[bytes, str, str]]:
    """(content hash, split, text) of every kept document, in corpus order; `digests` gets each file's sha256.
    Memory: 16 bytes (+ set overhead) per document."""
    seen: set[bytes] = set()
    docs = iter_documents(
        files,
        text_field=cfg.text_field,
        max_chars=cfg.max_chars,
        on_decode_error=cfg.on_decode_error,
        stats=stats,
        digests=digests,
    )
    with contextlib.closing(docs):  # stopping early still closes (and hashes) the file being read, now
        for text in docs:
            text = normalize(text)
            if len(text) < cfg.min_chars:
                stats.too_short += 1
                continue
            if len(text) > cfg.max_chars:
                stats.too_long += 1
                continue
            digest = doc_hash(text)
            if digest in seen:
                stats.duplicates += 1
                continue
            seen.add(digest)
            stats.documents_out += 1
            yield digest, split_of(digest, cfg.val_fraction), text
            if cfg.max_documents and stats.documents_out >= cfg.max_documents:
                return


def clean_documents(files: list[Path], cfg: ShardConfig, stats: CorpusStats) -> Iterator[tuple[str, str]]:
    """(split, text) for every kept document, in corpus order."""
    for _, split, text in cleaned(files, cfg, stats):
        yield split, text
