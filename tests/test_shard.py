"""Sharding (data_prep): real tokenizers + real webdataset tars; determinism, cache, crash-safety, bad inputs."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from data_prep.build import build_shard_set
from data_prep.clean import VAL, clean_documents
from data_prep.config import ShardConfig
from data_prep.corpus import CorpusStats, resolve_inputs
from data_prep.errors import CorruptShardError, DataPrepError
from data_prep.manifest import check_files, load_manifest
from tests.helpers.shards import CORPUS, shard_cfg, tree_bytes

REPO = Path(__file__).resolve().parent.parent


def tar_samples(path: Path) -> list[tuple[str, np.ndarray]]:
    with tarfile.open(path) as tar:
        return [(m.name, np.load(io.BytesIO(tar.extractfile(m).read()))) for m in tar.getmembers()]


def visible(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if not p.name.startswith(".")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_shard_set(shard_cfg(tmp_path_factory.mktemp("shards")))


def test_shard_set_contents_and_manifest(built):
    m, d = built.manifest, built.shard_dir
    assert m == load_manifest(d) and m["dtype"] == "uint16" and m["seq_len"] == 16 and m["sample_tokens"] == 17
    stats = m["stats"]
    # records.jsonl: one copy of alpha.txt, a record without "text", a line that is not JSON; latin1.txt is not UTF-8
    assert stats["duplicates"] == 1 and stats["bad_records"] == 2 and stats["undecodable"] == 1
    assert (  # the line that is not JSON is among them: the fix names both causes
        "2 record(s) that are not JSON objects with a string data.text_field skipped: not in the shard set; set "
        "data.text_field to the records' text key, or repair the lines that are not JSON"
    ) in m["warnings"]
    assert stats["too_short"] == 1 and stats["documents_out"] == 4 + 12 + 1
    for split in ("train", "val"):
        s = m["splits"][split]
        assert len(s["shards"]) % 4 == 0 and s["samples"] == sum(e["samples"] for e in s["shards"])
        assert len({e["samples"] for e in s["shards"]}) == 1 and s["dropped_samples"] < len(s["shards"])
        assert s["samples"] * 17 <= s["token_stream"] < (s["samples"] + s["dropped_samples"] + 1) * 17
    check_files(d, m, "train", sha256=True)
    check_files(d, m, "val", sha256=True)
    rows = [arr for e in m["splits"]["train"]["shards"] for _, arr in tar_samples(d / e["name"])]
    tokens = np.concatenate(rows)
    assert all(r.dtype == np.uint16 and r.shape == (17,) for r in rows) and tokens.max() < m["vocab_size"]
    assert (tokens == m["eos_id"]).sum() > 0  # documents are separated by EOS
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(d / "tokenizer.json")).decode([int(t) for t in tokens[:200]])
    assert "shard" in text or "loader" in text or "token" in text


def test_split_by_document_hash_is_stable(tmp_path):
    """A document's split depends on its content only: adding documents never moves one across splits."""
    cfg = shard_cfg(tmp_path, val_fraction=0.3)
    small = resolve_inputs([str(CORPUS / "alpha.txt"), str(CORPUS / "records.jsonl")])
    both = resolve_inputs([str(CORPUS)])
    split_small = dict((t, s) for s, t in clean_documents(small, cfg, CorpusStats()))
    split_both = dict((t, s) for s, t in clean_documents(both, cfg, CorpusStats()))
    assert {VAL, "train"} == set(split_both.values())
    assert all(split_both[t] == s for t, s in split_small.items())


def test_byte_identical_across_runs_and_processes_then_cache_hit(tmp_path, built):
    a = build_shard_set(shard_cfg(tmp_path / "a", tokenize_processes=2))  # tokenizer threads, same bytes
    assert not a.cache_hit and a.shard_dir.name == built.shard_dir.name
    assert tree_bytes(a.shard_dir) == tree_bytes(built.shard_dir)
    before = {p.name: p.stat().st_mtime_ns for p in a.shard_dir.iterdir()}
    again = build_shard_set(shard_cfg(tmp_path / "a"))
    assert again.cache_hit and again.digest == a.digest
    assert {p.name: p.stat().st_mtime_ns for p in a.shard_dir.iterdir()} == before  # nothing rewritten
    changed = build_shard_set(shard_cfg(tmp_path / "a", seq_len=24))
    assert not changed.cache_hit and changed.shard_dir != a.shard_dir and a.shard_dir.is_dir()
    assert sorted(visible(tmp_path / "a")) == sorted([a.shard_dir.name, changed.shard_dir.name])


def test_gzip_jsonl_and_parquet_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [json.loads(line)["text"] for line in (CORPUS / "records.jsonl").read_text().splitlines()[:12]]
    (tmp_path / "in").mkdir()
    with gzip.open(tmp_path / "in" / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"content": t}) + "\n" for t in texts[:6])
    pq.write_table(pa.table({"content": texts[6:]}), tmp_path / "in" / "b.parquet")
    (tmp_path / "in" / "skip.bin").write_bytes(b"ignored by a directory walk")
    r = build_shard_set(shard_cfg(tmp_path / "out", [tmp_path / "in"], text_field="content"))
    assert r.manifest["stats"]["documents_out"] == 12 and r.manifest["source"]["files"] == 2
    with pytest.raises(DataPrepError, match=r"b.parquet: no column 'text'"):
        build_shard_set(shard_cfg(tmp_path / "out", [tmp_path / "in" / "b.parquet"]))


