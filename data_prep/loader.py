"""ShardLoader: the training/eval reader of a shard set (a webdataset pipeline inside torchdata's
StatefulDataLoader).

One global sample order per epoch, the same for every layout: the shards in a (seed, epoch) permutation, and
inside each shard its samples in a (seed, epoch, shard index) permutation (the writer already spread the corpus over
the shards at random). Step k's global batch is positions [k·G, (k+1)·G) of that order, G = batch_size × dp_world,
and data-parallel rank r takes the contiguous slice [k·G + r·batch_size, k·G + (r+1)·batch_size) — as Megatron's
pretraining sampler does. So a dp1, dp2 or dp4 run trains on the same samples at every step, tensor/pipeline ranks
of one replica pass the same dp_rank and read the same batches, and every sample is read at most once per epoch (the
last partial global batch waits for the next epoch's order). A rank reads (but does not decode) every shard that
holds one of its slices — with shards larger than G, all of them: the price of a layout-free order.

Every shard read is checked whole before any of its samples is used: its sample count, then the crc32 of its samples
(keys and payloads, in tar order) against the manifest's `samples_crc32` — a byte changed in place is caught without
data.verify_sha256 (which hashes every shard file at open). At open, the tokenizer files' sha256 and every shard's
size are checked (manifest.check_files).

The position is (epoch, global samples consumed): it means the same on any layout, so a checkpoint resumes on
another dp degree or worker count; whole shards before it are skipped by their manifest counts without being read.
The stream (`_Stream`, an IterableDataset) starts at a position and runs over epochs without end; its worker i
yields the rank's batches i, i + num_workers, … counted from that position, and StatefulDataLoader (in_order=True,
its default: batches come back first-in first-out, worker after worker) returns them in order. One such iterator
serves a ShardLoader from one position to the next `load_state_dict`, so its workers live across epochs and a
consumer that stops mid-epoch leaves nothing to stop: the next `iter(loader)` continues the same iterator, and
dropping the last reference is what stops its workers. The position is counted here, batch by batch as they are
handed out, not read from StatefulDataLoader's own state_dict: that one is bound to the worker count that wrote it
(it asserts the same `num_workers` on load) and to one rank, and this position must move across layouts.
"""

from __future__ import annotations

import io
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from data_prep.errors import CorruptShardError, DataPrepError
from data_prep.manifest import check_files, load_manifest, shards

ORDER = "global/1"  # the state_dict's position format: global samples consumed in the epoch


SHORT_SPLIT_FIX = "use a smaller batch, or shard more data (a larger corpus or a shorter seq_len)"


def batch_problem(manifest: dict, split: str, batch_size: int, dp_world: int, fix: str = SHORT_SPLIT_FIX) -> str | None:
    """The one line when `split` holds less than one global batch (batch_size × dp_world samples: not one step
    could be read), else None. ShardLoader refuses such a split; the train stage asks before it launches."""
    entries = shards(manifest, split)
    total = sum(e["samples"] for e in entries)
    if total >= batch_size * dp_world:
        return None
    return (
        f"split {split!r} of {manifest['version']} has {len(entries)} shard(s) and {total} samples: not one batch of "
        f"{batch_size} for each of {dp_world} rank(s) ({batch_size * dp_world}); {fix}"
    )


