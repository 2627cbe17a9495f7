"""Small shard sets of the fixture corpus and reading a published one back (the data-prep and fan-out tests)."""

from __future__ import annotations

import tarfile
from pathlib import Path

from data_prep.config import ShardConfig
from data_prep.manifest import load_manifest

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "data" / "corpus"


def shard_cfg(out: Path, inputs=None, **kw) -> ShardConfig:
    """A small shard set of `inputs` (the fixture corpus by default) under `out`: a 300-token BPE, 16-token windows,
    small shards in multiples of 4, one tokenizing process; `kw` overrides any field."""
    base = dict(
        inputs=[str(p) for p in (inputs or [CORPUS])],
        out_dir=str(out),
        vocab_size=300,
        seq_len=16,
        val_fraction=0.2,
        shard_size_mb=0.02,
        shard_multiple=4,
        tokenize_processes=1,
        progress=False,
    )
    return ShardConfig(**{**base, **kw})


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root` (relative POSIX path → bytes): two shard sets compared byte for byte."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def keys_from_manifest(shard_dir: Path) -> dict[str, list[str]]:
    """Every sample key of every shard the manifest lists, per split, read from the tars themselves."""
    m = load_manifest(shard_dir)
    out = {}
    for split, s in m["splits"].items():
        keys = []
        for e in s["shards"]:
            with tarfile.open(shard_dir / e["name"]) as tar:
                names = [t.name.split(".")[0] for t in tar.getmembers()]
            assert len(names) == e["samples"]
            keys += names
        assert len(keys) == s["samples"]
        out[split] = keys
    return out