def test_killed_mid_write_leaves_nothing_visible_and_rerun_completes(tmp_path):
    out = tmp_path / "out"
    # Enough documents that writing outlasts the poll below by far: the kill must land mid-write.
    sets = [
        "max_documents=300",
        "vocab_size=512",
        "seq_len=16",
        "shard_size_mb=0.1",
        "shard_multiple=2",
        "tokenize_processes=2",
        "progress=false",
    ]
    cmd = [sys.executable, "-m", "data_prep", "shard", "--input", "stdlib", "--out", str(out)]
    proc = subprocess.Popen(
        cmd + [a for s in sets for a in ("--set", s)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + 90
    while time.time() < deadline and proc.poll() is None and not list(out.glob(".tmp-*/set/*train-*")):
        time.sleep(0.005)
    assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read().decode()[-500:]}"
    workers = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"worker processes outlived the killed builder: {alive}"  # they would hold the lock
    assert visible(out) == []  # nothing half-written visible
    leftovers = list(out.glob(".tmp-*"))
    assert leftovers
    cfg = ShardConfig.from_dict(
        {
            "inputs": ["stdlib"],
            "out_dir": str(out),
            **dict(
                (k, json.loads(v) if v[0].isdigit() or v == "false" else v) for k, v in (s.split("=") for s in sets)
            ),
        }
    )
    result = build_shard_set(cfg)
    assert not result.cache_hit and not any(p.exists() for p in leftovers)
    assert visible(out) == [result.shard_dir.name] and not list(out.glob(".tmp-*"))
    for split in ("train", "val"):
        check_files(result.shard_dir, result.manifest, split, sha256=True)
    again = subprocess.run(cmd + [a for s in sets for a in ("--set", s)], cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.startswith(f"cached {result.shard_dir}")


# --- bad inputs: each a one-line error or a counted skip ------------------------------------------------------


def one_line_error(cfg: ShardConfig) -> str:
    with pytest.raises(DataPrepError) as e:
        build_shard_set(cfg)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_empty_corpus_and_no_matching_files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("hi\n")
    assert one_line_error(shard_cfg(tmp_path / "o", [tmp_path / "empty.txt", tmp_path / "short.txt"])).startswith(
        "empty corpus: no document kept from 2 input file(s)"
    )
    nothing = tmp_path / "nothing-*.txt"
    assert one_line_error(shard_cfg(tmp_path / "o", [nothing])) == (
        f"input {nothing} matches nothing; fix the pattern or remove it from data.inputs"
    )
    assert "does not exist" in one_line_error(shard_cfg(tmp_path / "o", [tmp_path / "missing.txt"]))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "data.bin").write_bytes(b"x")
    assert one_line_error(shard_cfg(tmp_path / "o", [tmp_path / "d"])).startswith(
        f"input {tmp_path / 'd'} is a directory with no file a walk reads (.jsonl .md .parquet .rst .text .txt and "
    )
    # beside an input that reads, each of these lost its part of the corpus without a word
    for bad in (nothing, tmp_path / "d", tmp_path / "d*"):
        assert one_line_error(shard_cfg(tmp_path / "o", [CORPUS, bad])).startswith(f"input {bad} ")


def test_odd_input_names_are_read_as_named_or_refused(tmp_path):
    """A file named with glob characters is that file (it read `data1.txt`, or "no input files matched"); a pipe
    is refused in one line (it read "does not exist"); a name that is not UTF-8 too (a traceback from the cache key)."""
    from data_prep.corpus import resolve_inputs

    (tmp_path / "data[1].txt").write_text("the bracketed one")
    (tmp_path / "data1.txt").write_text("what the pattern matches")
    assert resolve_inputs([str(tmp_path / "data[1].txt")]) == [tmp_path / "data[1].txt"]
    assert resolve_inputs([str(tmp_path / "data[1]*.txt")]) == [tmp_path / "data1.txt"]  # a pattern still is one
    os.mkfifo(tmp_path / "pipe")
    assert one_line_error(shard_cfg(tmp_path / "o", [tmp_path / "pipe"])).startswith(
        f"input {tmp_path / 'pipe'} is not a regular file (a pipe, socket or device"
    )
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "ok.txt").write_text((CORPUS / "alpha.txt").read_text())
    with open(os.path.join(os.fsencode(tmp_path / "w"), b"caf\xe9.txt"), "w") as f:
        f.write("latin-1 name")
    assert one_line_error(shard_cfg(tmp_path / "o", [tmp_path / "w"])) == (
        f"input file {os.fsencode(tmp_path / 'w')!r}"[:-1] + "/caf\\xe9.txt' has a name that is not valid UTF-8; "
        "rename it (e.g. convmv -f latin1 -t utf-8) or remove it from data.inputs"
    )


def test_binary_file_is_a_counted_skip(tmp_path):
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 64)
    r = build_shard_set(shard_cfg(tmp_path / "o", [CORPUS, tmp_path / "blob.txt"]))
    assert r.manifest["stats"]["binary_files"] == 1
    assert "binary_files 1" in one_line_error(shard_cfg(tmp_path / "o", [tmp_path / "blob.txt"]))


def test_invalid_utf8_replace_or_skip(tmp_path):
    latin = [CORPUS / "latin1.txt", CORPUS / "alpha.txt"]
    texts = list(
        dict(
            (t, s)
            for s, t in clean_documents(
                resolve_inputs([str(p) for p in latin]), shard_cfg(tmp_path, val_fraction=0.0), CorpusStats()
            )
        )
    )
    assert len(texts) == 2 and any("\ufffd" in t for t in texts)  # both kept (replace mode), one repaired
    stats = CorpusStats()
    skipped = list(
        clean_documents(resolve_inputs([str(p) for p in latin]), shard_cfg(tmp_path, on_decode_error="skip"), stats)
    )
    assert len(skipped) == 1 and stats.undecodable == 1


