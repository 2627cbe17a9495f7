"""The write step: one range of the shard plan → WebDataset tars, each fsynced under a temporary name and renamed.

Reproducible: the tar headers carry a fixed mtime/owner/mode, the sample order is the layout's seeded order and
the .npy header is fixed, so the same input gives byte-identical shards. A range's record (`writes/NNNN.json`:
each shard's samples, bytes, sha256 and the crc32 of its samples, all computed as the bytes were written) is
written last; a retry of a killed range rewrites the shards it had not recorded.
"""

from __future__ import annotations

import io
import os

import numpy as np

from data_prep import fsio
from data_prep.errors import DataPrepError
from data_prep.job import Job, fault
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
        self.segments = np.load(job.dir / f"segments-{split}.npy")
        self.starts = np.concatenate([[0], np.cumsum(self.segments["length"].astype(np.int64))])
        self.window, self.itemsize = window, np.dtype(dtype).itemsize
        self.fds = {
            int(p): os.open(load_partition(job, int(p)).token_path(split), os.O_RDONLY)
            for p in np.unique(self.segments["part"])
        }

    def read(self, w: int) -> bytes:
        pos, end, out = w * self.window, (w + 1) * self.window, []
        i = int(np.searchsorted(self.starts, pos, side="right")) - 1
        while pos < end:
            seg = self.segments[i]
            take = min(end, int(self.starts[i + 1])) - pos
            offset = (int(seg["start"]) + pos - int(self.starts[i])) * self.itemsize
            out.append(os.pread(self.fds[int(seg["part"])], take * self.itemsize, offset))
            pos, i = pos + take, i + 1
        data = b"".join(out) if len(out) > 1 else out[0]
        if len(data) != self.window * self.itemsize:
            raise DataPrepError(f"window {w} reads short: a partition's token file was truncated; rerun the build")
        return data

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def run_write(job: Job, index: int) -> dict:
    """Write range `index` of the layout unless its record says it is done; its summary (the DAG task's XCom)."""
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
    entries = []
    try:
        for k in range(first, end):
            name = shard_name(split, k)
            final, partial = job.set_dir / name, job.set_dir / f".{name}.partial"
            fresh = k == first and not partial.exists() and not final.exists()
            with fsio.create(partial, buffering=0) as f:
                tar = TarSamples(f, "tokens.npy", size, KEY_WIDTH)
                for w in order[k * per : (k + 1) * per]:
                    tar.write(f"{int(w):0{KEY_WIDTH}d}", header + windows.read(int(w)))
                    if fresh:  # tests: killed with part of a shard on disk
                        tar.flush()
                        fault("write", index)
                        fresh = False
                tar.close()
                os.fsync(f.fileno())
            os.replace(partial, final)
            entries.append(
                {
                    "name": name,
                    "samples": per,
                    "tokens": per * (cfg.seq_len + 1),
                    "bytes": tar.offset,
                    "sha256": tar.sha256.hexdigest(),
                    "samples_crc32": tar.crc32,
                }
            )
    finally:
        windows.close()
    return entries


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