def epoch_order(n_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Manifest indices of the shards in this epoch's order."""
    return [
        int(i) for i in (np.random.default_rng([seed, epoch]).permutation(n_shards) if shuffle else range(n_shards))
    ]


class _Stream(IterableDataset):
    """One rank's batches from a position (epoch, samples) on, epoch after epoch without end. Global batch c
    (counted from the position) goes to DataLoader worker c % num_workers; in an epoch, batch j covers the global
    positions first + j·global_batch + offset … + batch_size. `epoch`, `samples`: the starting position."""

    def __init__(self, shard_dir, entries, global_batch, offset, seed, shuffle, batch_size, dtype, seq_len, with_keys):
        self.shard_dir, self.entries, self.global_batch, self.offset = Path(shard_dir), entries, global_batch, offset
        self.seed, self.shuffle, self.batch_size = seed, shuffle, batch_size
        self.dtype, self.sample_tokens, self.with_keys = np.dtype(dtype), seq_len + 1, with_keys
        self.total = sum(e["samples"] for e in entries)
        self.epoch, self.samples = 0, 0  # set by ShardLoader before each StatefulDataLoader is made
        self._headers: set[bytes] = set()  # .npy headers np.load accepted (see _decode)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        epoch, start, counted = self.epoch, self.samples, 0  # counted: global batches before this epoch's first
        while True:
            n = max(0, (self.total - start) // self.global_batch)  # batches in this epoch from `start`
            mine = [j for j in range(n) if (counted + j) % workers == worker]
            if mine:
                yield from self._epoch(epoch, [start + j * self.global_batch + self.offset for j in mine])
            epoch, start, counted = epoch + 1, 0, counted + n

    def _epoch(self, epoch: int, firsts: list[int]):
        """This worker's batches of one epoch: `firsts` are their first global positions, ascending."""
        order, base, needed, pos, k = epoch_order(len(self.entries), self.seed, epoch, self.shuffle), {}, [], 0, 0
        for index in order:  # the shards that hold one of those positions (others are not even opened)
            n = self.entries[index]["samples"]
            while k < len(firsts) and firsts[k] + self.batch_size <= pos:
                k += 1
            if k < len(firsts) and firsts[k] < pos + n:
                needed.append(index)
                base[index] = pos
            pos += n
        urls = {str(self.shard_dir / self.entries[i]["name"]): i for i in needed}
        pipeline = wds.DataPipeline(
            wds.SimpleShardList(list(urls)),
            wds.tarfile_to_samples(handler=lambda exn: self._corrupt(exn, urls)),
            lambda samples: self._select(samples, urls, base, firsts, epoch),
            wds.map(self._decode),
            wds.batched(self.batch_size, collation_fn=self._collate, partial=False),
        )
        made = 0
        for batch in pipeline:
            made += 1
            yield batch
        if made != len(firsts):
            raise CorruptShardError(
                f"{self.shard_dir}: epoch {epoch} gave a worker {made} batches, the manifest promises {len(firsts)}"
            )

    @staticmethod
    def _corrupt(exn: Exception, urls: dict) -> bool:
        text = " ".join(map(str, exn.args))
        name = next((u for u in urls if Path(u).name in text), "of this worker")
        raise CorruptShardError(
            f"shard {name} is corrupt or truncated: {type(exn).__name__}: {str(exn.args[0]) if exn.args else exn}"
        ) from None

    def _select(self, samples, urls: dict, base: dict, firsts: list[int], epoch: int):
        """Tar samples arrive shard after shard: permute each shard, keep the samples at this worker's positions."""
        group, url, k = [], None, 0
        for sample in samples:
            if sample["__url__"] != url and group:
                k = yield from self._emit(url, group, urls[url], base, firsts, epoch, k)
                group = []
            url = sample["__url__"]
            group.append(sample)
        if group:
            yield from self._emit(url, group, urls[url], base, firsts, epoch, k)

    def _emit(self, url: str, group: list, index: int, base: dict, firsts: list[int], epoch: int, k: int):
        """Yield the samples of shard `index` at this worker's positions; returns the next batch to fill."""
        if len(group) != self.entries[index]["samples"]:
            raise CorruptShardError(
                f"shard {url} is corrupt or truncated: only {len(group)} of "
                f"{self.entries[index]['samples']} samples readable"
            )
        crc = 0  # the samples' crc32, as the writer computed it: nothing of a shard is used before it matches
        for sample in group:
            crc = zlib.crc32(sample.get("tokens.npy", b""), zlib.crc32(sample["__key__"].encode(), crc))
        if crc != self.entries[index]["samples_crc32"]:
            raise CorruptShardError(
                f"shard {url} is corrupt: its samples' crc32 differs from the manifest (bytes changed in place); "
                f"remove {self.shard_dir} and rerun the shard stage to rebuild it"
            )
        order = (
            np.random.default_rng([self.seed, epoch, index]).permutation(len(group))
            if self.shuffle
            else range(len(group))
        )
        for pos, i in enumerate(order, start=base[index]):
            while k < len(firsts) and pos >= firsts[k] + self.batch_size:
                k += 1
            if k == len(firsts):
                break
            if pos >= firsts[k]:
                yield group[i]
        return k

    def _decode(self, sample: dict):
        """numpy's own .npy reader (np.load checks magic, header, dtype, order and shape), then our dtype and length.
        np.load parses the header text per call (~100× a frombuffer); every sample of a set has the same header, so
        a header np.load accepted once is remembered and later samples with those exact bytes are read from the
        offset after it — what np.load would return."""
        data = sample.get("tokens.npy", b"")
        header = data[: len(data) - self.sample_tokens * self.dtype.itemsize]
        if header and header in self._headers:
            return np.frombuffer(data, dtype=self.dtype, offset=len(header)), sample["__key__"]
        try:
            row = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, EOFError, OSError):
            row = None
        if row is None or row.dtype != self.dtype or row.shape != (self.sample_tokens,):
            raise CorruptShardError(
                f"shard {sample['__url__']}: sample {sample['__key__']} is not "
                f"{self.sample_tokens} {self.dtype.name} tokens"
            )
        self._headers.add(header)
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

    def __init__(
        self,
        shard_dir,
        split: str = "train",
        batch_size: int = 8,
        dp_rank: int = 0,
        dp_world: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        verify_sha256: bool = False,
        with_keys: bool = False,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
    ):
        if not (0 <= dp_rank < dp_world) or batch_size < 1 or num_workers < 0:
            raise DataPrepError(
                f"ShardLoader: need 0 <= dp_rank ({dp_rank}) < dp_world ({dp_world}), "
                f"batch_size ({batch_size}) >= 1, num_workers ({num_workers}) >= 0"
            )
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
        self._stream = _Stream(
            self.shard_dir,
            self.entries,
            self.global_batch,
            dp_rank * batch_size,
            seed,
            shuffle,
            batch_size,
            self.manifest["dtype"],
            self.seq_len,
            with_keys,
        )
        self._batches = None  # the StatefulDataLoader iterator; its next batch is at (epoch, samples)
        short = batch_problem(self.manifest, split, batch_size, dp_world)
        if short:
            raise DataPrepError(short)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp_world

    def __len__(self) -> int:
        return self.total // self.global_batch

    def __iter__(self):
        """The rest of the current epoch."""
        epoch, start = self.epoch, self.samples
        limit = (self.total - start) // self.global_batch  # batches left in this epoch from the position
        if limit <= 0:  # a position saved at the very end of an epoch
            self.epoch, self.samples = epoch + 1, 0
            return
        if self._batches is None:  # the stream starts at the position (the first time, or after load_state_dict)
            self._stream.epoch, self._stream.samples = epoch, start
            with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated by torch 2.13
                warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
                self._batches = iter(
                    StatefulDataLoader(
                        self._stream,
                        batch_size=None,
                        num_workers=self.num_workers,
                        pin_memory=self.pin_memory,
                        prefetch_factor=self.prefetch_factor,
                    )
                )
        for done in range(1, limit + 1):
            try:
                batch = next(self._batches)
            except CorruptShardError as e:  # from a worker it arrives wrapped in its traceback: keep the cause
                message = str(e).rsplit("CorruptShardError: ", 1)[-1]
                # torch re-raises a worker's error from a frame that holds it (ExceptionWrapper.reraise): error,
                # traceback and the iterator's frames form a cycle that only the cyclic collector frees, at some later
                # allocation; a shutdown run from the collector never reached the workers (torchdata 0.11: each join
                # waited out its 5 s, then terminated them). Without the traceback the iterator goes with its last
                # reference, below, and its workers exit at once.
                e.__traceback__ = None
            except BaseException:  # a worker died, an interrupt: the stream is not trusted any more
                self._batches = None
                raise
            else:
                # The position moves before the yield: a checkpoint taken after this batch resumes after it.
                self.epoch, self.samples = (
                    (epoch + 1, 0) if done == limit else (epoch, start + done * self.global_batch)
                )
                yield batch
                continue
            # A broken stream: dropped here (its last reference, so its workers stop now, not when a traceback
            # that holds this frame is collected); the next iteration starts a fresh one at the position.
            self._batches = None
            raise CorruptShardError(message)

    def close(self) -> None:
        """Stop the worker processes now, each through its own exit (the iterator's shutdown: it drops its last
        reference here). Left to the process's end, multiprocessing terminates them (they are daemonic), and every
        worker that passed a batch leaves its pymp-* directory (the socket of multiprocessing/resource_sharer.py, in
        util.get_temp_dir) in $TMPDIR. The next iteration starts a fresh stream at the position."""
        self._batches = None

    def batches(self):
        """Endless stream over epochs (training by steps)."""
        while True:
            yield from self

    def state_dict(self) -> dict:
        """The position in the global order (epoch, samples consumed by all ranks), valid for any layout; the
        batch size, dp_world and num_workers are recorded for information only."""
        return {
            "order": ORDER,
            "epoch": self.epoch,
            "samples": self.samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "version": self.manifest["version"],
            "batch_size": self.batch_size,
            "dp_world": self.dp_world,
            "num_workers": self.num_workers,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("order") != ORDER:
            raise DataPrepError(
                "cannot resume the data stream: the saved position is per rank (written before the "
                "layout-independent sample order); the data stream restarts"
            )
        mine = self.state_dict()
        for key in ("version", "seed", "shuffle"):
            if state.get(key) != mine[key]:
                # The saved (epoch, samples) counts positions of another order: kept, it would skip samples never
                # read and repeat others. The loader stays at the start; the caller decides (the trainer notes it).
                back = "the saved shard set" if key == "version" else f"{key} {state.get(key)!r}"
                raise DataPrepError(
                    f"cannot resume the data stream: {key} was {state.get(key)!r}, now {mine[key]!r}, another "
                    f"sample order; it restarts at epoch 0 (use {back} to continue where it stopped)"
                )
        self.epoch, self.samples = int(state["epoch"]), int(state["samples"])
        self._batches = None  # dropped: its workers stop (the iterator's own cleanup), a new one starts here
