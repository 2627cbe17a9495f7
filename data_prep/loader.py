"""ShardLoader: the training/eval reader of a shard set (a webdataset pipeline inside a torch DataLoader).

Per epoch, the shard list is permuted with (seed, epoch) and dealt out: data-parallel rank r takes every
dp_world-th shard, and DataLoader worker w of that rank every num_workers-th of those, so each sample is read
exactly once per epoch across ranks × workers. Tensor/pipeline-parallel ranks of one replica pass the same dp_rank
and read the same batches. Inside a shard, samples are permuted with (seed, epoch, shard index) — the writer
already spread the corpus over the shards at random — so the order is reproducible and a position is just
(epoch, samples consumed): resuming skips whole shards by their manifest counts, without reading them, and yields
exactly the batches an uninterrupted run would have yielded next. Every rank yields the same number of batches
per epoch (the smallest over ranks), so no rank waits on a collective the others never reach.
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


def delivered_per_worker(counts: list[int], k: int) -> tuple[list[int], int]:
    """How many batches each worker had delivered after k batches of DataLoader's round-robin, and which worker
    comes next. DataLoader takes batches from workers 0, 1, … in turn, skipping exhausted ones."""
    done = [0] * len(counts)
    for r in range(max(counts, default=0)):
        active = [w for w, c in enumerate(counts) if c > r]
        if k < len(active):
            for w in active[:k]:
                done[w] += 1
            return done, active[k]
        for w in active:
            done[w] += 1
        k -= len(active)
    return done, 0


class _EpochStream(IterableDataset):
    """One epoch of one rank: worker j of the DataLoader plays logical worker (first + j) % num_workers."""

    def __init__(self, shard_dir, entries, slots, skips, first, epoch, seed, shuffle, batch_size, dtype, seq_len,
                 with_keys):
        self.shard_dir, self.entries, self.slots, self.skips, self.first = Path(shard_dir), entries, slots, skips, first
        self.epoch, self.seed, self.shuffle, self.batch_size = epoch, seed, shuffle, batch_size
        self.dtype, self.sample_tokens, self.with_keys = np.dtype(dtype), seq_len + 1, with_keys

    def __iter__(self):
        info = get_worker_info()
        logical = (self.first + (info.id if info else 0)) % len(self.slots)
        todo, skip = list(self.slots[logical]), self.skips[logical] * self.batch_size
        while todo and skip >= self.entries[todo[0]]["samples"]:  # whole shards already consumed: not even opened
            skip -= self.entries[todo.pop(0)]["samples"]
        if not todo:
            return iter(())
        self._index = {str(self.shard_dir / self.entries[i]["name"]): i for i in todo}
        pipeline = wds.DataPipeline(
            wds.SimpleShardList(list(self._index)),
            wds.tarfile_to_samples(handler=self._corrupt),
            lambda samples: self._permute_within_shards(samples, skip),
            wds.map(self._decode),
            wds.batched(self.batch_size, collation_fn=self._collate, partial=False),
        )
        return iter(pipeline)

    def _corrupt(self, exn: Exception) -> bool:
        text = " ".join(map(str, exn.args))
        name = next((u for u in self._index if Path(u).name in text), "of this worker")
        raise CorruptShardError(f"shard {name} is corrupt or truncated: {type(exn).__name__}: "
                                f"{str(exn.args[0]) if exn.args else exn}") from None

    def _permute_within_shards(self, samples, skip: int):
        group, url = [], None
        for sample in samples:  # tar samples arrive shard after shard
            if sample["__url__"] != url and group:
                yield from self._emit(url, group, skip)
                group, skip = [], 0
            url = sample["__url__"]
            group.append(sample)
        if group:
            yield from self._emit(url, group, skip)

    def _emit(self, url: str, group: list, skip: int):
        index = self._index[url]
        if len(group) != self.entries[index]["samples"]:
            raise CorruptShardError(f"shard {url} is corrupt or truncated: only {len(group)} of "
                                    f"{self.entries[index]['samples']} samples readable")
        order = (np.random.default_rng([self.seed, self.epoch, index]).permutation(len(group)) if self.shuffle
                 else range(len(group)))
        for i in list(order)[skip:]:
            yield group[i]

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
    `load_state_dict()` on a fresh loader, continues the stream exactly; an epoch that completes advances `epoch`.
    `batches()` loops over epochs forever. `with_keys=True` adds each sample's key (its window index) per batch.
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
        if len(self) == 0:
            raise DataPrepError(f"split {split!r} of {self.manifest['version']} has {len(self.entries)} shard(s) and "
                                f"{self.manifest['splits'][split]['samples']} samples: not one batch of {batch_size} "
                                f"for each of {dp_world} rank(s) × {max(1, num_workers)} worker(s)")

    def _slots(self, epoch: int) -> list[list[list[int]]]:
        """[rank][worker] → manifest indices of the shards it reads this epoch."""
        n = len(self.entries)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        workers = max(1, self.num_workers)
        return [[[int(i) for i in order[r::self.dp_world][w::workers]] for w in range(workers)]
                for r in range(self.dp_world)]

    def _counts(self, slots) -> list[list[int]]:
        return [[sum(self.entries[i]["samples"] for i in slot) // self.batch_size for slot in rank] for rank in slots]

    def __len__(self) -> int:
        return min(sum(rank) for rank in self._counts(self._slots(self.epoch)))

    def __iter__(self):
        epoch, slots = self.epoch, self._slots(self.epoch)
        counts = self._counts(slots)
        limit = min(sum(rank) for rank in counts)
        done = self.samples // self.batch_size
        if done >= limit:  # a position saved at the very end of an epoch
            self.epoch, self.samples = epoch + 1, 0
            return
        skips, first = delivered_per_worker(counts[self.dp_rank], done)
        stream = _EpochStream(self.shard_dir, self.entries, slots[self.dp_rank], skips, first, epoch, self.seed,
                              self.shuffle, self.batch_size, self.manifest["dtype"], self.seq_len, self.with_keys)
        batches = iter(DataLoader(stream, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                                  prefetch_factor=self.prefetch_factor))
        try:
            for batch in batches:
                done += 1
                # The position moves before the yield: a checkpoint taken after this batch resumes after it.
                self.epoch, self.samples = (epoch + 1, 0) if done >= limit else (epoch, done * self.batch_size)
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
        return {"epoch": self.epoch, "samples": self.samples, "batch_size": self.batch_size, "seed": self.seed,
                "dp_world": self.dp_world, "num_workers": self.num_workers, "version": self.manifest["version"]}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("version", "batch_size", "seed", "dp_world", "num_workers"):
            if state.get(key) != mine[key]:
                raise DataPrepError(f"cannot resume the data stream: {key} was {state.get(key)!r}, now {mine[key]!r}")
        self.epoch, self.samples = int(state["epoch"]), int(state["samples"])
