"""Packing: token stream → fixed windows of seq_len + 1 tokens, and the plan that cuts windows into shards.

Each split's token stream goes to flat binary files first (the partitions', streamed, constant memory); only then is
the number of windows known, which is what lets the shard count be planned as a multiple of (ranks × loader
workers) with every shard holding exactly the same number of samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TAR_BLOCK = 512
NPY_HEADER = 128  # numpy .npy v1 header for a 1-D array, padded to 128 bytes


def sample_bytes(seq_len: int, dtype: np.dtype) -> int:
    """Bytes one sample takes in a tar shard: a header block plus the .npy payload padded to whole blocks."""
    payload = NPY_HEADER + (seq_len + 1) * np.dtype(dtype).itemsize
    return TAR_BLOCK + math.ceil(payload / TAR_BLOCK) * TAR_BLOCK


@dataclass
class ShardPlan:
    num_shards: int
    per_shard: int  # samples in every shard (all equal)
    dropped: int  # windows left out so that every shard is equal (< num_shards)
    warning: str = ""

    @property
    def used(self) -> int:
        return self.num_shards * self.per_shard


def plan_shards(windows: int, seq_len: int, dtype: np.dtype, shard_size_mb: float, multiple: int) -> ShardPlan:
    """Shard count: enough for the size target, rounded up to a multiple of `multiple`, each shard ≥ 1 sample."""
    if windows == 0:
        return ShardPlan(0, 0, 0)
    wanted = max(1, math.ceil(windows * sample_bytes(seq_len, dtype) / (shard_size_mb * 1e6)))
    shards = math.ceil(wanted / multiple) * multiple
    if shards > windows:  # too few samples for one per shard in every slot: the largest multiple that fits
        shards = windows // multiple * multiple or windows
    warning = ""
    if shards % multiple:
        warning = (
            f"{shards} shards is not a multiple of {multiple} (ranks × loader workers): only {windows} "
            f"samples; some ranks/workers will read more shards than others"
        )
    per_shard = windows // shards
    dropped = windows - shards * per_shard
    if dropped * 20 > windows:  # < one per shard, but with ~1 sample a shard that is up to half the data
        warning = (warning + "; " if warning else "") + (
            f"{dropped} of {windows} windows ({100 * dropped / windows:.0f} %) left out so that every one of "
            f"{shards} shards holds {per_shard}; raise data.shard_size_mb (a shard holds "
            f"{shard_size_mb * 1e6 / sample_bytes(seq_len, dtype):.1f} samples of {seq_len + 1} tokens)"
        )
    return ShardPlan(shards, per_shard, dropped, warning)


def window_order(windows: int, seed: int) -> np.ndarray:
    """A seeded permutation of window indices: shards get a mix of the whole corpus, not one stretch of it."""
    return np.random.default_rng(seed).permutation(windows)
