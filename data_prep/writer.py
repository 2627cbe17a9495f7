"""Shard writing: reproducible WebDataset tars in a temp directory, fsynced, then published with one rename.

Reproducible: fixed mtime/owner/mode in every tar header, a seeded sample order and a fixed .npy header, so the same
input gives byte-identical shards. Crash-safe: nothing appears under the version directory's name until the
rename; a killed writer leaves only `.tmp-<version>-<pid>`, removed by the next run (under the output directory's lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import multiprocessing as mp
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import webdataset as wds

from data_prep.errors import DataPrepError
from data_prep.pack import ShardPlan, read_window, window_order
from data_prep.workers import die_with_parent

SHARD_PATTERN = "{split}-%06d.tar"


def npy_header(seq_len: int, dtype: np.dtype) -> bytes:
    """The .npy v1 header of one sample; computed once, prepended to raw bytes (np.save per sample is slow)."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (seq_len + 1,)}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_shards(
    tmp_dir: Path, split: str, token_path: Path, per_shard: int, seq_len: int, dtype: str, first: int, order: np.ndarray
) -> list[dict]:
    """Shards first, first + 1, … holding the windows `order` (per_shard each); their manifest entries."""
    dtype = np.dtype(dtype)
    header = npy_header(seq_len, dtype)
    names: list[str] = []
    fd = os.open(token_path, os.O_RDONLY)
    try:
        with wds.ShardWriter(
            str(tmp_dir / SHARD_PATTERN.format(split=split)),
            maxcount=per_shard,
            maxsize=float("inf"),
            start_shard=first,
            verbose=0,
            post=names.append,
            mtime=0,
            user="llm",
            group="llm",
            mode=0o444,
        ) as sink:
            for index in order:
                window = read_window(fd, int(index), seq_len, dtype)
                sink.write({"__key__": f"{index:010d}", "tokens.npy": header + window.tobytes()})
    finally:
        os.close(fd)
    return [
        {
            "name": Path(n).name,
            "samples": per_shard,
            "tokens": per_shard * (seq_len + 1),
            "bytes": os.path.getsize(n),
            "sha256": sha256_file(Path(n)),
        }
        for n in names
    ]


def write_split(
    tmp_dir: Path,
    split: str,
    token_path: Path,
    plan: ShardPlan,
    seq_len: int,
    dtype: np.dtype,
    seed: int,
    processes: int = 1,
) -> list[dict]:
    """Write `plan.used` windows of a token file, in a seeded order, as `<split>-%06d.tar`; return shard entries.

    Tar writing is Python-bound (~0.1 ms a sample), so contiguous ranges of shards go to `processes` forked
    workers. Fork, not spawn: the children need the already-imported webdataset (importing it imports torch, seconds)
    and touch nothing but numpy, tarfile and hashlib, so threads the parent may hold cannot deadlock them.
    """
    if plan.num_shards == 0:
        return []
    order = window_order(plan.used + plan.dropped, seed)[: plan.used]
    bounds = np.linspace(0, plan.num_shards, min(processes, plan.num_shards) + 1).astype(int)
    tasks = [
        (
            tmp_dir,
            split,
            token_path,
            plan.per_shard,
            seq_len,
            np.dtype(dtype).str,
            int(a),
            order[a * plan.per_shard : b * plan.per_shard],
        )
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    if len(tasks) == 1:
        return _write_shards(*tasks[0])
    with ProcessPoolExecutor(
        len(tasks), mp_context=mp.get_context("fork"), initializer=die_with_parent, initargs=(os.getpid(),)
    ) as pool:
        parts = [pool.submit(_write_shards, *task) for task in tasks]
        return [entry for part in parts for entry in part.result()]


def ensure_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise DataPrepError(f"output directory {directory} is not writable ({e.strerror or e})") from None


@contextlib.contextmanager
def out_dir_lock(out_dir: Path):
    """One writer per output root at a time (two DAG runs racing on one corpus build it once). The lock is on
    the directory itself, so no lock file is left beside the shard sets."""
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def fresh_tmp_dir(out_dir: Path, version: str) -> Path:
    """Remove what killed writers left (we hold the lock: no live writer owns one), then make our own temp dir."""
    for stale in out_dir.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir / f".tmp-{version}-{os.getpid()}"
    tmp.mkdir()
    return tmp


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """fsync every file and the directory, then rename into place (atomic on one filesystem)."""
    for p in tmp_dir.iterdir():
        _fsync(p)
    _fsync(tmp_dir)
    os.rename(tmp_dir, final_dir)
    _fsync(final_dir.parent)
