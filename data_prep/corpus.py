"""Corpus reading: resolve inputs to a sorted file list, then stream documents out of .txt/.jsonl/.parquet (± .gz).

A .txt (or any other text) file is one document; a .jsonl line or a .parquet row is one document. Nothing is ever
read whole: text files are read up to the length limit, jsonl lines with a capped readline, parquet in row batches,
so a 200 MB single-line file costs at most `max_chars` of memory. Problems with one file or record are counted
skips (`CorpusStats`); only "nothing to read at all" is an error.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import os
import sysconfig
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

from data_prep.errors import DataPrepError

STDLIB = "stdlib"
TEXT_SUFFIXES = {".txt", ".text", ".md", ".rst"}
WALK_SUFFIXES = TEXT_SUFFIXES | {".jsonl", ".parquet"}  # what a directory walk picks up (plus .gz of these)
STDLIB_SUFFIXES = {".py", ".txt", ".rst"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SNIFF_BYTES = 8192
_CHUNK = 1 << 20
log = logging.getLogger(__name__)


@dataclass
class CorpusStats:
    files: int = 0
    binary_files: int = 0  # skipped: NUL bytes in the first 8 KiB
    unreadable_files: int = 0  # skipped: I/O or format error (named in `skipped`)
    documents_in: int = 0  # documents seen (before any filter)
    undecodable: int = 0  # had invalid UTF-8 (replaced or skipped per on_decode_error)
    too_long: int = 0
    too_short: int = 0
    bad_records: int = 0  # jsonl lines that are not JSON objects with a string text field
    duplicates: int = 0
    documents_out: int = 0

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def stdlib_files() -> list[Path]:
    """The Python standard library's own sources and docs: present on every machine, sorted for determinism."""
    root = Path(sysconfig.get_paths()["stdlib"] or Path(os.__file__).parent)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune: site-packages can be huge
        found += [Path(dirpath, f) for f in filenames if Path(f).suffix in STDLIB_SUFFIXES]
    return sorted((p for p in found if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def _walk(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file()
        and _kind_suffix(p) in WALK_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


def _kind_suffix(path: Path) -> str:
    """The suffix that says the format: "x.jsonl.gz" → ".jsonl"."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1].lower() if suffixes else ""


def resolve_inputs(inputs: list[str]) -> list[Path]:
    """Files, directories (walked) and globs → a de-duplicated file list in input order, each group sorted."""
    files: list[Path] = []
    for spec in inputs:
        if spec == STDLIB:
            files += stdlib_files()
            continue
        path = Path(spec).expanduser()
        if any(c in spec for c in "*?["):
            matches = [Path(m) for m in sorted(glob.glob(str(path), recursive=True))]
            files += [m for m in matches if m.is_file()]
            for d in (m for m in matches if m.is_dir()):
                files += _walk(d)
        elif path.is_dir():
            files += _walk(path)
        elif path.is_file():
            files.append(path)
        else:
            raise DataPrepError(f"input {spec} does not exist")
    unique = list(dict.fromkeys(Path(os.path.abspath(p)) for p in files))
    if not unique:
        raise DataPrepError(
            f"no input files matched {', '.join(inputs)} (looked for {', '.join(sorted(WALK_SUFFIXES))} and their .gz)"
        )
    return unique


def fingerprint(files: list[Path]) -> str:
    """Identity of the source: path, size and mtime of every file (cheap: no reading, like make)."""
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _decode(raw: bytes, on_error: str, stats: CorpusStats) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.undecodable += 1
        return None if on_error == "skip" else raw.decode("utf-8", errors="replace")


def _text_file(f, max_chars: int, on_error: str, stats: CorpusStats) -> Iterator[str]:
    head = f.read(_SNIFF_BYTES)
    if b"\0" in head:
        stats.binary_files += 1
        return
    limit = 4 * max_chars + 4  # UTF-8 needs at most 4 bytes a character: beyond this it is surely too long
    raw = head + f.read(max(limit - len(head), 0))
    stats.documents_in += 1
    if len(raw) >= limit and f.read(1):
        stats.too_long += 1
        return
    text = _decode(raw, on_error, stats)
    if text is not None:
        yield text


def _jsonl_file(f, text_field: str, max_chars: int, on_error: str, stats: CorpusStats) -> Iterator[str]:
    limit = 8 * max_chars + 1024  # JSON escaping can double a character's bytes again
    while line := f.readline(limit):
        if len(line) >= limit and not line.endswith(b"\n"):
            stats.documents_in += 1
            stats.too_long += 1
            while (rest := f.readline(_CHUNK)) and not rest.endswith(b"\n"):
                pass  # drain the over-long record in bounded chunks
            continue
        if not line.strip():
            continue
        stats.documents_in += 1
        text = _decode(line, on_error, stats)
        if text is None:
            continue
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            stats.bad_records += 1
            continue
        yield value


def _parquet_file(path: Path, text_field: str, stats: CorpusStats) -> Iterator[str]:
    import pyarrow.parquet as pq

    with _open(path) as f:
        pf = pq.ParquetFile(f)
        if text_field not in pf.schema_arrow.names:
            raise DataPrepError(
                f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); set data.text_field"
            )
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                stats.documents_in += 1
                if isinstance(value, str):
                    yield value
                else:
                    stats.bad_records += 1


def iter_documents(
    files: list[Path],
    *,
    text_field: str = "text",
    max_chars: int = 1_000_000,
    on_decode_error: str = "replace",
    stats: CorpusStats | None = None,
) -> Iterator[str]:
    """Raw document texts, in file order. Unreadable files are skipped with a warning and counted."""
    stats = stats if stats is not None else CorpusStats()
    for path in files:
        stats.files += 1
        kind = _kind_suffix(path)
        seen = stats.documents_in
        try:
            if kind == ".parquet":
                yield from _parquet_file(path, text_field, stats)
                continue
            with _open(path) as f:
                if kind == ".jsonl":
                    yield from _jsonl_file(f, text_field, max_chars, on_decode_error, stats)
                else:
                    yield from _text_file(f, max_chars, on_decode_error, stats)
        except DataPrepError:
            raise
        except (OSError, EOFError, ValueError) as e:  # gzip/parquet format errors land here too
            if isinstance(e, (EOFError, gzip.BadGzipFile)) or stats.documents_in > seen:
                # Truncated/corrupt after documents of it were already taken: "skipping" would be untrue, and a
                # partial file silently shapes the shard set. Refuse, naming the file.
                raise DataPrepError(
                    f"input {path} is truncated or corrupt after {stats.documents_in - seen} "
                    f"documents ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                    f"repair or re-download it, or remove it from data.inputs"
                ) from None
            stats.unreadable_files += 1
            log.warning("skipping unreadable input %s: %s: %s", path, type(e).__name__, e)
