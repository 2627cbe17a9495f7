"""The layout step: every partition's records → the one corpus a single reader would have seen → the shard plan.

A document is kept at its first occurrence in corpus order (the partitions are contiguous runs of files, so their
order is the corpus order); with data.max_documents the corpus ends after that many kept documents, and the
counters are those a single reader had at that moment (the partition's snapshot). Each split's token stream is the
kept documents' tokens in order: `segments-<split>.npy` (partition, first token, tokens) names where they lie. The
windows of seq_len + 1 tokens, the shard plan and the seeded window order are the single-process build's own, so
the shards are the same bytes for any number of partitions or workers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

import numpy as np

from data_prep import fsio
from data_prep.clean import SPLITS, TRAIN, VAL
from data_prep.corpus import CorpusStats, content_key
from data_prep.errors import DataPrepError
from data_prep.job import Job, intact, unless_published
from data_prep.manifest import FORMAT
from data_prep.pack import plan_shards, window_order
from data_prep.partition import load_partition
from data_prep.tokenizer import TEXT_ENCODING

log = logging.getLogger(__name__)
LAYOUT = "layout.json"
SEGMENT = np.dtype([("part", "<u4"), ("start", "<u8"), ("length", "<u8")])


def version_name(content: str, job: Job) -> str:
    key = [FORMAT, content, job.cfg.config_hash(), job.data["tokenizer"]["key"], TEXT_ENCODING]
    return "shards-" + hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]


def read_layout(job: Job) -> dict | None:
    path = job.dir / LAYOUT
    return fsio.read_json(path) if path.is_file() else None


def run_layout(job: Job, writers: int | None = None) -> dict:
    """Plan the shard set from the complete partitions (each named when it is missing or fails verification); an
    identical build that published the set meanwhile: its version, published (nothing left to write)."""
    published = lambda found: {"version": found.name, "published": True, "content_key": ""}  # noqa: E731
    return unless_published(job, lambda: _run_layout(job, writers), published)


def _run_layout(job: Job, writers: int | None) -> dict:
    with fsio.lock(job.dir, "layout"):
        if (found := read_layout(job)) is not None:
            return found
        layout = _layout(job, writers or len(job.partitions))
        fsio.write_json(job.dir / LAYOUT, layout)
        return layout


def _layout(job: Job, writers: int) -> dict:
    cfg = job.cfg
    parts = [load_partition(job, i) for i in range(len(job.partitions))]
    docs = [p.docs() for p in parts]
    counts = np.array([len(d) for d in docs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    every = np.concatenate(docs) if docs else np.empty(0, dtype=docs[0].dtype)
    keep = np.zeros(len(every), dtype=bool)
    if len(every):
        _, first = np.unique(every["hash"], return_index=True)  # each document's first occurrence
        keep[first] = True
    cut = None  # (partition, documents of it read) when data.max_documents ends the corpus inside it
    if cfg.max_documents and keep.sum() >= cfg.max_documents:
        last = int(np.flatnonzero(keep)[cfg.max_documents - 1])
        keep[last + 1 :] = False
        c = int(np.searchsorted(offsets, last, side="right") - 1)
        cut = (c, last - int(offsets[c]) + 1)
    ended = _ended(job, int(every["file"][last])) if cut else None
    used = len(parts) if cut is None else cut[0] + 1
    stats, digests, first_bad = _reading(parts, cut, every, keep, offsets)
    content = content_key(digests)
    version = version_name(content, job)
    if stats.documents_out == 0:
        raise _empty_corpus(len(job.files), stats)
    if intact(job.out_dir / version):  # the same contents were published (copied or touched)
        return {"version": version, "published": True, "content_key": content}
    if ended:
        log.info("%s", ended_line(ended))

    window = cfg.seq_len + 1
    dtype = np.dtype(job.data["tokenizer"]["dtype"])
    seed = int(cfg.config_hash()[:8], 16)
    splits, warnings, shards = {}, [], []
    for split in SPLITS:
        segments = _segments(parts[:used], every, keep, offsets, split)
        fsio.write_atomic(job.dir / f"segments-{split}.npy", _npy(segments))
        stream = int(segments["length"].sum())
        windows = stream // window
        if split == TRAIN and windows == 0:
            raise DataPrepError(
                f"seq_len {cfg.seq_len} is longer than the whole corpus: {stream} training "
                f"tokens make no window of {window}; lower data.seq_len or add documents"
            )
        plan = plan_shards(windows, cfg.seq_len, dtype, cfg.shard_size_mb, cfg.shard_multiple)
        if split == VAL and windows == 0:
            warnings.append(
                "val split is empty (data.val_fraction is 0): nothing is held out for validation or evaluation"
                if cfg.val_fraction == 0
                else f"val split is empty ({stream} tokens < one window of {window}): raise data.val_fraction "
                "or lower data.seq_len to hold out data for validation and evaluation"
            )
        if plan.warning:
            warnings.append(f"{split}: {plan.warning}")
        order = window_order(plan.used + plan.dropped, seed)[: plan.used]
        fsio.write_atomic(job.dir / f"order-{split}.npy", _npy(order))
        splits[split] = {
            "samples": plan.used,
            "tokens": plan.used * window,
            "token_stream": stream,
            "dropped_samples": plan.dropped,
            "num_shards": plan.num_shards,
            "per_shard": plan.per_shard,
        }
        shards += [(split, k) for k in range(plan.num_shards)]
    if stats.undecodable:
        what = "skipped" if cfg.on_decode_error == "skip" else "kept with U+FFFD for the invalid bytes"
        warnings.append(
            f"{stats.undecodable} document(s) are not valid UTF-8 (first in {first_bad}): {what} "
            f"(data.on_decode_error={cfg.on_decode_error}); convert the files to UTF-8 to keep their text"
        )
    warnings += skipped_warnings(stats)
    if stats.too_short and stats.too_short * 10 >= stats.documents_in:  # a few empty files are no news; most are
        warnings.append(
            f"{stats.too_short} of {stats.documents_in} document(s) shorter than data.min_chars ({cfg.min_chars}) "
            "skipped: not in the shard set; lower data.min_chars to keep them"
        )
    tok = job.data["tokenizer"]
    if tok.get("source") == "train" and tok["vocab_size"] < cfg.vocab_size:  # the model is sized to what was built
        warnings.append(
            f"the BPE has {tok['vocab_size']} tokens, fewer than data.vocab_size {cfg.vocab_size}: the corpus holds no "
            "more merges (the model's vocabulary is the smaller one); add text or lower data.vocab_size"
        )
    for w in warnings:
        log.warning("%s", w)
    warnings = job.data.get("input_warnings", []) + warnings  # logged when the inputs were resolved
    n = max(1, min(writers, len(shards)))
    bounds = np.linspace(0, len(shards), n + 1).astype(int)
    writes = [_ranges(shards[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return {
        "version": version,
        "published": False,
        "content_key": content,
        "seed": seed,
        "stats": stats.as_dict(),
        "warnings": warnings,
        "ended": ended,
        "splits": splits,
        "writes": writes,
    }


def _ended(job: Job, last_file: int) -> dict:
    """Where data.max_documents ended the corpus: its last kept document's file, and the input files after it
    (not read)."""
    return {
        "max_documents": job.cfg.max_documents,
        "last_file": job.files[last_file],
        "files_not_read": len(job.files) - last_file - 1,
    }


def ended_line(ended: dict) -> str:
    """The manifest's `source.ended`, said in one line (the CLI's and the shard stage's summary)."""
    return (
        f"data.max_documents={ended['max_documents']} ended the corpus at a document of {ended['last_file']}: what "
        f"follows it there and the {ended['files_not_read']} input file(s) after it were not read"
    )


