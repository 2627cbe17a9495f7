"""ShardLoader on real webdataset shards: one global order for every layout, exactly-once under torchrun (2 ranks ×
2 workers), resume (also on another dp degree), corruption."""

from __future__ import annotations

import gc
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from data_prep.build import build_shard_set
from data_prep.errors import CorruptShardError, DataPrepError
from data_prep.loader import ShardLoader
from tasks.launch.torchrun import launcher
from tests.helpers.shards import CORPUS, shard_cfg

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory) -> Path:
    """640 train windows of 9 tokens in 20 equal shards (a multiple of 2 ranks × 2 workers): the fixture corpus's
    four text files (its records.jsonl would double every test's reading and add nothing to what they check)."""
    texts = [CORPUS / f"{name}.txt" for name in ("alpha", "beta", "delta", "gamma")]
    cfg = shard_cfg(tmp_path_factory.mktemp("shards"), texts, seq_len=8, shard_size_mb=0.04)
    return build_shard_set(cfg).shard_dir


def all_keys(shard_dir: Path, split: str = "train") -> list[str]:
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    names = []
    for entry in manifest["splits"][split]["shards"]:
        with tarfile.open(shard_dir / entry["name"]) as tar:
            names += [m.name.split(".")[0] for m in tar.getmembers()]
    return names


def per_shard(shard_dir: Path) -> int:
    return json.loads((shard_dir / "manifest.json").read_text())["splits"]["train"]["shards"][0]["samples"]


def keys(batches) -> list[str]:
    return [k for _, _, ks in batches for k in ks]


def test_exactly_once_across_2_ranks_x_2_workers_under_torchrun(shard_set, tmp_path):
    batch = math.gcd(per_shard(shard_set), 8)  # divides every worker's samples: nothing is left over
    out = tmp_path / "seen.json"
    cmd = [
        sys.executable,
        *launcher("cpu"),  # the ranks start as training's CPU ranks do: forked by torchrun's agent
        "--standalone",
        "--nproc-per-node",
        "2",
        str(REPO / "tests" / "loader_dist_check.py"),
        str(shard_set),
        str(batch),
        str(out),
    ]
    r = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = json.loads(out.read_text())
    expected = sorted(all_keys(shard_set))
    assert len({rank["len"] for rank in ranks}) == 1 and all(rank["shifted"] for rank in ranks)
    for epoch in (0, 1):
        seen = [k for rank in ranks for k in rank["epochs"][epoch]]
        assert sorted(seen) == expected  # every sample once: no duplicate, none missing
    assert all(rank["epochs"][0] != rank["epochs"][1] for rank in ranks)  # reshuffled per epoch
    assert all(rank["resumed"] == rank["epochs"][0] for rank in ranks)  # resume continues exactly
    # The position is global: 5 steps of 2 ranks × batch samples (it was per rank before the global order).
    assert all(rank["state"] == {**rank["state"], "epoch": 0, "samples": 5 * batch * 2} for rank in ranks)
    assert all(rank["epoch_after"] == 2 for rank in ranks)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_position_mid_epoch_and_across_epochs(shard_set, workers):
    kw = dict(batch_size=3, num_workers=workers, seed=3, with_keys=True)
    reference = ShardLoader(shard_set, **kw)
    n = len(reference)
    full = keys(list(reference) + list(reference))  # two uninterrupted epochs
    # n + 3 with 2 workers: the next batch is worker 1's, so the resumed DataLoader must start there
    for stop in (1, n - 1, n, n + 2) if workers == 0 else (n + 3,):
        first = ShardLoader(shard_set, **kw)
        head = []
        for batch in first.batches():
            head.append(batch)
            if len(head) == stop:
                break
        state = first.state_dict()
        assert (state["epoch"], state["samples"]) == divmod(stop, n)[:1] + (stop % n * 3,)
        resumed = ShardLoader(shard_set, **kw)
        resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip (checkpoint)
        rest = []
        while len(head) + len(rest) < 2 * n:
            rest += list(resumed)
        assert keys(head + rest) == full, f"resume after {stop} batches diverged"


