"""Corpus reading: resolve inputs to a sorted file list, then stream documents out of .txt/.jsonl/.parquet (± .gz).

A .txt (or any other text) file is one document; a .jsonl line or a .parquet row is one document. Nothing is ever
read whole: text files are read up to the length limit, jsonl lines with a capped readline, parquet in row batches,
so a 200 MB single-line file costs at most `max_chars` of memory. Problems with one file or record are counted
skips (`CorpusStats`); only "nothing to read at all" is an error.

Every byte of a file that is read is also hashed (sha256, as it streams by: `digests`), and the rest of a file
that is skipped early (too long, binary) is read through to finish its hash: the shard set's version is named by
the inputs' contents, never by their mtimes.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import logging
import os
import sysconfig
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Iterator

from data_prep.errors import DataPrepError

STDLIB = "stdlib"
TEXT_SUFFIXES = {".txt", ".text", ".md", ".rst"}
WALK_SUFFIXES = TEXT_SUFFIXES | {".jsonl", ".parquet"}  # what a directory walk picks up (plus .gz of these)
STDLIB_SUFFIXES = {".py", ".txt", ".rst"}
_RECORD_LOOKALIKES = {".json", ".ndjson", ".csv", ".tsv"}  # given as files: one text document each (warned)
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
    first_undecodable: str = field(default="", compare=False)  # the first file with invalid UTF-8 (not a counter)
    path: str = field(default="", compare=False, repr=False)  # the file being read
    quiet: bool = field(default=False, compare=False, repr=False)  # a second reading (the BPE's): files not named again

    def as_dict(self) -> dict:
        """The counters (what the manifest's `stats` holds)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type in ("int", int)}

    def counters(self) -> tuple[int, ...]:
        return tuple(self.as_dict().values())


def stdlib_files() -> list[Path]:
    """The Python standard library's own sources and docs: present on every machine, sorted for determinism."""
    root = Path(sysconfig.get_paths()["stdlib"] or Path(os.__file__).parent)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune: site-packages can be huge
        found += [Path(dirpath, f) for f in filenames if Path(f).suffix in STDLIB_SUFFIXES]
    return sorted((p for p in found if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def _say(notes: list[str] | None, fmt: str, *args) -> None:
    """One warning line about the inputs: logged, and kept in `notes` (the build records them in the manifest)."""
    log.warning(fmt, *args)
    if notes is not None:
        notes.append(fmt % args)


def _say_symlinked_dirs(root: Path, what: str, notes: list[str] | None = None) -> None:
    """One warning line naming the symlinked directories under `root` that a walk or a `**` glob passes by (neither
    follows them: a loop would never end), so that a linked-in part of the corpus is not lost unnoticed."""
    links = [Path(d, n) for d, dirs, _ in os.walk(root) for n in dirs if os.path.islink(os.path.join(d, n))]
    if links:
        _say(
            notes,
            "%s (%d skipped, e.g. %s); give them as inputs of their own to include them",
            what,
            len(links),
            links[0],
        )


def _walk(directory: Path, notes: list[str] | None = None) -> list[Path]:
    """A directory's corpus files. Like a glob's `**`, the walk does not follow symlinked directories (a loop would
    never end), nor enter hidden ones: those it passes are named in one warning line, and the files it does not read
    (other formats, hidden entries, dangling symlinks) are counted in another, so that a linked-in part of the
    corpus is not lost unnoticed."""
    _say_symlinked_dirs(directory, f"input {directory}: symlinked directories are not followed", notes)
    found, passed, hidden, dangling = [], {}, [], []
    for dirpath, dirnames, filenames in os.walk(directory):
        hidden += [Path(dirpath, d) for d in dirnames if d.startswith(".")]
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # not entered: .git, .cache …
        for name in filenames:
            p = Path(dirpath, name)
            if name.startswith("."):
                hidden.append(p)
            elif not p.is_file():
                if p.is_symlink() and not p.exists():
                    dangling.append(p)
            elif _kind_suffix(p) in WALK_SUFFIXES:
                found.append(p)
            else:  # another format: not read, and said (a .json or .csv corpus beside .jsonl files is not lost unseen)
                passed.setdefault(_kind_suffix(p) or "(no suffix)", []).append(p)
    if passed:
        counts = ", ".join(f"{k} {len(v)}" for k, v in sorted(passed.items(), key=lambda kv: (-len(kv[1]), kv[0])))
        _say(
            notes,
            "input %s: %d file(s) not read (%s; first %s): a directory walk reads %s (and their .gz); name other "
            "text files directly or with a glob, convert tables to .jsonl or .parquet",
            directory,
            sum(len(v) for v in passed.values()),
            counts,
            min(p for v in passed.values() for p in v),
            " ".join(sorted(WALK_SUFFIXES)),
        )
    said = []  # what the walk skipped without looking at its format: one more line
    if hidden:
        said.append(
            f"{len(hidden)} hidden entr{'y' if len(hidden) == 1 else 'ies'} (names starting with '.'; first "
            f"{min(hidden)}): give them as inputs of their own to include them"
        )
    if dangling:
        first = min(dangling)
        said.append(
            f"{len(dangling)} dangling symlink(s) (first {first} -> {os.readlink(first)}): fix or remove the links"
        )
    if said:
        _say(notes, "input %s: a directory walk skipped %s", directory, "; and ".join(said))
    return sorted(found)


def _kind_suffix(path: Path) -> str:
    """The suffix that says the format: "x.jsonl.gz" → ".jsonl"."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1].lower() if suffixes else ""


def _glob(spec: str, notes: list[str] | None = None) -> list[Path]:
    """A glob's matches, sorted. pathlib's `**` does not follow symlinked directories (glob.glob does, and a link
    loop makes it run forever); the symlinked directories it passed are named in one warning line."""
    path = Path(spec).expanduser()
    parts = path.parts
    fixed = next(i for i, part in enumerate(parts + ("*",)) if any(c in part for c in "*?["))
    root, pattern = Path(*parts[:fixed]) if fixed else Path("."), "/".join(parts[fixed:])
    hidden = lambda m: any(p.startswith(".") for p in m.relative_to(root).parts)  # noqa: E731 (as glob.glob)
    matches = sorted(m for m in root.glob(pattern) if not hidden(m)) if root.is_dir() else []
    if "**" in pattern and root.is_dir():
        _say_symlinked_dirs(root, f"input {spec}: ** does not follow symlinked directories", notes)
    return matches


def resolve_inputs(inputs: list[str], notes: list[str] | None = None) -> list[Path]:
    """Files, directories (walked) and globs → a de-duplicated file list in input order, each group sorted. Each
    warning about the inputs (files a walk did not read, a table read as one document …) is logged and, given
    `notes`, appended to it."""
    files: list[Path] = []
    for spec in inputs:
        if spec == STDLIB:
            files += stdlib_files()
            continue
        path = Path(spec).expanduser()
        if any(c in spec for c in "*?[") and not os.path.lexists(path):  # an existing `data[1].txt` is that file
            matches = _glob(spec, notes)
            found = [m for m in matches if m.is_file()]
            lookalikes = [m for m in found if _kind_suffix(m) in _RECORD_LOOKALIKES]
            if lookalikes:  # as a file named directly: one line for the glob, not one per file
                _say(
                    notes,
                    "input %s matched %d %s file(s) (first %s): each is read as one text document (only .jsonl "
                    "lines and .parquet rows are records); rename JSON Lines to .jsonl, convert other tables to "
                    ".jsonl or .parquet",
                    spec,
                    len(lookalikes),
                    "/".join(sorted({_kind_suffix(m) for m in lookalikes})),
                    lookalikes[0],
                )
            found += [f for d in matches if d.is_dir() for f in _walk(d, notes)]
            if not found:  # beside other inputs, a mistyped pattern lost its files without a word
                raise DataPrepError(
                    f"input {spec} matches nothing; fix the pattern or remove it from data.inputs"
                    if not matches
                    else f"input {spec} matches no file, only directories holding none a walk reads "
                    f"({' '.join(sorted(WALK_SUFFIXES))} and their .gz); fix the pattern or remove it from data.inputs"
                )
            files += found
        elif path.is_dir():
            found = _walk(path, notes)
            if not found:
                raise DataPrepError(
                    f"input {spec} is a directory with no file a walk reads ({' '.join(sorted(WALK_SUFFIXES))} and "
                    "their .gz); name its files directly or with a glob, or remove it from data.inputs"
                )
            files += found
        elif path.exists() and not path.is_file():  # read once, it could not be hashed for the cache key
            raise DataPrepError(
                f"input {spec} is not a regular file (a pipe, socket or device: <(…) or a FIFO is read only once, "
                "and a build reads its inputs more than once); write it to a file and give that"
            )
        elif path.is_file():
            if _kind_suffix(path) in _RECORD_LOOKALIKES:
                _say(
                    notes,
                    "input %s is read as one text document (only .jsonl lines and .parquet rows are records); "
                    "rename JSON Lines to .jsonl, convert other tables to .jsonl or .parquet",
                    spec,
                )
            files.append(path)
        else:
            raise DataPrepError(f"input {spec} does not exist")
    unique = list(dict.fromkeys(Path(os.path.abspath(p)) for p in files))
    for p in unique:
        try:
            str(p).encode("utf-8")
        except UnicodeEncodeError:  # the name goes into job.json, the manifest, logs and MLflow
            raise DataPrepError(
                f"input file {os.fsencode(p)!r} has a name that is not valid UTF-8; rename it (e.g. convmv -f latin1 "
                "-t utf-8) or remove it from data.inputs"
            ) from None
    if not unique:
        raise DataPrepError(
            f"no input files matched {', '.join(inputs)} (looked for {', '.join(sorted(WALK_SUFFIXES))} and their .gz)"
        )
    return unique


def _has_bom(path: Path) -> bool:
    """The file (a text or .jsonl one, ± .gz) starts with a UTF-8 byte-order mark. Unreadable: False (the reader
    counts it)."""
    if _kind_suffix(path) == ".parquet":
        return False
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
            return f.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8
    except (OSError, EOFError, zlib.error):
        return False


def stat_key(files: list[Path], stats: list[os.stat_result] | None = None) -> str:
    """Where a build of these files is looked up (never what names the data: that is `content_key`): path, size,
    mtime, ctime and inode of every file. ctime cannot be set back (utime sets it to now), so a file rewritten with
    its size and mtime kept still gets another key; a file merely touched or copied is read again and found equal
    by its content. A file starting with a UTF-8 BOM is marked (three bytes read): builds from before the reader
    stripped it (it cost a .jsonl its first record) are not found for it; every other file's key is unchanged."""
    h = hashlib.sha256()
    for p, st in zip(files, stats or [p.stat() for p in files]):
        bom = "\0bom" if _has_bom(p) else ""
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}{bom}\n".encode())
    return h.hexdigest()[:16]


def content_key(digests: list[str]) -> str:
    """The identity of the source: the sha256 of the files' sha256s, in corpus order."""
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


class HashingFile:
    """A binary file whose bytes are hashed as they are read (read, readline); `finish()` reads the rest."""

    def __init__(self, path: Path):
        self._f = open(path, "rb")
        self.hash = hashlib.sha256()
        self.mode, self.name = "rb", str(path)

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.hash.update(data)
        return data

    def readline(self, n: int = -1) -> bytes:
        data = self._f.readline(n)
        self.hash.update(data)
        return data

    def finish(self) -> str:
        while chunk := self._f.read(_CHUNK):
            self.hash.update(chunk)
        return self.hash.hexdigest()

    def close(self) -> None:
        self._f.close()


def file_sha256(path: Path) -> str:
    f = HashingFile(path)
    try:
        return f.finish()
    finally:
        f.close()


def _decode(raw: bytes, on_error: str, stats: CorpusStats) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.undecodable += 1
        stats.first_undecodable = stats.first_undecodable or stats.path
        return None if on_error == "skip" else raw.decode("utf-8", errors="replace")


def _encodable(text: str, on_error: str, stats: CorpusStats) -> str | None:
    """A decoded text that holds a lone surrogate (a JSON "\\ud83d" escape without its pair) is no text UTF-8 can
    write: counted as undecodable, like invalid UTF-8, and replaced (U+FFFD) or skipped per on_decode_error."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        stats.undecodable += 1
        stats.first_undecodable = stats.first_undecodable or stats.path
        return None if on_error == "skip" else text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _text_file(f, max_chars: int, on_error: str, stats: CorpusStats, bom: list[bool]) -> Iterator[str]:
    head = f.read(_SNIFF_BYTES)
    if b"\0" in head:
        stats.binary_files += 1
        if not stats.quiet:
            log.warning("skipping binary input %s: NUL bytes in its first %d bytes", stats.path, _SNIFF_BYTES)
        return
    if head.startswith(codecs.BOM_UTF8):  # an encoding signature, not text (Python's utf-8-sig drops it too)
        head = head[len(codecs.BOM_UTF8) :]
        bom.append(True)
    limit = 4 * max_chars + 4  # UTF-8 needs at most 4 bytes a character: beyond this it is surely too long
    raw = head + f.read(max(limit - len(head), 0))
    stats.documents_in += 1
    if len(raw) >= limit and f.read(1):
        stats.too_long += 1
        return
    text = _decode(raw, on_error, stats)
    if text is not None:
        yield text


def _jsonl_file(
    f, text_field: str, max_chars: int, on_error: str, stats: CorpusStats, bom: list[bool]
) -> Iterator[str]:
    # JSON escaping: an astral character (an emoji) is 4 bytes of UTF-8 but 12 as \ud83d\ude00 (json.dumps'
    # default, ensure_ascii); the exact length test is cleaned()'s
    limit = 12 * max_chars + 1024
    first = True
    while line := f.readline(limit):
        if first and line.startswith(codecs.BOM_UTF8):  # a signature before the first record, not part of it
            line = line[len(codecs.BOM_UTF8) :]
            bom.append(True)
        first = False
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
        value = _encodable(value, on_error, stats)
        if value is not None:
            yield value


def _parquet_file(path: Path, text_field: str, on_error: str, stats: CorpusStats) -> Iterator[str]:
    import pyarrow.parquet as pq

    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        if text_field not in pf.schema_arrow.names:
            raise DataPrepError(
                f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); set data.text_field"
            )
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                stats.documents_in += 1
                if not isinstance(value, str):
                    stats.bad_records += 1
                elif (value := _encodable(value, on_error, stats)) is not None:
                    yield value


def iter_documents(
    files: list[Path],
    *,
    text_field: str = "text",
    max_chars: int = 1_000_000,
    on_decode_error: str = "replace",
    stats: CorpusStats | None = None,
    digests: list[str] | None = None,
) -> Iterator[str]:
    """Raw document texts, in file order. Unreadable files are skipped with a warning and counted. `digests`, when
    given, receives the sha256 of every file opened (also of one left early: the consumer stopped), in order."""
    stats = stats if stats is not None else CorpusStats()
    for path in files:
        stats.files += 1
        stats.path = str(path)
        kind = _kind_suffix(path)
        seen = stats.documents_in
        raw = digest = None
        bom: list[bool] = []  # the reader dropped a leading UTF-8 BOM
        try:
            if kind == ".parquet":
                digest = file_sha256(path) if digests is not None else None  # pyarrow reads by random access
                yield from _parquet_file(path, text_field, on_decode_error, stats)
                continue
            raw = HashingFile(path)
            f = gzip.GzipFile(fileobj=raw, mode="rb") if path.suffix == ".gz" else raw
            if kind == ".jsonl":
                yield from _jsonl_file(f, text_field, max_chars, on_decode_error, stats, bom)
            else:
                yield from _text_file(f, max_chars, on_decode_error, stats, bom)
        except DataPrepError:
            raise
        except (OSError, EOFError, ValueError, zlib.error) as e:  # gzip/parquet format errors land here too
            if isinstance(e, (EOFError, gzip.BadGzipFile, zlib.error)) or stats.documents_in > seen:
                # Truncated/corrupt after documents of it were already taken: "skipping" would be untrue, and a
                # partial file silently shapes the shard set. Refuse, naming the file.
                raise DataPrepError(
                    f"input {path} is truncated or corrupt after {stats.documents_in - seen} "
                    f"documents ({'zlib.error' if isinstance(e, zlib.error) else type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); "
                    f"repair or re-download it, or remove it from data.inputs"
                ) from None
            stats.unreadable_files += 1
            if not stats.quiet:
                log.warning("skipping unreadable input %s: %s: %s", path, type(e).__name__, e)
        finally:  # also when the consumer stops early (max_documents): the hash covers the whole file
            if raw is not None:
                try:
                    digest = raw.finish()
                except OSError as e:
                    digest = f"unreadable {type(e).__name__}"
                raw.close()
            if digests is not None:  # how the bytes were read is part of what they mean: the same bytes as a
                # .json (one text document) and as a .jsonl (a document a line) are two corpora, two versions
                reader = "" if kind not in (".jsonl", ".parquet") else f"{kind[1:]}:"
                # a BOM read as text (before the reader dropped it) named other documents: another version
                digests.append(reader + ("bom:" if bom else "") + (digest or "unreadable"))
