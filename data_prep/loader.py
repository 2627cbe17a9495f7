"""ShardLoader: the training/eval reader of a shard set (a webdataset pipeline inside a torch DataLoader).

One global sample order per epoch, the same for every layout: the shards in a (seed, epoch) permutation, and
inside each shard its samples in a (seed, epoch, shard index) permutation (the writer already spread the corpus over
the shards at random). Step k's global batch is positions [k·G, (k+1)·G) of that order, G = batch_size × dp_world,
and data-parallel rank r takes the contiguous slice [k·G + r·batch_size, k·G + (r+1)·batch_size) — as Megatron's
pretraining sampler does. So a dp1, dp2 or dp4 run trains on the same samples at every step, tensor/pipeline ranks
of one replica pass the same dp_rank and read the same batches, and every sample is read at most once per epoch (the
last partial global batch waits for the next epoch's order). A rank reads (but does not decode) every shard that
holds one of its slices — with shards larger than G, all of them: the price of a layout-free order.

The position is (epoch, global samples consumed): it means the same on any layout, so a checkpoint resumes on
another dp degree or worker count; whole shards before it are skipped by their manifest counts without being read.
DataLoader worker i of a rank yields the rank's batches i, i + num_workers, … after the resume point; DataLoader's
round robin over workers puts them back in order. Every rank yields the same number of batches per epoch.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_prep.errors import CorruptShardError, DataPrepError
from data_prep.manifest import check_files, load_manifest, shards

_NPY_MAGIC = b"\x93NUMPY"
ORDER = "global/1"  # the state_dict's position format: global samples consumed in the epoch


class _EpochStream(IterableDataset):
    """The rest of one epoch for one rank: its batch j (counted from `start`) is global positions
    start + j·global_batch + offset … + batch_size; DataLoader worker i yields batches i, i + num_workers, …"""

    def __init__(self, shard_dir, entries, order, start, n_batches, global_batch, offset, epoch, seed, shuffle,
                 batch_size, dtype, seq_len, with_keys):
        self.shard_dir, self.entries, self.order, self.start = Path(shard_dir), entries, order, start
        self.n_batches, self.global_batch, self.offset = n_batches, global_batch, offset
        self.epoch, self.seed, self.shuffle, self.batch_size = epoch, seed, shuffle, batch_size
        self.dtype, self.sample_tokens, self.with_keys = np.dtype(dtype), seq_len + 1, with_keys

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        # The first global position of each of this worker's batches, ascending; each covers batch_size positions.
        self._firsts = [self.start + j * self.global_batch + self.offset
                        for j in range(worker, self.n_batches, workers)]
        self._base, needed, pos, k = {}, [], 0, 0
        for index in self.order:  # the shards that hold one of those positions (others are not even opened)
            n = self.entries[index]["samples"]
            while k < len(self._firsts) and self._firsts[k] + self.batch_size <= pos:
                k += 1
            if k < len(self._firsts) and self._firsts[k] < pos + n:
                needed.append(index)
                self._base[index] = pos
            pos += n
        if not needed:
            return iter(())
        self._index = {str(self.shard_dir / self.entries[i]["name"]): i for i in needed}
        pipeline = wds.DataPipeline(
            wds.SimpleShardList(list(self._index)),
            wds.tarfile_to_samples(handler=self._corrupt),
            self._select,
            wds.map(self._decode),
            wds.batched(self.batch_size, collation_fn=self._collate, partial=False),
        )
        return iter(pipeline)

    def _corrupt(self, exn: Exception) -> bool:
        text = " ".join(map(str, exn.args))
        name = next((u for u in self._index if Path(u).name in text), "of this worker")
        raise CorruptShardError(f"shard {name} is corrupt or truncated: {type(exn).__name__}: "
                                f"{str(exn.args[0]) if exn.args else exn}") from None

    def _select(self, samples):
        """Tar samples arrive shard after shard: permute each shard, keep the samples at this worker's positions."""
        group, url, state = [], None, {"k": 0}
        for sample in samples:
            if sample["__url__"] != url and group:
                yield from self._emit(url, group, state)
                group = []
            url = sample["__url__"]
            group.append(sample)
        if group:
            yield from self._emit(url, group, state)

    def _emit(self, url: str, group: list, state: dict):
        index = self._index[url]
        if len(group) != self.entries[index]["samples"]:
            raise CorruptShardError(f"shard {url} is corrupt or truncated: only {len(group)} of "
                                    f"{self.entries[index]['samples']} samples readable")
        order = (np.random.default_rng([self.seed, self.epoch, index]).permutation(len(group)) if self.shuffle
                 else range(len(group)))
        firsts, k = self._firsts, state["k"]
        for pos, i in enumerate(order, start=self._base[index]):
            while k < len(firsts) and pos >= firsts[k] + self.batch_size:
                k += 1
            if k == len(firsts):
                break
            if pos >= firsts[k]:
                yield group[i]
        state["k"] = k

    def _decode(self, sample: dict):
        data = sample.get("tokens.npy", b"")
        ok = data[:6] == _NPY_MAGIC
        offset = 10 + int.from_bytes(data[8:10], "little") if ok else 0
        row = np.frombuffer(data, dtype=self.dtype, offset=offset) if ok else None
        if row is None or len(row) != self.sample_tokens:
            raise CorruptShardError(f"shard {sample['__url__']}: sample {sample['__key__']} is not "
                                    f"{self.sample_tokens} {self.dtype.name} tokens")
        return row, sample["__key__"]

    def _collate(self, rows):
        tokens = torch.from_numpy(np.stack([r for r, _ in rows]).astype(np.int64))
        batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        return batch + ([k for _, k in rows],) if self.with_keys else batch