def test_uneven_split_keeps_ranks_equal_and_never_repeats(shard_set):
    """20 shards over 3 ranks × 2 workers: equal batch counts per rank, no sample twice, bounded leftovers."""
    batch = 4
    loaders = [
        ShardLoader(shard_set, batch_size=batch, dp_rank=r, dp_world=3, num_workers=2, with_keys=True) for r in range(3)
    ]
    seen = [keys(list(loader)) for loader in loaders]
    assert len({len(s) for s in seen}) == 1 and len({len(loader) for loader in loaders}) == 1
    flat = [k for s in seen for k in s]
    assert len(flat) == len(set(flat)) and set(flat) <= set(all_keys(shard_set))
    assert len(all_keys(shard_set)) - len(flat) < 3 * 2 * batch + 3 * per_shard(shard_set)


def global_steps(
    shard_set, dp_world: int, workers: int, global_batch: int = 12, steps: int | None = None, state: dict | None = None
) -> list[list[str]]:
    """The keys of each step's global batch: the dp ranks' batches of that step, concatenated in rank order."""
    loaders = [
        ShardLoader(
            shard_set,
            batch_size=global_batch // dp_world,
            dp_rank=r,
            dp_world=dp_world,
            num_workers=workers,
            seed=5,
            with_keys=True,
        )
        for r in range(dp_world)
    ]
    for loader in loaders:
        if state:
            loader.load_state_dict(state)
    streams = [loader.batches() for loader in loaders]
    steps = steps or len(loaders[0])
    return [[k for stream in streams for k in next(stream)[2]] for _ in range(steps)]


def test_every_layout_sees_the_same_global_batch_each_step(shard_set):
    """dp1, dp2, dp3 and dp4, with 0 or 2 workers per rank: step k's global batch is the same samples in the same
    order, over an epoch boundary; within an epoch no sample repeats."""
    gb = 24  # divisible by every dp degree here
    n = len(ShardLoader(shard_set, batch_size=gb))
    reference = global_steps(shard_set, 1, 0, gb, steps=n + 2)
    for dp, workers in ((1, 2), (2, 0), (3, 2), (4, 0), (4, 2)):
        assert global_steps(shard_set, dp, workers, gb, steps=n + 2) == reference, f"dp{dp} × {workers} workers"
    epoch = [k for step in reference[:n] for k in step]
    assert len(epoch) == len(set(epoch)) and len(all_keys(shard_set)) - len(epoch) < gb
    assert reference[n] != reference[0]  # the next epoch has its own order


def test_a_position_saved_on_dp4_resumes_on_dp2_and_dp1(shard_set):
    """A dp4 run's loader position after 3 steps continues the same global stream on dp2 (2 workers) and dp1."""
    reference = global_steps(shard_set, 1, 0, steps=8)
    loaders = [ShardLoader(shard_set, batch_size=3, dp_rank=r, dp_world=4, seed=5, with_keys=True) for r in range(4)]
    streams = [loader.batches() for loader in loaders]
    for _ in range(3):
        for stream in streams:
            next(stream)
    state = loaders[2].state_dict()  # every rank holds the same position
    assert all(loader.state_dict() == {**state, "batch_size": 3} for loader in loaders)
    assert global_steps(shard_set, 2, 2, steps=5, state=state) == reference[3:]
    assert global_steps(shard_set, 1, 0, steps=5, state=state) == reference[3:]
    with pytest.raises(DataPrepError, match="saved position is per rank"):
        ShardLoader(shard_set, batch_size=3).load_state_dict({"epoch": 0, "samples": 6, "seed": 5, "dp_world": 4})


