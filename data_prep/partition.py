"""The partition step: one partition's files → cleaned documents → token streams + document records.

`parts/NNNN/` holds, per split, `<split>.tokens` (the documents' ids, each followed by EOS, in corpus order) and
`<split>.lengths` (uint64 per document); `docs.bin` (per kept document in corpus order: its 16-byte content hash,
its split, the index of its file); with data.max_documents, `snap.bin` (the reading counters after each kept
document, so the layout can cut the corpus after exactly max_documents documents whatever the partitioning); and
`done.json` (counters, each file's sha256, the first file with invalid UTF-8). Written in `NNNN.partial/`, renamed
when complete: a partition is there whole or not at all, and a retry after a killed worker starts it afresh.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_prep import fsio
from data_prep.clean import SPLITS, VAL, cleaned
from data_prep.corpus import CorpusStats
from data_prep.errors import DataPrepError
from data_prep.job import Job, fault, unless_published

DONE = "done.json"
DOC = np.dtype([("hash", "V16"), ("val", "u1"), ("file", "<u4")])  # docs.bin records
BATCH_DOCS, BATCH_CHARS = 256, 256 << 10  # per encode call: big enough to amortise, small enough for an even tail


def run_partition(job: Job, index: int, threads: int = 1, progress: bool = False) -> dict:
    """Build partition `index` unless it is already complete (or an identical build published the set); its
    summary (what the DAG task returns)."""
    published = lambda found: {"partition": index, "published": str(found)}  # noqa: E731
    return unless_published(job, lambda: _run_partition(job, index, threads, progress), published)


def _run_partition(job: Job, index: int, threads: int, progress: bool) -> dict:
    if not 0 <= index < len(job.partitions):
        raise DataPrepError(f"partition {index} does not exist (the build has {len(job.partitions)})")
    final = job.part_dir(index)
    with fsio.lock(job.dir, f"part-{index:04d}"):
        if not (final / DONE).is_file():
            work = final.with_name(final.name + ".partial")
            fresh = not work.exists()
            shutil.rmtree(work, ignore_errors=True)  # a killed attempt's leftovers (we hold the lock: it is dead)
            fsio.make_dir(work)
            _tokenize(job, index, work, threads, progress, fresh)
            if not fsio.rename_dir(work, final):
                shutil.rmtree(work, ignore_errors=True)
    return load_partition(job, index).summary()


def _tokenize(job: Job, index: int, work: Path, threads: int, progress: bool, fresh: bool = False) -> None:
    from tokenizers import Tokenizer

    from data_prep.tokenizer import encode_stream

    cfg, tok_info = job.cfg, job.data["tokenizer"]
    a, b = job.partitions[index]
    files = [Path(f) for f in job.files[a:b]]
    dtype = np.dtype(tok_info["dtype"])
    tok = job.tokenizer or Tokenizer.from_file(str(job.set_dir / "tokenizer.json"))
    stats, digests, first_bad, kept = CorpusStats(), [], None, 0
    out = {name: fsio.create(work / name, buffering=1 << 20) for name in ("docs.bin", "snap.bin")}
    tokens = {s: fsio.create(work / f"{s}.tokens", buffering=1 << 20) for s in SPLITS}
    lengths = {s: fsio.create(work / f"{s}.lengths") for s in SPLITS}
    counts = {s: 0 for s in SPLITS}

    def batches():
        nonlocal first_bad, kept
        pending, chars = {s: [] for s in SPLITS}, {s: 0 for s in SPLITS}
        with tqdm(desc=f"partition {index}", unit="doc", disable=not progress, mininterval=2) as bar:
            for digest, split, text in cleaned(files, cfg, stats, digests):
                if first_bad is None and stats.first_undecodable:
                    first_bad = [stats.first_undecodable, kept]  # kept before it: the layout's cut decides
                out["docs.bin"].write(digest + bytes([split == VAL]) + (a + stats.files - 1).to_bytes(4, "little"))
                if cfg.max_documents:
                    out["snap.bin"].write(np.array(stats.counters(), dtype="<i8").tobytes())
                kept += 1
                pending[split].append(text)
                chars[split] += len(text)
                if len(pending[split]) >= BATCH_DOCS or chars[split] >= BATCH_CHARS:
                    bar.update(len(pending[split]))
                    yield split, pending[split]
                    pending[split], chars[split] = [], 0
            for split in SPLITS:
                if pending[split]:
                    bar.update(len(pending[split]))
                    yield split, pending[split]

    try:
        for split, ids, lens in encode_stream(tok, tok_info["eos_id"], dtype, batches(), threads):
            tokens[split].write(ids.tobytes())
            lengths[split].write(lens.astype("<u8").tobytes())
            counts[split] += len(ids)
            if fresh:
                tokens[split].flush()
                fault("partition", index)
        if first_bad is None and stats.first_undecodable:
            first_bad = [stats.first_undecodable, kept]
    finally:
        for f in (*out.values(), *tokens.values(), *lengths.values()):
            f.flush()
            os.fsync(f.fileno())
            f.close()
    record = {
        "index": index,
        "files": [a, b],
        "documents": kept,
        "tokens": counts,
        "stats": stats.as_dict(),
        "digests": digests,
        "first_undecodable": first_bad,
    }
    fsio.write_json(work / DONE, record)  # last: the partition is complete


class Partition:
    """A complete partition, checked: its files are there and their sizes agree with its record."""

    def __init__(self, job: Job, index: int):
        self.dir, self.index = job.part_dir(index), index
        try:
            self.record = fsio.read_json(self.dir / DONE)
        except (OSError, ValueError):
            raise DataPrepError(f"partition {index} ({job.dir}) is not complete: its task has not finished") from None
        self.dtype = np.dtype(job.data["tokenizer"]["dtype"])
        docs = self.record["documents"]
        expect = {"docs.bin": docs * DOC.itemsize, "snap.bin": docs * 8 * len(CorpusStats().counters())}
        if not job.cfg.max_documents:
            expect["snap.bin"] = 0
        for s in SPLITS:
            expect[f"{s}.tokens"] = self.record["tokens"][s] * self.dtype.itemsize
        for name, size in expect.items():
            have = (self.dir / name).stat().st_size if (self.dir / name).is_file() else None
            if have != size:
                shutil.rmtree(self.dir, ignore_errors=True)  # never trusted again: a rerun rebuilds it
                raise DataPrepError(
                    f"partition {index} failed verification: {name} is {have} bytes, its record says {size} "
                    "(altered or truncated after it was written); removed, rerun the build to redo it"
                )
        lengths = {s: np.fromfile(self.dir / f"{s}.lengths", dtype="<u8") for s in SPLITS}
        if any(int(lengths[s].sum()) != self.record["tokens"][s] for s in SPLITS):
            shutil.rmtree(self.dir, ignore_errors=True)
            raise DataPrepError(
                f"partition {index} failed verification: its document lengths do not add up to its token "
                "counts; removed, rerun the build to redo it"
            )
        self.lengths = lengths

    def docs(self) -> np.ndarray:
        return np.fromfile(self.dir / "docs.bin", dtype=DOC)

    def snapshots(self) -> np.ndarray:
        return np.fromfile(self.dir / "snap.bin", dtype="<i8").reshape(self.record["documents"], -1)

    def token_path(self, split: str) -> Path:
        return self.dir / f"{split}.tokens"

    def summary(self) -> dict:
        r = self.record
        return {"partition": self.index, "files": r["files"], "documents": r["documents"], "tokens": r["tokens"]}


def load_partition(job: Job, index: int) -> Partition:
    return Partition(job, index)
