"""build_shard_set(): corpus → tokenizer → packed windows → shards → manifest, cached by source + config.

The steps are data_prep.job's (prepare, partition, layout, write, publish); here they run one after the other in
this process, the data DAG maps them over workers. The shard set's version is a hash of the inputs' contents, the
output-shaping config and the tokenizer identity: the same contents and config find the published directory and
rewrite nothing (a cache hit); any change gives a new version beside the old one.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from data_prep import fsio
from data_prep.config import ShardConfig
from data_prep.errors import DataPrepError
from data_prep.job import PUBLISHED, Job, prepare, published_instead, remember
from data_prep.layout import read_layout, run_layout
from data_prep.manifest import FORMAT, MANIFEST, digest, load_manifest, manifest_bytes
from data_prep.partition import run_partition
from data_prep.tokenizer import identity
from data_prep.fsio import sha256_file
from data_prep.writer import drop_write, run_write

log = logging.getLogger(__name__)


@dataclass
class BuildResult:
    shard_dir: Path
    manifest: dict
    digest: str  # sha256 of manifest.json
    cache_hit: bool
    seconds: float  # this call, wall clock
    tokenizer_seconds: float = 0.0  # training the BPE (0 when loaded or cached)
    sharding_seconds: float = 0.0  # read → clean → tokenise → pack → write → publish
    partitions: int = 0  # units of work of the build (0 on a cache hit)

    @property
    def tokens(self) -> int:
        return sum(s["token_stream"] for s in self.manifest["splits"].values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.sharding_seconds if self.sharding_seconds else 0.0


def _hit(shard_dir: Path, started: float) -> BuildResult:
    return BuildResult(shard_dir, load_manifest(shard_dir), digest(shard_dir), True, time.perf_counter() - started)


def build_shard_set(cfg: ShardConfig, reduce_only: bool = False, report=None) -> BuildResult:
    """Build (or find) the shard set. `reduce_only`: the DAG's last task — every step must already be done (by its
    mapped tasks); a missing or failing one is named and nothing is published. `report(step, done, total)` hears of
    each partition ("tokenize") and shard write ("write") done (the shard stage's progress lines)."""
    report = report or (lambda step, done, total: None)
    started = time.perf_counter()
    with contextlib.ExitStack() as hold:  # the key's build lock, from the index check to the publish
        prepared = prepare(cfg, create=not reduce_only, hold=hold)
        if prepared.job is None:
            return _hit(prepared.shard_dir, started)
        job = prepared.job
        if not reduce_only:
            for i in range(len(job.partitions)):
                run_partition(job, i, cfg.tokenize_processes, cfg.progress)
                report("tokenize", i + 1, len(job.partitions))
            layout = run_layout(job)
            writes = 0 if layout["published"] else len(layout["writes"])
            for i in range(writes):
                run_write(job, i)
                report("write", i + 1, writes)
        return publish(job, verify_sha256=cfg.verify_sha256, started=started)


def publish(job: Job, verify_sha256: bool = False, started: float | None = None) -> BuildResult:
    """The reduce step: check every write range's record and shards (sizes; sha256 too with verify_sha256), that
    the plan's shards are each written exactly once, then write the manifest and publish the set with one rename."""
    started = time.perf_counter() if started is None else started
    if found := job.published or published_instead(job.dir):  # an identical build published it meanwhile
        return _hit(found, started)
    with fsio.lock(job.dir, "publish"):
        layout = read_layout(job)
        if layout is None:
            raise DataPrepError(f"{job.dir}: the layout step has not run (a partition task failed?); not published")
        final = job.out_dir / layout["version"]
        if layout["published"]:  # the same contents were published before
            remember(job.out_dir, job.data["key"], layout["version"])
            shutil.rmtree(job.dir, ignore_errors=True)
            return _hit(final, started)
        entries = _checked_writes(job, layout, verify_sha256)
        manifest = _manifest(job, layout, entries)
        fsio.write_atomic(job.set_dir / MANIFEST, manifest_bytes(manifest))  # last: its presence means "complete"
        fsio.fsync_path(job.set_dir)
        if final.exists() and not (final / MANIFEST).is_file():
            raise DataPrepError(f"{final} exists but has no {MANIFEST} (not written by this tool?); remove it")
        fsio.write_atomic(job.dir / PUBLISHED, f"{layout['version']}\n".encode())
        won = fsio.rename_dir(job.set_dir, final)  # False: an identical build published it first
        remember(job.out_dir, job.data["key"], layout["version"])
    shutil.rmtree(job.dir, ignore_errors=True)
    seconds = time.perf_counter() - started
    tok_s = job.data["tokenizer_seconds"]
    wall = max(seconds, time.time() - job.data["created"])  # the DAG's build began in another task
    result = BuildResult(final, load_manifest(final), digest(final), not won, seconds, tok_s, wall - tok_s)
    result.partitions = len(job.partitions)
    log.info("shard set %s: %d tokens in %.1f s (%.0f tokens/s)", final, result.tokens, wall, result.tokens_per_s)
    return result


def _checked_writes(job: Job, layout: dict, verify_sha256: bool) -> dict[str, list[dict]]:
    """Each write range's record, each shard in it on disk with its recorded size (and sha256), and every shard of
    the plan written exactly once with its planned samples. A range that fails is named and dropped, so a rerun
    writes it again."""
    found: dict[str, dict[int, dict]] = {s: {} for s in layout["splits"]}
    for index, ranges in enumerate(layout["writes"]):
        path = job.dir / "writes" / f"{index:04d}.json"
        what = f"write range {index} ({', '.join(f'{s} {a}..{b - 1}' for s, a, b in ranges)})"
        try:
            record = fsio.read_json(path)
        except (OSError, ValueError):
            raise DataPrepError(f"{what} has no record: its task has not finished; not published") from None
        for e in record["shards"]:
            split, k = e["name"].split("-")[0], int(e["name"].split("-")[1].split(".")[0])
            per = layout["splits"][split]["per_shard"]
            problem = _shard_problem(job.set_dir / e["name"], e, verify_sha256, k in found[split], per)
            if problem:
                drop_write(job, index)
                raise DataPrepError(
                    f"{what} failed verification: {e['name']} {problem}; dropped, rerun the build to write it "
                    "again; not published"
                )
            found[split][k] = e
    for split, plan in layout["splits"].items():
        missing = [k for k in range(plan["num_shards"]) if k not in found[split]]
        if missing:
            raise DataPrepError(
                f"{split} shards {missing[:5]} of {plan['num_shards']} were written by no range; not published"
            )
    return {split: [found[split][k] for k in sorted(found[split])] for split in found}


def _shard_problem(path: Path, entry: dict, verify_sha256: bool, seen: bool, per_shard: int) -> str:
    if not path.is_file():
        return "is missing"
    if path.stat().st_size != entry["bytes"]:
        return f"is {path.stat().st_size} bytes, its record says {entry['bytes']}"
    if verify_sha256 and sha256_file(path) != entry["sha256"]:
        return "has another sha256 than its record"
    if seen:
        return "was written twice (also by another range)"
    if entry["samples"] != per_shard:
        return f"holds {entry['samples']} samples, the plan says {per_shard}"
    return ""


def _manifest(job: Job, layout: dict, entries: dict[str, list[dict]]) -> dict:
    cfg, tok = job.cfg, job.data["tokenizer"]
    sha256s = {name: sha256_file(job.set_dir / name) for name in tok["files"]}
    splits = {
        split: {
            **{k: plan[k] for k in ("samples", "tokens", "token_stream", "dropped_samples")},
            "shards": entries[split],
        }
        for split, plan in layout["splits"].items()
    }
    return {
        "format": FORMAT,
        "version": layout["version"],
        "seq_len": cfg.seq_len,
        "sample_tokens": cfg.seq_len + 1,
        "dtype": tok["dtype"],
        "vocab_size": tok["vocab_size"],
        "eos_token": tok["eos_token"],
        "eos_id": tok["eos_id"],
        "tokenizer": {
            "file": "tokenizer.json",
            "sha256": sha256s["tokenizer.json"],
            "source": tok["source"],
            "file_sha256": sha256s,
            "identity": identity(sha256s),
            **({"files": tok["files"]} if len(tok["files"]) > 1 else {}),
        },
        "source": {
            "inputs": list(job.data["inputs"]),
            "files": len(job.files),
            "fingerprint": layout["content_key"],
            **({"ended": layout["ended"]} if layout.get("ended") else {}),
        },
        "config": cfg.key_fields(),
        "stats": layout["stats"],
        "shard_multiple": cfg.shard_multiple,
        "warnings": layout["warnings"],
        "splits": splits,
    }