def test_200mb_single_line_files_stream_in_bounded_memory(tmp_path):
    """A 200 MB one-line .txt and .jsonl are counted as too long without being loaded (RSS stays far below)."""
    chunk = b"a" * (1 << 20)
    with open(tmp_path / "big.txt", "wb") as txt, open(tmp_path / "big.jsonl", "wb") as jsonl:
        jsonl.write(b'{"text": "')
        for _ in range(200):
            txt.write(chunk)
            jsonl.write(chunk)
        jsonl.write(b'"}\n' + json.dumps({"text": "a normal record after it"}).encode() + b"\n")
    # VmHWM, not ru_maxrss: a forked child's ru_maxrss starts at its parent's peak.
    code = (
        "import re, sys\nfrom pathlib import Path\nfrom data_prep.corpus import CorpusStats, iter_documents\n"
        "s = CorpusStats()\ndocs = list(iter_documents([Path(p) for p in sys.argv[1:]], stats=s))\n"
        "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
        "print(len(docs), s.too_long, int(hwm) // 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "big.txt"), str(tmp_path / "big.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    docs, too_long, peak_mb = map(int, out)
    assert docs == 1 and too_long == 2 and peak_mb < 100, out


def test_seq_len_longer_than_corpus(tmp_path):
    msg = one_line_error(shard_cfg(tmp_path / "o", [CORPUS / "alpha.txt"], seq_len=100_000))
    assert msg.startswith("seq_len 100000 is longer than the whole corpus")


def test_tokenizer_vocab_must_fit_dtype(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    msg = one_line_error(shard_cfg(tmp_path / "o", tokenizer=str(tmp_path), token_dtype="uint16"))
    assert msg.startswith("tokenizer vocabulary 70002 does not fit token_dtype uint16")
    r = build_shard_set(shard_cfg(tmp_path / "o", tokenizer=str(tmp_path / "tokenizer.json"), seq_len=8))
    assert r.manifest["dtype"] == "uint32" and r.manifest["eos_token"] == "</s>"
    assert "no tokenizer.json" in one_line_error(shard_cfg(tmp_path / "o", tokenizer=str(tmp_path / "nope")))


def test_unwritable_output_dir(tmp_path):
    (tmp_path / "file").write_text("a file, not a directory")
    assert "is not writable" in one_line_error(shard_cfg(tmp_path / "file" / "out"))


def test_cli_error_is_one_line_exit_2(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "data_prep", "shard", "--input", str(tmp_path / "none*.txt"), "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: input ") and r.stderr.count("\n") == 1


def test_cli_takes_several_pairs_after_one_set(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep",
            "shard",
            "--input",
            "stdlib",
            "--out",
            str(tmp_path),
            "--set",
            "seq_len=1",
            "vocab_size=100",
            "--set",
            "max_documents=5",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: seq_len: 1 is out of range; vocab_size: 100 is out of range"
    )


def test_model_directory_tokenizer_uses_its_eos(tmp_path):
    """A local model directory (e.g. Qwen): tokenizer.json + tokenizer_config.json naming the EOS token."""
    from data_prep.tokenizer import train_bpe

    texts = [p.read_text() for p in sorted(CORPUS.glob("[abdg]*.txt"))]
    tok = train_bpe(iter(texts), 300)
    tok.add_special_tokens(["<|im_end|>"])
    (tmp_path / "model").mkdir()
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    r = build_shard_set(shard_cfg(tmp_path / "o", tokenizer=str(tmp_path / "model")))
    assert r.manifest["eos_token"] == "<|im_end|>" and r.manifest["eos_id"] == tok.token_to_id("<|im_end|>")
    assert (r.shard_dir / "tokenizer.json").read_text() == tok.to_str(pretty=True)
    # The shard set keeps the directory's tokenizer files as given (an HF export of a model trained on it copies
    # them), and tokenizer_config.json is part of the cache key: another EOS is another token stream.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (r.shard_dir / name).read_bytes() == (tmp_path / "model" / name).read_bytes()
    assert r.manifest["tokenizer"]["files"] == ["tokenizer.json", "tokenizer_config.json"]
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    r2 = build_shard_set(shard_cfg(tmp_path / "o", tokenizer=str(tmp_path / "model")))
    assert r2.shard_dir != r.shard_dir and r2.manifest["eos_token"] == "<|endoftext|>"
    # an EOS the vocabulary lacks: it once fell back to <|endoftext|> in silence, another token ending every document
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(DataPrepError, match=r"tokenizer_config.json: eos_token '</s>' is not in the tokenizer's vocab"):
        build_shard_set(shard_cfg(tmp_path / "o", tokenizer=str(tmp_path / "model")))
    # A tokenizer file named otherwise has no companions: the tokenizer_config.json beside it is not its (not in the
    # cache key, not copied), so it does not choose the EOS either — once it did, and a changed file hit the cache.
    (tmp_path / "model" / "tokenizer.json").rename(tmp_path / "model" / "my-tok.json")
    other = build_shard_set(shard_cfg(tmp_path / "o", tokenizer=str(tmp_path / "model" / "my-tok.json")))
    assert other.manifest["eos_token"] == "<|endoftext|>" and "files" not in other.manifest["tokenizer"]  # just itself


def stream_of(shard_dir: Path, split: str = "train") -> np.ndarray:
    """The split's token stream: every window of every shard, in key (stream) order, none left out."""
    m = load_manifest(shard_dir)
    samples = sorted(s for e in m["splits"][split]["shards"] for s in tar_samples(shard_dir / e["name"]))
    assert [int(k.split(".")[0]) for k, _ in samples] == list(range(len(samples)))  # no window left out
    return np.concatenate([ids for _, ids in samples])


@pytest.mark.parametrize("given", ["train", "model", "plain-eos"])
def test_special_token_strings_in_documents_are_text(tmp_path, given):
    """Found by a user: a document holding "<|endoftext|>" (the trained BPE's EOS) or a given tokenizer's "<|im_end|>"
    / "<|im_start|>" as text got that token's id mid-document: two EOS for one document (30 such files, 60 EOS), the
    model learning boundaries that are not there. Now the text is encoded as text (its round trip is exact) and each
    document has exactly one EOS, appended after it; also an EOS the tokenizer does not mark special ("plain-eos").
    The shard set's tokenizer.json is the one given, still matching special tokens in text for whoever loads it."""
    from tokenizers import Tokenizer

    from data_prep.tokenizer import train_bpe

    specials = ("<|endoftext|>", "<|im_end|>", "<|im_start|>", "<eos>")
    docs = [f"doc {i}: before {specials[i % 4]} after, and {specials[(i + 1) % 4]}x{i}" for i in range(30)]
    (tmp_path / "in").mkdir()
    for i, text in enumerate(docs):
        (tmp_path / "in" / f"{i:02d}.txt").write_text(text)
    kw = dict(seq_len=8, val_fraction=0, shard_multiple=1, shard_size_mb=1)  # one shard: every window in it
    if given != "train":
        tok = train_bpe(iter(docs), 300)
        tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
        tok.add_tokens(["<eos>"])  # an added token not marked special
        (tmp_path / "model").mkdir()
        tok.save(str(tmp_path / "model" / "tokenizer.json"))
        eos = "<|im_end|>" if given == "model" else "<eos>"
        (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
        kw["tokenizer"] = str(tmp_path / "model")
    r = build_shard_set(shard_cfg(tmp_path / "o", [tmp_path / "in"], **kw))
    m, eos_id = r.manifest, r.manifest["eos_id"]
    assert m["eos_token"] == {"train": "<|endoftext|>", "model": "<|im_end|>", "plain-eos": "<eos>"}[given]
    assert m["stats"]["documents_out"] == 30
    tok = Tokenizer.from_file(str(r.shard_dir / "tokenizer.json"))
    stream = stream_of(r.shard_dir)
    ends = np.flatnonzero(stream == eos_id)
    pieces = [tok.decode(stream[a + 1 : b].tolist()) for a, b in zip([-1, *ends[:-1]], ends)]  # between EOS
    tail = tok.decode(stream[ends[-1] + 1 :].tolist())  # the last document, cut where the stream's windows end
    assert pieces == docs[: len(pieces)] and len(pieces) >= len(docs) - 1 and docs[-1].startswith(tail)
    if given != "train":
        assert (r.shard_dir / "tokenizer.json").read_bytes() == (tmp_path / "model" / "tokenizer.json").read_bytes()
    assert tok.encode("<|endoftext|>").ids == [tok.token_to_id("<|endoftext|>")]  # the file's own behaviour, kept


# --- integrity and identity -----------------------------------------------------------------------------------


def test_tar_writer_is_byte_for_byte_webdatasets():
    """The shard writer's tars equal webdataset's own TarWriter output for the same samples (any count)."""
    import webdataset as wds

    from data_prep.tarfast import TarSamples

    rng = np.random.default_rng(0)
    for n, size in ((1, 1154), (40, 1154), (3, 512), (25, 200)):
        samples = [(f"{int(k):010d}", rng.bytes(size)) for k in rng.integers(0, 10**9, n)]
        theirs, ours = io.BytesIO(), io.BytesIO()
        with wds.TarWriter(theirs, user="llm", group="llm", mode=0o444, mtime=0) as w:
            for key, payload in samples:
                w.write({"__key__": key, "tokens.npy": payload})
        tar = TarSamples(ours, "tokens.npy", size, 10)
        for key, payload in samples:
            tar.write(key, payload)
        tar.close()
        assert ours.getvalue() == theirs.getvalue() and tar.offset == len(ours.getvalue())


def test_manifest_records_the_tokenizer_identity_and_every_shards_crc(built):
    from data_prep.tarfast import sample_crc32
    from data_prep.tokenizer import dir_identity

    tok = built.manifest["tokenizer"]
    assert tok["file_sha256"] == {"tokenizer.json": tok["sha256"]}
    assert tok["identity"] == dir_identity(built.shard_dir)
    for entry in built.manifest["splits"]["train"]["shards"]:
        with tarfile.open(built.shard_dir / entry["name"]) as tar:
            pairs = [(m.name.split(".")[0], tar.extractfile(m).read()) for m in tar.getmembers()]
        assert sample_crc32(pairs) == entry["samples_crc32"]


def verify_cli(shard_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "data_prep", "verify", str(shard_dir)], cwd=REPO, capture_output=True, text=True
    )


def test_verify_refuses_a_swapped_tokenizer_or_companion(tmp_path):
    """A tokenizer of the same size swapped in (or its tokenizer_config.json edited) after sharding: one line."""
    from data_prep.tokenizer import train_bpe

    texts = [p.read_text() for p in sorted(CORPUS.glob("[abdg]*.txt"))]
    (tmp_path / "model").mkdir()
    train_bpe(iter(texts), 300).save(str(tmp_path / "model" / "tokenizer.json"))
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    r = build_shard_set(shard_cfg(tmp_path / "o", tokenizer=str(tmp_path / "model")))
    assert set(r.manifest["tokenizer"]["file_sha256"]) == {"tokenizer.json", "tokenizer_config.json"}
    assert verify_cli(r.shard_dir).returncode == 0
    config = r.shard_dir / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": "</s>"}))
    out = verify_cli(r.shard_dir)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "tokenizer_config.json was changed after sharding" in out.stderr and "rebuild the shard set" in out.stderr
    config.write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    other = train_bpe(iter(texts[::-1] + ["another corpus entirely"]), 300)  # the same vocabulary size
    assert other.get_vocab_size() == 300
    other.save(str(r.shard_dir / "tokenizer.json"))
    out = verify_cli(r.shard_dir)
    assert out.returncode == 2 and "tokenizer.json was changed after sharding (sha256 " in out.stderr
    (r.shard_dir / "tokenizer.json").unlink()
    assert "tokenizer file tokenizer.json is missing" in verify_cli(r.shard_dir).stderr
    shutil.copy(tmp_path / "model" / "tokenizer.json", r.shard_dir / "tokenizer.json")
    assert verify_cli(r.shard_dir).returncode == 0
    (r.shard_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))  # added afterwards
    out = verify_cli(r.shard_dir)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "special_tokens_map.json was added after sharding (the manifest records tokenizer.json, " in out.stderr


def test_cache_key_is_the_inputs_contents_not_their_mtime(tmp_path):
    """A file rewritten with its size and mtime kept is read again and gives a new version; a file only touched
    (or copied) is read again, found equal, and the published set is reused untouched."""
    src = tmp_path / "in"
    shutil.copytree(CORPUS, src)
    first = build_shard_set(shard_cfg(tmp_path / "o", [src]))
    victim = src / "gamma.txt"
    st = victim.stat()
    text = victim.read_text()
    victim.write_text(text.replace("a", "b", 1) if "a" in text else "x" + text[1:])
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert victim.stat().st_size == st.st_size and victim.stat().st_mtime_ns == st.st_mtime_ns
    changed = build_shard_set(shard_cfg(tmp_path / "o", [src]))
    assert not changed.cache_hit and changed.shard_dir != first.shard_dir
    assert changed.manifest["source"]["fingerprint"] != first.manifest["source"]["fingerprint"]
    victim.write_text(text)  # back to the first contents, a new mtime
    before = {p.name: p.stat().st_mtime_ns for p in first.shard_dir.iterdir()}
    again = build_shard_set(shard_cfg(tmp_path / "o", [src]))
    assert again.cache_hit and again.shard_dir == first.shard_dir and again.digest == first.digest
    assert {p.name: p.stat().st_mtime_ns for p in first.shard_dir.iterdir()} == before
    assert build_shard_set(shard_cfg(tmp_path / "o", [src])).cache_hit  # now found without reading


def run_cli(*args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "data_prep", "shard", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
    )


SMALL = ["--set", "vocab_size=300", "seq_len=16", "shard_size_mb=0.02", "progress=false"]


def test_a_glob_through_a_symlink_loop_finishes_with_one_line(tmp_path):
    (tmp_path / "c" / "a").mkdir(parents=True)
    shutil.copy(CORPUS / "alpha.txt", tmp_path / "c" / "a" / "x.txt")
    shutil.copy(CORPUS / "beta.txt", tmp_path / "c" / "y.txt")
    os.symlink("..", tmp_path / "c" / "a" / "up")  # two loops: glob.glob's ** would walk them for ever
    os.symlink("../..", tmp_path / "c" / "a" / "up2")
    out = run_cli("--input", str(tmp_path / "c" / "**" / "*.txt"), "--out", str(tmp_path / "o"), *SMALL)
    lines = [line for line in out.stderr.splitlines() if "symlinked" in line]
    assert len(lines) == 1 and "2 skipped, e.g." in lines[0] and str(tmp_path / "c" / "a" / "up") in lines[0]
    assert out.returncode == 0, out.stderr
    assert load_manifest(out.stdout.split()[1])["source"]["files"] == 2  # "built <dir> …"


def test_mixed_encodings_get_one_line_with_the_count_and_first_file(tmp_path):
    shutil.copytree(CORPUS, tmp_path / "in")
    (tmp_path / "in" / "latin1-again.txt").write_bytes(b"caf\xe9 " * 10)
    for mode in ("replace", "skip"):
        out = run_cli("--input", str(tmp_path / "in"), "--out", str(tmp_path / mode), *SMALL, f"on_decode_error={mode}")
        assert out.returncode == 0, out.stderr
        lines = [line for line in out.stderr.splitlines() if "UTF-8" in line]
        assert len(lines) == 1, out.stderr
        assert f"2 document(s) are not valid UTF-8 (first in {tmp_path / 'in' / 'latin1-again.txt'})" in lines[0]
        assert ("skipped" if mode == "skip" else "U+FFFD") in lines[0]


def test_an_empty_val_split_gets_one_line(tmp_path):
    out = run_cli("--input", str(CORPUS), "--out", str(tmp_path / "a"), *SMALL, "val_fraction=0")
    assert out.returncode == 0 and "val split is empty (data.val_fraction is 0)" in out.stderr
    out = run_cli("--input", str(CORPUS / "alpha.txt"), "--out", str(tmp_path / "b"), *SMALL, "val_fraction=0.01")
    lines = [line for line in out.stderr.splitlines() if "val split is empty" in line]
    assert out.returncode == 0 and len(lines) == 1 and "raise data.val_fraction" in lines[0]


def test_files_and_directories_have_explicit_modes_whatever_the_umask(tmp_path):
    for umask in (0o000, 0o077):
        out = run_cli("--input", str(CORPUS), "--out", str(tmp_path / str(umask)), *SMALL, umask=umask)
        assert out.returncode == 0, out.stderr
        for p in [tmp_path / str(umask), *(tmp_path / str(umask)).rglob("*")]:
            mode = p.stat().st_mode & 0o777
            assert mode == (0o755 if p.is_dir() else 0o644), (umask, p, oct(mode))


def test_a_full_disk_is_one_line_and_the_rerun_resumes(tmp_path, monkeypatch, capsys):
    """ENOSPC while the shards are written (the 3rd file created): one line with the path and the errno, exit 2,
    nothing published; the rerun keeps the finished steps and completes."""
    import errno

    from data_prep import __main__ as cli
    from data_prep import fsio

    real, calls = fsio.create, []

    def full(path, *a, **kw):
        calls.append(path)
        if path.name.startswith(".train-") and len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *a, **kw)

    argv = ["shard", "--input", str(CORPUS), "--out", str(tmp_path / "o"), *SMALL, "shard_multiple=4"]
    monkeypatch.setattr(fsio, "create", full)
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("WARNING")]
    assert len(err) == 1 and "No space left on device (ENOSPC)" in err[0] and ".partial" in err[0]
    assert visible(tmp_path / "o") == []
    monkeypatch.setattr(fsio, "create", real)
    assert cli.main(argv) == 0
    assert len(visible(tmp_path / "o")) == 1 and not list((tmp_path / "o").glob(".tmp-*"))


