"""A build's shared state: `<out_dir>/.tmp-<key>/`, everything a step needs and leaves, nothing anywhere else.

Steps (each idempotent, each under its own lock, each leaving its output by one rename or not at all):
  prepare     inputs → partitions (files, size-balanced) + the tokenizer (trained or copied) → job.json
  partition i its files → cleaned, de-duplicated documents → token streams + document records (parts/NNNN/)
  layout      every partition → global de-duplication, the document cut, the window plan and write ranges
  write r     its shards of the plan → set/<split>-NNNNNN.tar + a record (writes/NNNN.json)
  publish     every record checked → manifest.json → set/ renamed to <out_dir>/<version>
The data DAG maps one task per partition and per write range; `python -m data_prep shard` runs the same steps one
after the other (build.build_shard_set). A step can run on any worker that sees the output directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from data_prep import fsio
from data_prep.config import ShardConfig
from data_prep.corpus import resolve_inputs, stat_key
from data_prep.errors import DataPrepError
from data_prep.manifest import FORMAT, MANIFEST
from data_prep.tokenizer import (
    TEXT_ENCODING,
    find_eos,
    load_tokenizer,
    token_dtype,
    tokenizer_companions,
    tokenizer_file,
    tokenizer_identity,
)

log = logging.getLogger(__name__)
JOB, PUBLISHED, INDEX = "job.json", "published", ".index"
PARTITION_BYTES = 128_000_000  # data.partitions = 0: one partition per this much input
FAULT_ENV = "DATA_PREP_FAULT"  # tests: "partition:I" / "write:I" kills the process in that step's first attempt


def fault(step: str, index: int) -> None:
    """$DATA_PREP_FAULT = "<step>:<index>": SIGKILL this process mid-step (the caller calls it only in an attempt
    that found no leftovers of an earlier one, so the retry completes) — a worker killed mid-partition, for tests.
    "<step>:<index>:stop": SIGSTOP instead, so that a test can kill the whole worker at that moment (a lost host:
    the task stops heartbeating, tests/test_celery_cluster.py)."""
    spec = os.environ.get(FAULT_ENV)
    if spec in (f"{step}:{index}", f"{step}:{index}:stop"):
        os.kill(os.getpid(), signal.SIGSTOP if spec.endswith(":stop") else signal.SIGKILL)


def plan_partitions(sizes: list[int], wanted: int) -> list[tuple[int, int]]:
    """Contiguous runs of files [a, b) with about equal bytes: `wanted` of them (0: one per PARTITION_BYTES), at
    most one per file. Contiguous, so the corpus order is the partitions' order."""
    total = sum(sizes)
    n = wanted or math.ceil(total / PARTITION_BYTES)
    n = max(1, min(n, len(sizes)))
    bounds, acc, k = [0], 0, 1
    for i, size in enumerate(sizes):
        acc += size
        left_files, left_parts = len(sizes) - (i + 1), n - k
        if k < n and (acc >= total * k / n or left_files == left_parts) and left_files >= left_parts:
            bounds.append(i + 1)
            k += 1
    bounds.append(len(sizes))
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass
class Job:
    dir: Path
    data: dict  # job.json
    tokenizer: object = None  # the prepared Tokenizer, when this process prepared the job (else read from set/)

    @property
    def cfg(self) -> ShardConfig:
        """The build's settings (job.json's key fields), with whether the tokenizer was trained or given: beside a
        given one, vocab_size is no key field and the default stands in (read as a BPE's, it was the version's)."""
        source = (self.data.get("tokenizer") or {}).get("source", "train")
        return ShardConfig.model_validate({**self.data["config"], "tokenizer": source})

    @property
    def files(self) -> list[str]:
        return self.data["files"]

    @property
    def partitions(self) -> list[list[int]]:
        return self.data["partitions"]

    @property
    def set_dir(self) -> Path:
        """What becomes the shard set: the tokenizer, the shards, then the manifest."""
        return self.dir / "set"

    def part_dir(self, index: int) -> Path:
        return self.dir / "parts" / f"{index:04d}"

    @property
    def out_dir(self) -> Path:
        return self.dir.parent

    @property
    def published(self) -> Path | None:
        """The shard set an identical build published (and removed this directory): every step is then done."""
        found = self.data.get("published")
        return Path(found) if found else None

    @classmethod
    def load(cls, directory: str | Path) -> "Job":
        """The prepared build in `directory`; one an identical build (another process, the CLI beside the DAG)
        published and removed meanwhile is a Job whose `published` names the set (its steps have nothing to do)."""
        directory = Path(directory)
        try:
            return cls(directory, fsio.read_json(directory / JOB))
        except FileNotFoundError:
            if found := published_instead(directory):
                return cls(directory, {"key": directory.name.removeprefix(".tmp-"), "published": str(found)})
            raise DataPrepError(
                f"{directory} holds no prepared build ({JOB} missing: removed, published or never prepared); "
                "run the build again from its first step"
            ) from None


