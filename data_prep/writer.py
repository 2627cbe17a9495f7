"""The write step: one range of the shard plan → WebDataset tars, each fsynced under a temporary name and renamed.

Reproducible: the tar headers carry a fixed mtime/owner/mode, the sample order is the layout's seeded order and
the .npy header is fixed, so the same input gives byte-identical shards. A range's record (`writes/NNNN.json`:
each shard's samples, bytes, sha256 and the crc32 of its samples, all computed as the bytes were written) is
written last; a retry of a killed range rewrites the shards it had not recorded.
"""

from __future__ import annotations

import bisect
import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from data_prep import fsio
from data_prep.errors import DataPrepError
from data_prep.job import Job, fault, unless_published
from data_prep.layout import read_layout
from data_prep.partition import load_partition
from data_prep.tarfast import TarSamples

SHARD_PATTERN = "{split}-%06d.tar"
KEY_WIDTH = 10  # sample keys: the window's index, zero-padded


def shard_name(split: str, k: int) -> str:
    return SHARD_PATTERN.format(split=split) % k


def npy_header(seq_len: int, dtype: np.dtype) -> bytes:
    """The .npy v1 header of one sample; computed once, prepended to raw bytes (np.save per sample is slow)."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (seq_len + 1,)}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


class Windows:
    """Window w of a split's token stream (tokens [w·W, (w+1)·W)), read with pread from the partitions' token files
    through the layout's segments (page cache, not mmap: random access must not grow the RSS)."""

    def __init__(self, job: Job, split: str, window: int, dtype: np.dtype):
        segments = np.load(job.dir / f"segments-{split}.npy")
        self.parts, self.offsets = segments["part"].tolist(), segments["start"].tolist()
        self.starts = np.concatenate([[0], np.cumsum(segments["length"].astype(np.int64))]).tolist()
        self.window, self.itemsize = window, np.dtype(dtype).itemsize
        self.fds = {p: os.open(load_partition(job, p).token_path(split), os.O_RDONLY) for p in set(self.parts)}

    def read(self, w: int) -> bytes:
        pos, end = w * self.window, (w + 1) * self.window
        i = bisect.bisect_right(self.starts, pos) - 1
        if end <= self.starts[i + 1]:  # the usual case: inside one run of documents
            offset = (self.offsets[i] + pos - self.starts[i]) * self.itemsize
            data = os.pread(self.fds[self.parts[i]], self.window * self.itemsize, offset)
        else:
            out = []
            while pos < end:
                take = min(end, self.starts[i + 1]) - pos
                offset = (self.offsets[i] + pos - self.starts[i]) * self.itemsize
                out.append(os.pread(self.fds[self.parts[i]], take * self.itemsize, offset))
                pos, i = pos + take, i + 1
            data = b"".join(out)
        if len(data) != self.window * self.itemsize:
            raise DataPrepError(f"window {w} reads short: a partition's token file was truncated; rerun the build")
        return data

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def run_write(job: Job, index: int) -> dict:
    """Write range `index` of the layout unless its record says it is done (or an identical build published the
    set); its summary (the DAG task's XCom)."""
    published = lambda found: {"write": index, "shards": 0, "samples": 0, "published": str(found)}  # noqa: E731
    return unless_published(job, lambda: _run_write(job, index), published)


def _run_write(job: Job, index: int) -> dict:
    layout = read_layout(job)
    if layout is None:
        raise DataPrepError(f"{job.dir}: no layout yet (the layout step has not run)")
    if not 0 <= index < len(layout["writes"]):
        raise DataPrepError(f"write range {index} does not exist (the layout has {len(layout['writes'])})")
    record = job.dir / "writes" / f"{index:04d}.json"
    with fsio.lock(job.dir, f"write-{index:04d}"):
        if not record.is_file():
            entries = []
            for split, first, end in layout["writes"][index]:
                entries += _write_shards(job, layout, split, first, end, index)
            fsio.make_dir(record.parent)
            fsio.write_json(record, {"index": index, "shards": entries})
    shards = fsio.read_json(record)["shards"]
    return {"write": index, "shards": len(shards), "samples": sum(e["samples"] for e in shards)}


def _write_shards(job: Job, layout: dict, split: str, first: int, end: int, index: int) -> list[dict]:
    cfg, tok = job.cfg, job.data["tokenizer"]
    dtype, per = np.dtype(tok["dtype"]), layout["splits"][split]["per_shard"]
    header = npy_header(cfg.seq_len, dtype)
    order = np.load(job.dir / f"order-{split}.npy", mmap_mode="r")
    windows = Windows(job, split, cfg.seq_len + 1, dtype)
    size = len(header) + (cfg.seq_len + 1) * dtype.itemsize
    entries, syncs, synced = [], ThreadPoolExecutor(1, thread_name_prefix="fsync"), []  # fsync overlaps the next
    try:
        for k in range(first, end):
            name = shard_name(split, k)
            final, partial = job.set_dir / name, job.set_dir / f".{name}.partial"
            fresh = k == first and not partial.exists() and not final.exists()
            f = fsio.create(partial, buffering=0)
            try:
                tar = TarSamples(f, "tokens.npy", size, KEY_WIDTH)
                for w in order[k * per : (k + 1) * per].tolist():
                    tar.write(f"{w:0{KEY_WIDTH}d}", header + windows.read(w))
                    if fresh:  # tests: killed with part of a shard on disk
                        tar.flush()
                        fault("write", index)
                        fresh = False
                tar.close()
            except BaseException:
                f.close()
                raise
            synced.append(syncs.submit(_sync_and_rename, f, partial, final))
            entries.append(
                {
                    "name": name,
                    "samples": tar.samples,
                    "tokens": tar.samples * (cfg.seq_len + 1),
                    "bytes": tar.offset,
                    "sha256": tar.sha256.hexdigest(),
                    "samples_crc32": tar.crc32,
                }
            )
    finally:
        syncs.shutdown(wait=True)
        windows.close()
    for done in synced:
        done.result()  # an fsync's error (a full disk) is this step's
    return entries


def _sync_and_rename(f, partial: Path, final: Path) -> None:
    try:
        os.fsync(f.fileno())
    finally:
        f.close()
    os.replace(partial, final)


def drop_write(job: Job, index: int) -> None:
    """Forget range `index` (its record and shards): a rerun writes it again."""
    record = job.dir / "writes" / f"{index:04d}.json"
    try:
        shards = fsio.read_json(record)["shards"]
    except (OSError, ValueError):
        shards = []
    record.unlink(missing_ok=True)
    for e in shards:
        (job.set_dir / e["name"]).unlink(missing_ok=True)