def test_a_full_disk_at_fsync_names_the_output_directory(tmp_path, monkeypatch, capsys):
    """ENOSPC from a flush/fsync carries no file name (a real full tmpfs gave "error: No space left on device"): the
    line names the output directory and says to free space, not to fix permissions."""
    import errno

    from data_prep import __main__ as cli
    from data_prep import partition

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(partition.os, "fsync", full)
    assert cli.main(["shard", "--input", str(CORPUS), "--out", str(tmp_path / "o"), *SMALL]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("WARNING")]
    assert err == [
        f"error: under {tmp_path / 'o'}: No space left on device (ENOSPC); free space there, then rerun (finished "
        "steps are kept)"
    ]


@pytest.mark.parametrize("threads", [1, 2])
def test_encoding_leaves_tokenizers_parallelism_as_it_was(monkeypatch, threads):
    """encode_stream turns tokenizers' own thread pool off while it runs, then restores the variable: a later encode in
    the same process (bench_data's baseline, an evaluation) uses every core again."""
    from data_prep.tokenizer import encode_stream, train_bpe

    tok = train_bpe(iter(["def f(x):\n    return x + 1\n"] * 50), 300)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    seen = []
    for key, ids, lengths in encode_stream(
        tok, 0, np.dtype("uint16"), [(i, ["x = 1", "y = 2"]) for i in range(3)], threads
    ):
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        assert len(lengths) == 2 and ids.size == lengths.sum()
    assert seen == ["false"] * 3 and "TOKENIZERS_PARALLELISM" not in os.environ
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    list(encode_stream(tok, 0, np.dtype("uint16"), [(0, ["z = 3"])], threads))
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"