@dataclass
class Prepared:
    """prepare()'s answer: the job to run, or the published shard set (a cache hit)."""

    job: Job | None
    shard_dir: Path | None = None
    key: str = ""


def build_key(files: list[Path], cfg: ShardConfig, partitions: int, stats=None) -> str:
    # TEXT_ENCODING: a set built before a special token's string in the text was encoded as text is not reused
    key = [FORMAT, stat_key(files, stats), cfg.config_hash(), tokenizer_identity(cfg.tokenizer), partitions]
    key.append(TEXT_ENCODING)
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def intact(shard_dir: Path) -> bool:
    """A published set may be trusted as a cache hit: its manifest loads, its tokenizer files' sha256 and every
    shard's size match it (a stat per shard: a cache hit still reads no shard; bytes changed in place are the
    loader's crc32 to catch). A damaged set is moved aside (kept for inspection, named in
    one warning line), so that the build that follows writes the set again instead of handing out the damaged one."""
    from data_prep.manifest import check_files, load_manifest

    if not (shard_dir / MANIFEST).is_file():
        return False
    try:
        manifest = load_manifest(shard_dir)
        for split in manifest["splits"]:
            check_files(shard_dir, manifest, split)
    except DataPrepError as e:
        aside = shard_dir.with_name(f"{shard_dir.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
        os.rename(shard_dir, aside)
        log.warning("published shard set %s is damaged (%s): moved to %s; building it again", shard_dir, e, aside)
        return False
    return True


def lookup(out_dir: Path, key: str) -> Path | None:
    """The shard set published for this build key, if it is still there, whole."""
    try:
        version = (out_dir / INDEX / key).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    found = out_dir / version
    return found if version and intact(found) else None


def published_instead(directory: Path) -> Path | None:
    """The set published for the key of the build in `directory` (`<out_dir>/.tmp-<key>`): its index entry names a
    whole set (an identical build published it, and removes or removed `directory`), else None."""
    directory = Path(directory)
    if not directory.name.startswith(".tmp-"):
        return None
    return lookup(directory.parent, directory.name.removeprefix(".tmp-"))


def unless_published(job: "Job", step, done):
    """`step()`, unless an identical build (another process; the CLI beside the DAG) published the set: then
    `done(set path)`, also when it happens mid-step (this build's directory removed under it), never the false
    cause a vanished file would give."""
    if found := job.published or published_instead(job.dir):
        return done(found)
    try:
        return step()
    except (OSError, DataPrepError):
        if found := published_instead(job.dir):
            shutil.rmtree(job.dir, ignore_errors=True)  # what this step put back (its lock files)
            return done(found)
        raise


@contextlib.contextmanager
def build_lock(out_dir: Path, key: str):
    """One build of a key at a time from its index check to its publish (a single-process build, the DAG's reduce):
    a second identical build waits here, then finds the set published (a cache hit) instead of racing the first
    through the shared `.tmp-<key>/`. The lock file lives in `<out_dir>/.index/locks/`."""
    with fsio.lock(out_dir / INDEX, f"build-{key}"):
        yield


def remember(out_dir: Path, key: str, version: str) -> None:
    fsio.make_dir(out_dir / INDEX)
    fsio.write_atomic(out_dir / INDEX / key, f"{version}\n".encode())


def prepare(cfg: ShardConfig, create: bool = True, hold: contextlib.ExitStack | None = None) -> Prepared:
    """Resolve the inputs, find the published set (cache hit) or the build in progress, or (`create`) start one.
    `hold`: take the key's build_lock into it (kept until the caller has published) and look the key up again."""
    started = time.time()
    cfg.validate()
    if not cfg.shard_multiple:  # 0 = automatic; alone, data_prep knows of one reader (the pipeline passes its own)
        cfg = cfg.model_copy(update={"shard_multiple": 1})
    notes: list[str] = []  # the inputs' warnings: the manifest records them with the build's own
    files = resolve_inputs(cfg.inputs, notes)
    stats = [p.stat() for p in files]
    sizes = [st.st_size for st in stats]
    partitions = plan_partitions(sizes, cfg.partitions)
    out_dir = Path(cfg.out_dir)
    key = build_key(files, cfg, len(partitions), stats)
    if found := lookup(out_dir, key):
        return Prepared(None, found, key)
    fsio.ensure_writable(out_dir)
    if hold is not None:
        hold.enter_context(build_lock(out_dir, key))
        if found := lookup(out_dir, key):  # an identical build published it while this one waited
            return Prepared(None, found, key)
    directory = out_dir / f".tmp-{key}"
    if (directory / PUBLISHED).is_file():  # published, then killed before it cleaned up
        version = (directory / PUBLISHED).read_text().strip()
        if intact(out_dir / version):
            remember(out_dir, key, version)
            shutil.rmtree(directory, ignore_errors=True)
            return Prepared(None, out_dir / version, key)
    if not create and not (directory / JOB).is_file():
        raise DataPrepError(
            f"no build of these inputs in progress under {out_dir} (an input changed after the build's first task, "
            "or its directory was removed); run the build again"
        )
    fsio.make_dir(directory)
    _warn_stale(out_dir, directory)
    with fsio.lock(directory, "prepare"):
        if (directory / JOB).is_file():  # a build of the same inputs in progress (or killed): resumed
            return Prepared(Job.load(directory), None, key)
        set_dir = directory / "set"
        shutil.rmtree(set_dir, ignore_errors=True)
        fsio.make_dir(set_dir)
        t0 = time.perf_counter()
        try:
            tokenizer, tok = _tokenizer(cfg, files, set_dir)
        except DataPrepError:  # a bad tokenizer (or its companion file): nothing prepared, nothing left behind
            shutil.rmtree(directory, ignore_errors=True)
            raise
        data = {
            "format": FORMAT,
            "key": key,
            "created": started,
            "config": cfg.key_fields(),
            "inputs": list(cfg.inputs),
            "files": [str(p) for p in files],
            "input_warnings": notes,
            "bytes": sum(sizes),
            "partitions": partitions,
            "tokenizer": tokenizer,
            "tokenizer_seconds": time.perf_counter() - t0,
        }
        fsio.write_json(directory / JOB, data)  # last: its presence means "prepared"
    return Prepared(Job(directory, data, tok), None, key)


def _tokenizer(cfg: ShardConfig, files: list[Path], set_dir: Path):
    """Train the BPE (on the train split only: nothing of val leaks into the vocabulary) or copy the given
    tokenizer, byte for byte, with its companion files (tokenizer_config.json …), into the shard set."""
    from data_prep.clean import TRAIN, clean_documents
    from data_prep.corpus import CorpusStats
    from data_prep.tokenizer import train_bpe

    names = ["tokenizer.json"]
    if cfg.tokenizer == "train":
        train_texts = (t for split, t in clean_documents(files, cfg, CorpusStats(quiet=True)) if split == TRAIN)
        tok = train_bpe(train_texts, cfg.vocab_size, cfg.eos_token or "<|endoftext|>")
        partial = set_dir / ".tokenizer.json.partial"
        tok.save(str(partial))
        fsio.chmod_file(partial)
        os.replace(partial, set_dir / "tokenizer.json")
        source = "train"
    else:
        tok = load_tokenizer(cfg.tokenizer)
        source = str(tokenizer_file(cfg.tokenizer).resolve())
        fsio.copy(tokenizer_file(cfg.tokenizer), set_dir / "tokenizer.json")
        for f in tokenizer_companions(cfg.tokenizer):
            fsio.copy(f, set_dir / f.name)
            names.append(f.name)
    eos_name, eos_id = find_eos(tok, cfg.tokenizer, cfg.eos_token)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    info = {
        "source": source,
        "key": tokenizer_identity(cfg.tokenizer),
        "files": names,
        "eos_token": eos_name,
        "eos_id": eos_id,
        "vocab_size": vocab,
        "dtype": token_dtype(vocab, cfg.token_dtype).name,
    }
    return info, tok


def _warn_stale(out_dir: Path, mine: Path, age_s: float = 86400) -> None:
    """Builds left by killed runs of other inputs/configs (a rerun of the same ones resumes its own)."""
    now = time.time()
    stale = [p for p in out_dir.glob(".tmp-*") if p != mine and now - p.stat().st_mtime > age_s]
    if stale:
        log.warning(
            "%d unfinished build(s) older than a day in %s (e.g. %s): a rerun with the same inputs and config "
            "resumes one; otherwise remove them",
            len(stale),
            out_dir,
            stale[0].name,
        )