def test_batches_shapes_and_unshuffled_val(shard_set):
    manifest = json.loads((shard_set / "manifest.json").read_text())
    x, y = next(iter(ShardLoader(shard_set, batch_size=5)))
    assert x.shape == y.shape == (5, 8) and x.dtype == y.dtype == torch.int64
    assert int(x.max()) < manifest["vocab_size"] and bool((x[:, 1:] == y[:, :-1]).all())
    val = ShardLoader(shard_set, split="val", batch_size=2, shuffle=False, with_keys=True)
    assert keys(list(val)) == keys(list(val))[: len(val) * 2]
    assert keys(list(val)) == all_keys(shard_set, "val")[: len(val) * 2]  # file order, same every epoch


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_more_workers_than_shards_is_fine(shard_set):
    """webdataset's empty_check would raise "No samples found" for workers without shards; ours just end."""
    loader = ShardLoader(shard_set, batch_size=2, dp_rank=0, dp_world=4, num_workers=6, with_keys=True)
    seen = keys(list(loader))
    assert seen and len(seen) == len(loader) * 2 == len(set(seen))


def test_bad_positions_and_sizes(shard_set):
    loader = ShardLoader(shard_set, batch_size=2, seed=1)
    with pytest.raises(DataPrepError, match="cannot resume the data stream: seed was 1, now 2"):
        ShardLoader(shard_set, batch_size=2, seed=2).load_state_dict(loader.state_dict())
    with pytest.raises(DataPrepError, match="not one batch of 100000"):
        ShardLoader(shard_set, batch_size=100_000)
    with pytest.raises(DataPrepError, match="need 0 <= dp_rank"):
        ShardLoader(shard_set, dp_rank=2, dp_world=2)
    with pytest.raises(DataPrepError, match="nowhere does not exist; give the shard set.s directory"):
        ShardLoader(shard_set / "nowhere")
    with pytest.raises(DataPrepError, match="no split 'test'"):
        ShardLoader(shard_set, split="test")


@pytest.fixture
def damaged(shard_set, tmp_path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(shard_set, copy)
    return copy


def test_corrupt_shard_fails_naming_it(damaged):
    victim = damaged / "train-000003.tar"
    data = bytearray(victim.read_bytes())
    data[1024 * 3 + 100 : 1024 * 3 + 160] = b"\xff" * 60  # inside a tar header: its checksum no longer matches
    victim.write_bytes(bytes(data))
    for workers in (0, 2):
        before = set(multiprocessing.active_children())
        gc.disable()  # the workers must end with the error itself, not at a later collection of garbage
        try:
            with pytest.raises(CorruptShardError, match=r"train-000003.tar is corrupt or truncated: only 3 of") as e:
                list(ShardLoader(damaged, batch_size=2, num_workers=workers, shuffle=False))
            # none of the loader's workers left waiting (a cycle through torch's re-raise kept them until a
            # collection, whose shutdown then waited 5 s per worker)
            assert set(multiprocessing.active_children()) <= before
        finally:
            gc.enable()
        assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


def test_truncated_and_altered_shards_fail_before_reading(damaged):
    victim = damaged / "train-000001.tar"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptShardError, match=r"train-000001.tar is truncated or altered"):
        ShardLoader(damaged, batch_size=2)
    altered = bytearray(data)
    altered[600] ^= 0xFF  # payload byte: the tar is still well-formed, the size right
    victim.write_bytes(bytes(altered))
    with pytest.raises(CorruptShardError, match=r"train-000001.tar is corrupt: sha256 differs"):
        ShardLoader(damaged, batch_size=2, verify_sha256=True)
    loader = ShardLoader(damaged, batch_size=2)  # without verify_sha256: caught as the shard is read
    with pytest.raises(CorruptShardError, match=r"train-000001.tar is corrupt: its samples' crc32 differs"):
        list(loader)
    (damaged / "train-000002.tar").unlink()
    with pytest.raises(CorruptShardError, match=r"train-000002.tar is missing"):
        ShardLoader(damaged, batch_size=2)


def test_tiny_shard_set_helper(tmp_path):
    from data_prep.testing import tiny_shard_set

    d = tiny_shard_set(tmp_path, seq_len=16, vocab_size=300, n_docs=8)
    assert tiny_shard_set(tmp_path, seq_len=16, vocab_size=300, n_docs=8) == d  # cached
    x, y = next(iter(ShardLoader(d, batch_size=4, dp_rank=1, dp_world=2, num_workers=2)))
    assert x.shape == (4, 16)