# --- found by a user trial: how inputs were read, damaged sets, dropped data each named in one line -------------


def test_the_same_bytes_as_json_then_jsonl_are_two_versions(tmp_path, caplog):
    """data.json is read as ONE text document (and says so); the same bytes renamed data.jsonl are a document a
    line: another version, not a cache hit of the .json's set."""
    texts = [json.loads(line)["text"] for line in (CORPUS / "records.jsonl").read_text().splitlines()[:12]]
    (tmp_path / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        as_json = build_shard_set(shard_cfg(tmp_path / "o", [tmp_path / "data.json"], val_fraction=0))
    lines = [r.getMessage() for r in caplog.records if "is read as one text document" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path / "data.json") in lines[0] and "rename JSON Lines to .jsonl" in lines[0]
    assert as_json.manifest["stats"]["documents_out"] == 1
    (tmp_path / "data.json").rename(tmp_path / "data.jsonl")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        as_jsonl = build_shard_set(shard_cfg(tmp_path / "o", [tmp_path / "data.jsonl"], val_fraction=0))
    assert not as_jsonl.cache_hit and as_jsonl.shard_dir != as_json.shard_dir
    assert as_jsonl.manifest["stats"]["documents_out"] == 12 and as_json.shard_dir.is_dir()
    assert not [r for r in caplog.records if "is read as one text document" in r.getMessage()]


@pytest.mark.parametrize(("damage", "touch"), [("remove", False), ("truncate", False), ("remove", True)])
def test_a_damaged_published_set_is_moved_aside_and_rebuilt(tmp_path, caplog, damage, touch):
    """A published set with a shard removed (or truncated) is no cache hit, found by the build key (or, inputs
    touched, by its contents): the rerun moves it to <version>.damaged-<time> with one warning line and writes the
    same version again, byte for byte."""
    (tmp_path / "in").mkdir()
    for name in ("alpha.txt", "beta.txt"):
        shutil.copy(CORPUS / name, tmp_path / "in" / name)
    cfg = shard_cfg(tmp_path / "o", [tmp_path / "in"])
    first = build_shard_set(cfg)
    original = tree_bytes(first.shard_dir)
    victim = first.shard_dir / first.manifest["splits"]["train"]["shards"][0]["name"]
    if damage == "remove":
        victim.unlink()
    else:
        os.truncate(victim, victim.stat().st_size // 2)
    if touch:  # a new ctime: another build key, the same contents
        os.utime(tmp_path / "in" / "alpha.txt")
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        again = build_shard_set(cfg)
    aside = list((tmp_path / "o").glob(f"{first.shard_dir.name}.damaged-*"))
    lines = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(aside) == 1 and len(lines) == 1 and "\n" not in lines[0] and f"moved to {aside[0]}" in lines[0]
    assert not again.cache_hit and again.shard_dir == first.shard_dir and again.digest == first.digest
    for split in again.manifest["splits"]:
        check_files(again.shard_dir, again.manifest, split, sha256=True)
    assert tree_bytes(again.shard_dir) == original
    assert build_shard_set(cfg).cache_hit  # whole again: found, not moved aside a second time
    assert len(list((tmp_path / "o").glob("*.damaged-*"))) == 1


def test_inputs_dropped_whole_each_get_one_warning_naming_the_fix(tmp_path, caplog):
    """A UTF-16 file (binary skip), a file longer than data.max_chars and a record without data.text_field: each
    kind one line in the manifest's warnings, saying what to do; the log names each binary file."""
    (tmp_path / "in").mkdir()
    shutil.copy(CORPUS / "alpha.txt", tmp_path / "in" / "alpha.txt")
    (tmp_path / "in" / "utf16.txt").write_bytes((CORPUS / "beta.txt").read_text().encode("utf-16"))
    (tmp_path / "in" / "long.txt").write_text("word " * 1000)  # 5000 characters
    records = [{"content": "a record with its text under another key"}, {"text": (CORPUS / "gamma.txt").read_text()}]
    (tmp_path / "in" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        r = build_shard_set(shard_cfg(tmp_path / "o", [tmp_path / "in"], max_chars=4000))
    said = [m for m in caplog.messages if m.startswith("skipping binary input ")]
    assert said == [f"skipping binary input {tmp_path / 'in' / 'utf16.txt'}: NUL bytes in its first 8192 bytes"]
    stats = r.manifest["stats"]
    assert stats["binary_files"] == 1 and stats["too_long"] == 1 and stats["bad_records"] == 1
    for fix in ("convert them to UTF-8", "raise data.max_chars", "set data.text_field"):
        lines = [w for w in r.manifest["warnings"] if fix in w]
        assert len(lines) == 1 and lines[0].startswith("1 ") and "not in the shard set" in lines[0], fix


def test_windows_left_out_by_equal_shards_warn_naming_shard_size_mb(tmp_path):
    """16 shards of 6 samples (a multiple of 8 shards of ~10 samples) leave 12 of 108 training windows (11 %) out:
    one line says to raise data.shard_size_mb; twice the shard size leaves 4 (under 5 %) out and says nothing."""
    inputs = [CORPUS / "alpha.txt", CORPUS / "beta.txt"]
    few = build_shard_set(shard_cfg(tmp_path / "a", inputs, shard_size_mb=0.01, shard_multiple=8))
    train = few.manifest["splits"]["train"]
    assert train["dropped_samples"] * 20 > train["samples"] + train["dropped_samples"]
    lines = [w for w in few.manifest["warnings"] if "data.shard_size_mb" in w]
    assert len(lines) == 1 and lines[0].startswith(f"train: {train['dropped_samples']} of ")
    ordinary = build_shard_set(shard_cfg(tmp_path / "b", inputs, shard_size_mb=0.02, shard_multiple=8))
    assert 0 < ordinary.manifest["splits"]["train"]["dropped_samples"]
    assert not [w for w in ordinary.manifest["warnings"] if "shard_size_mb" in w or "left out" in w]


def test_a_directory_input_names_its_symlinked_subdirectories(tmp_path, caplog):
    """A directory walk does not follow a symlinked subdirectory: one line names the count and the first."""
    (tmp_path / "c").mkdir()
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(CORPUS / "alpha.txt", tmp_path / "c" / "alpha.txt")
    shutil.copy(CORPUS / "gamma.txt", tmp_path / "c" / "gamma.txt")
    shutil.copy(CORPUS / "beta.txt", tmp_path / "elsewhere" / "beta.txt")
    os.symlink(tmp_path / "elsewhere", tmp_path / "c" / "linked")
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        r = build_shard_set(shard_cfg(tmp_path / "o", [tmp_path / "c"]))
    lines = [x.getMessage() for x in caplog.records if "symlinked" in x.getMessage()]
    assert len(lines) == 1 and r.manifest["source"]["files"] == 2
    assert f"symlinked directories are not followed (1 skipped, e.g. {tmp_path / 'c' / 'linked'})" in lines[0]


def test_shard_errors_name_the_fix(tmp_path):
    """An empty corpus says which setting would have kept the documents; a damaged shard says to rerun the stage."""
    (tmp_path / "long.txt").write_text("word " * 1000)
    msg = one_line_error(shard_cfg(tmp_path / "o", [tmp_path / "long.txt"], max_chars=4000))
    assert msg.startswith("empty corpus") and "too_long 1" in msg and "raise data.max_chars" in msg
    (tmp_path / "short.txt").write_text("hi\n")
    assert "lower data.min_chars" in one_line_error(shard_cfg(tmp_path / "o", [tmp_path / "short.txt"]))
    r = build_shard_set(shard_cfg(tmp_path / "o", [CORPUS / "alpha.txt", CORPUS / "beta.txt"]))
    first, second = (r.shard_dir / e["name"] for e in r.manifest["splits"]["train"]["shards"][:2])
    second.write_bytes(second.read_bytes()[::-1])  # the same size, other bytes
    with pytest.raises(CorruptShardError, match="sha256 differs .*rerun the shard stage"):
        check_files(r.shard_dir, r.manifest, "train", sha256=True)
    os.truncate(first, 1024)
    with pytest.raises(CorruptShardError, match="is truncated or altered.*; rerun the shard stage"):
        check_files(r.shard_dir, r.manifest, "train")
    first.unlink()
    with pytest.raises(CorruptShardError, match="is missing; rerun the shard stage"):
        check_files(r.shard_dir, r.manifest, "train")


def test_a_bpe_smaller_than_asked_is_said(tmp_path):
    """data.vocab_size 4000 on three short files: the BPE runs out of merges long before, and the model is sized to
    the smaller vocabulary; the manifest says so and names the fix (an ordinary build: nothing)."""
    inputs = [CORPUS / "alpha.txt", CORPUS / "beta.txt", CORPUS / "gamma.txt"]
    r = build_shard_set(shard_cfg(tmp_path / "a", inputs, vocab_size=4000))
    built = r.manifest["vocab_size"]
    lines = [w for w in r.manifest["warnings"] if "data.vocab_size" in w]
    assert built < 4000 and lines == [
        f"the BPE has {built} tokens, fewer than data.vocab_size 4000: the corpus holds no more merges (the model's "
        "vocabulary is the smaller one); add text or lower data.vocab_size"
    ], r.manifest["warnings"]
    full = build_shard_set(shard_cfg(tmp_path / "b", inputs, vocab_size=built))
    assert not [w for w in full.manifest["warnings"] if "data.vocab_size" in w], full.manifest["warnings"]


def test_a_utf8_bom_is_an_encoding_signature_not_a_record_or_a_character(tmp_path):
    """Files saved by Windows tools start with a UTF-8 byte-order mark: a .jsonl's first record was a counted bad
    record (json.loads refuses the BOM) and a text file's first character was U+FEFF. The reader drops it; the file's
    digest says so (`bom:`), so a set built before this is not reused for it, and every other file's is unchanged."""
    from data_prep.corpus import iter_documents, stat_key

    texts = [json.loads(line)["text"] for line in (CORPUS / "records.jsonl").read_text().splitlines()[:12]]
    body = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + body)
    (tmp_path / "plain.jsonl").write_bytes(body)
    with gzip.open(tmp_path / "bom.txt.gz", "wb") as f:
        f.write(b"\xef\xbb\xbfdef f():\n    return 1\n")
    files = [tmp_path / n for n in ("bom.jsonl", "plain.jsonl", "bom.txt.gz")]
    stats, digests = CorpusStats(), []
    docs = list(iter_documents(files, stats=stats, digests=digests))
    assert docs == texts + texts + ["def f():\n    return 1\n"] and stats.bad_records == 0
    assert [d.split(":")[:-1] for d in digests] == [["jsonl", "bom"], ["jsonl"], ["bom"]]
    # the lookup key: marked for a BOM file only (a build from before the reader dropped it is not found)
    st = (tmp_path / "plain.jsonl").stat()
    plain = stat_key([tmp_path / "plain.jsonl"], [st])
    (tmp_path / "plain.jsonl").write_bytes(b"\xef\xbb\xbf" + body[3:])  # a BOM now
    assert stat_key([tmp_path / "plain.jsonl"], [st]) != plain  # the same stat: only the mark differs
    built = build_shard_set(shard_cfg(tmp_path / "o", [tmp_path / "bom.jsonl"], val_fraction=0))
    assert built.manifest["stats"]["documents_out"] == 12 and built.manifest["stats"]["bad_records"] == 0


def test_short_documents_dropped_in_bulk_are_said(tmp_path):
    """900 of 1,000 records under data.min_chars were dropped with status ok and no word (only the counter knew);
    a few (an empty __init__.py of the demo corpus) stay unsaid."""
    (tmp_path / "in").mkdir()
    long = (CORPUS / "alpha.txt").read_text()
    records = [{"text": f"tiny {i:06d}"} for i in range(900)] + [{"text": f"{i} {long}"} for i in range(100)]
    (tmp_path / "in" / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    r = build_shard_set(shard_cfg(tmp_path / "o", [tmp_path / "in"]))
    assert r.manifest["stats"]["too_short"] == 900
    assert [w for w in r.manifest["warnings"] if "min_chars" in w] == [
        "900 of 1000 document(s) shorter than data.min_chars (16) skipped: not in the shard set; lower "
        "data.min_chars to keep them"
    ]
    (tmp_path / "in" / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[890:]))
    few = build_shard_set(shard_cfg(tmp_path / "o2", [tmp_path / "in"]))
    assert few.manifest["stats"]["too_short"] == 10 and not [w for w in few.manifest["warnings"] if "min_chars" in w]
