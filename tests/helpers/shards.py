"""Reading a published shard set back (the data-prep and Celery fan-out tests)."""

from __future__ import annotations

import tarfile
from pathlib import Path

from data_prep.manifest import load_manifest


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