def test_stopping_mid_epoch_and_iterating_again_continues_the_same_epoch(shard_set):
    """The loader keeps one StatefulDataLoader iterator: a consumer that stops after 3 batches and iterates again
    gets the rest of the epoch, then the next epoch — the same keys as two uninterrupted epochs."""
    kw = dict(batch_size=8, num_workers=2, seed=4, with_keys=True)
    reference = ShardLoader(shard_set, **kw)
    full = keys(list(reference) + list(reference))
    loader = ShardLoader(shard_set, **kw)
    head = []
    for batch in loader:
        head.append(batch)
        if len(head) == 3:
            break
    assert (loader.epoch, loader.samples) == (0, 3 * 8)
    assert keys(head + list(loader) + list(loader)) == full and loader.epoch == 2


def test_a_sample_that_is_not_a_token_row_fails_naming_it(shard_set):
    """Samples are read by numpy's .npy reader: a bad header, another dtype or another length is a corrupt shard."""
    import io

    import numpy as np

    stream = ShardLoader(shard_set, batch_size=2)._stream
    good = io.BytesIO()
    np.save(good, np.arange(9, dtype=stream.dtype))
    assert list(stream._decode({"tokens.npy": good.getvalue(), "__key__": "k", "__url__": "u"})[0]) == list(range(9))
    for name, data in (
        ("header", b"\x93NUMPY garbage"),
        ("dtype", np.arange(9, dtype=np.float32)),
        ("length", np.arange(5, dtype=stream.dtype)),
    ):
        if not isinstance(data, bytes):
            buf = io.BytesIO()
            np.save(buf, data)
            data = buf.getvalue()
        with pytest.raises(CorruptShardError, match=r"shard u: sample k is not 9 "):
            stream._decode({"tokens.npy": data, "__key__": "k", "__url__": "u"})


def test_a_byte_flipped_in_place_stops_smoke_before_any_of_its_samples_is_used(damaged):
    """The check smoke and train get without data.verify_sha256 (off on the CLI): every shard's samples crc32."""
    from tasks.errors import StageError
    from tasks.stages.smoke import load_batches

    manifest = json.loads((damaged / "manifest.json").read_text())
    for entry in manifest["splits"]["train"]["shards"]:
        victim = damaged / entry["name"]
        data = bytearray(victim.read_bytes())
        data[512 + 128 + 3] ^= 0x01  # the first sample's first token: a well-formed tar, the right size
        victim.write_bytes(bytes(data))
    with pytest.raises(StageError, match=r"^smoke: shard .*train-\d+.tar is corrupt: its samples' crc32 differs"):
        load_batches(damaged, 2, 2, seed=0, verify=False)
    with pytest.raises(CorruptShardError, match=r"crc32 differs"):
        next(iter(ShardLoader(damaged, batch_size=2, num_workers=2)))


def test_a_swapped_tokenizer_is_refused_when_the_loader_opens(damaged):
    from tokenizers import Tokenizer

    path = damaged / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(["<|swapped|>"])  # another tokenizer: ids would silently mean other tokens
    tok.save(str(path))
    with pytest.raises(DataPrepError, match=r"tokenizer.json was changed after sharding .* rebuild the shard set$"):
        ShardLoader(damaged, batch_size=2)


CLOSED = """
import sys
from data_prep.loader import ShardLoader

loader = ShardLoader(sys.argv[1], batch_size=2, num_workers=2)
stream = iter(loader)
for _ in range(4):  # part of an epoch: the workers are still prefetching
    next(stream)
if sys.argv[2] == "close":
    loader.close()
"""


@pytest.mark.parametrize("close", [True, False])
def test_closed_workers_leave_nothing_in_tmpdir(shard_set, tmp_path, close):
    """close() stops the workers through their own exit; left to the process's end, multiprocessing terminates them
    and each leaves its pymp-* directory in $TMPDIR (the reason the trainer closes its loader)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", CLOSED, str(shard_set), "close" if close else "leave"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    left = sorted(p.name for p in tmp.glob("pymp-*"))
    assert (left == []) if close else (len(left) >= 1), left  # the second: what close() prevents does happen