def _reading(parts, cut, every, keep, offsets) -> tuple[CorpusStats, list[str], str | None]:
    """The counters, file hashes and first undecodable file of the corpus as a single reader read it."""
    names = list(CorpusStats().as_dict())
    totals = np.zeros(len(names), dtype=np.int64)
    digests, first_bad = [], None
    for p in parts if cut is None else parts[: cut[0] + 1]:
        record, bad = p.record, p.record["first_undecodable"]
        if cut is not None and p.index == cut[0]:
            totals += p.snapshots()[cut[1] - 1]
            last_file = int(every["file"][offsets[p.index] + cut[1] - 1])
            digests += record["digests"][: last_file - record["files"][0] + 1]
            bad = bad if bad and bad[1] < cut[1] else None
        else:
            totals += np.array([record["stats"][n] for n in names], dtype=np.int64)
            digests += record["digests"]
        first_bad = first_bad or (bad[0] if bad else None)
    stats = CorpusStats(**dict(zip(names, map(int, totals))))
    read = len(every) if cut is None else int(offsets[cut[0]]) + cut[1]
    across = read - int(keep[:read].sum())  # kept by their partition, but seen in an earlier one
    stats.duplicates += across
    stats.documents_out -= across
    return stats, digests, first_bad


def _segments(parts, every, keep, offsets, split: str) -> np.ndarray:
    """Runs of consecutive kept documents of `split` in each partition's token file: (partition, start, length)."""
    out = []
    for p in parts:
        docs = every[offsets[p.index] : offsets[p.index + 1]]
        mine = docs["val"] == (split == VAL)
        lengths = p.lengths[split].astype(np.int64)
        kept = keep[offsets[p.index] : offsets[p.index + 1]][mine]
        if len(lengths) != len(kept):
            raise DataPrepError(f"partition {p.index} failed verification: its {split} records disagree")
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
        edges = np.flatnonzero(np.diff(np.concatenate([[0], kept.astype(np.int8), [0]])))
        for a, b in zip(edges[::2], edges[1::2]):  # [a, b): one run of kept documents
            out.append((p.index, int(starts[a]), int(lengths[a:b].sum())))
    return np.array(out, dtype=SEGMENT)