class ShardLoader:
    """Iterate a split of a shard set as (inputs, targets) LongTensors [batch_size, seq_len], one epoch per loop.

    `len(loader)` is the batches per epoch (equal on every dp rank). `state_dict()` after any batch, then
    `load_state_dict()` on a fresh loader — of any dp_world, batch_size or num_workers — continues the global stream
    exactly; an epoch that completes advances `epoch`. `batches()` loops over epochs forever. `with_keys=True` adds
    each sample's key (its window index) per batch.
    """

    def __init__(self, shard_dir, split: str = "train", batch_size: int = 8, dp_rank: int = 0, dp_world: int = 1,
                 num_workers: int = 0, seed: int = 0, shuffle: bool = True, verify_sha256: bool = False,
                 with_keys: bool = False, pin_memory: bool = False, prefetch_factor: int | None = None):
        if not (0 <= dp_rank < dp_world) or batch_size < 1 or num_workers < 0:
            raise DataPrepError(f"ShardLoader: need 0 <= dp_rank ({dp_rank}) < dp_world ({dp_world}), "
                                f"batch_size ({batch_size}) >= 1, num_workers ({num_workers}) >= 0")
        self.shard_dir, self.split = Path(shard_dir), split
        self.manifest = load_manifest(shard_dir)
        self.entries = shards(self.manifest, split)
        check_files(shard_dir, self.manifest, split, sha256=verify_sha256)
        self.seq_len, self.vocab_size = self.manifest["seq_len"], self.manifest["vocab_size"]
        self.batch_size, self.dp_rank, self.dp_world = batch_size, dp_rank, dp_world
        self.num_workers, self.seed, self.shuffle = num_workers, seed, shuffle
        self.with_keys, self.pin_memory = with_keys, pin_memory
        self.prefetch_factor = prefetch_factor if num_workers > 0 else None  # torch: only with worker processes
        self.epoch, self.samples = 0, 0
        self.total = sum(e["samples"] for e in self.entries)
        if len(self) == 0:
            raise DataPrepError(f"split {split!r} of {self.manifest['version']} has {len(self.entries)} shard(s) and "
                                f"{self.total} samples: not one batch of {batch_size} for each of {dp_world} rank(s)")

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp_world

    def _order(self, epoch: int) -> list[int]:
        """Manifest indices of the shards in this epoch's order."""
        n = len(self.entries)
        return [int(i) for i in (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                                 else range(n))]

    def __len__(self) -> int:
        return self.total // self.global_batch

    def __iter__(self):
        epoch, start = self.epoch, self.samples
        limit = (self.total - start) // self.global_batch  # batches left in this epoch from the position
        if limit <= 0:  # a position saved at the very end of an epoch
            self.epoch, self.samples = epoch + 1, 0
            return
        stream = _EpochStream(self.shard_dir, self.entries, self._order(epoch), start, limit, self.global_batch,
                              self.dp_rank * self.batch_size, epoch, self.seed, self.shuffle, self.batch_size,
                              self.manifest["dtype"], self.seq_len, self.with_keys)
        batches = iter(DataLoader(stream, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                                  prefetch_factor=self.prefetch_factor))
        done = 0
        try:
            for batch in batches:
                done += 1
                # The position moves before the yield: a checkpoint taken after this batch resumes after it.
                self.epoch, self.samples = ((epoch + 1, 0) if done >= limit else
                                            (epoch, start + done * self.global_batch))
                yield batch
                if done >= limit:
                    return
        except CorruptShardError as e:  # from a worker it arrives wrapped in its traceback: keep the cause
            raise CorruptShardError(str(e).rsplit("CorruptShardError: ", 1)[-1]) from None
        finally:
            # Stop the workers now (error, or the consumer stopped mid-epoch). Left to garbage collection, a
            # traceback that keeps this frame alive delays it, and then each worker's join times out (5 s).
            if hasattr(batches, "_shutdown_workers"):
                batches._shutdown_workers()
        raise CorruptShardError(f"{self.shard_dir}: {self.split} gave {done} batches, manifest promises {limit}")

    def batches(self):
        """Endless stream over epochs (training by steps)."""
        while True:
            yield from self

    def state_dict(self) -> dict:
        """The position in the global order (epoch, samples consumed by all ranks), valid for any layout; the
        batch size, dp_world and num_workers are recorded for information only."""
        return {"order": ORDER, "epoch": self.epoch, "samples": self.samples, "seed": self.seed,
                "shuffle": self.shuffle, "version": self.manifest["version"], "batch_size": self.batch_size,
                "dp_world": self.dp_world, "num_workers": self.num_workers}

    def load_state_dict(self, state: dict) -> None:
        if state.get("order") != ORDER:
            raise DataPrepError("cannot resume the data stream: the saved position is per rank (written before the "
                                "layout-independent sample order); the data stream restarts")
        mine = self.state_dict()
        for key in ("version", "seed", "shuffle"):
            if state.get(key) != mine[key]:
                raise DataPrepError(f"cannot resume the data stream: {key} was {state.get(key)!r}, now {mine[key]!r}")
        self.epoch, self.samples = int(state["epoch"]), int(state["samples"])