def _ranges(shards: list[tuple[str, int]]) -> list[list]:
    """[(split, k), …] (consecutive per split) → [[split, first, end), …]."""
    out: list[list] = []
    for split, k in shards:
        if out and out[-1][0] == split and out[-1][2] == k:
            out[-1][2] = k + 1
        else:
            out.append([split, k, k + 1])
    return out


def _npy(array: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


_SKIPS = {  # counter → (what was skipped, the fix)
    "binary_files": (
        "file(s) skipped as binary (NUL bytes in the first 8 KiB; the log names each)",
        "convert them to UTF-8 if they are UTF-16/32 text, else remove them from data.inputs",
    ),
    "unreadable_files": (
        "file(s) skipped as unreadable (the log names each)",
        "repair them or remove them from data.inputs",
    ),
    "too_long": ("document(s) longer than data.max_chars skipped", "raise data.max_chars or split the files"),
    "bad_records": (  # a line that is no JSON object counts here too (corpus._jsonl_file)
        "record(s) that are not JSON objects with a string data.text_field skipped",
        "set data.text_field to the records' text key, or repair the lines that are not JSON",
    ),
}


def skipped_warnings(stats: CorpusStats) -> list[str]:
    """One line for each kind of input that was dropped whole (the manifest's warnings, the stage's status)."""
    return [
        f"{getattr(stats, k)} {what}: not in the shard set; {fix}"
        for k, (what, fix) in _SKIPS.items()
        if getattr(stats, k)
    ]


def _empty_corpus(files: int, stats: CorpusStats) -> DataPrepError:
    skipped = ", ".join(f"{k} {v}" for k, v in stats.as_dict().items() if v and k not in ("files", "documents_out"))
    fixes = {
        "too_short": "lower data.min_chars",
        "undecodable": "convert to UTF-8 or set data.on_decode_error=replace",
        **{k: fix for k, (_, fix) in _SKIPS.items()},
    }
    hint = "; ".join(dict.fromkeys(f for k, f in fixes.items() if getattr(stats, k)))
    return DataPrepError(
        f"empty corpus: no document kept from {files} input file(s) ({skipped or 'all empty'})"
        + (f"; {hint}" if hint else "")
    )


def discard(job: Job) -> None:
    shutil.rmtree(job.dir, ignore_errors=True)
