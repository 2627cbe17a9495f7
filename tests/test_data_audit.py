"""Audit findings on data_prep and bench/run_all.py: a lone surrogate escape, a damaged .gz, an over-long emoji
record, what a directory walk passes by, a malformed tokenizer_config.json, identical builds at once, settings a
shard build does not use, a relative glob read from the repository, and run_all's interrupted, refused and kept
runs."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.manifest import digest, load_manifest

REPO = Path(__file__).resolve().parent.parent


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def _docs(n: int, tag: str = "doc") -> list[str]:
    return [f"{tag} number {i}: the quick brown fox jumps over the lazy dog {i * 7919}" for i in range(n)]


# --- corpus reading --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("on_error", ["replace", "skip"])
def test_a_lone_surrogate_escape_is_undecodable_text_not_a_crash(tmp_path, on_error):
    from data_prep.corpus import CorpusStats, iter_documents

    path = tmp_path / "a.jsonl"
    path.write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in _docs(3)) + '{"text": "half an emoji \\ud83d here"}\n',
        encoding="utf-8",
    )
    stats = CorpusStats()
    docs = list(iter_documents([path], on_decode_error=on_error, stats=stats))
    for d in docs:
        d.encode("utf-8")  # every text can be written (tokenised, trained on)
    assert stats.undecodable == 1 and stats.first_undecodable == str(path)
    if on_error == "skip":
        assert len(docs) == 3
    else:
        assert len(docs) == 4 and docs[-1].startswith("half an emoji \ufffd") and docs[-1].endswith(" here")


def test_a_lone_surrogate_builds_with_the_undecodable_warning(tmp_path, caplog):
    from data_prep.build import build_shard_set
    from tests.helpers.shards import shard_cfg

    corpus = tmp_path / "c"
    corpus.mkdir()
    _jsonl(corpus / "a.jsonl", _docs(40))
    with open(corpus / "a.jsonl", "a", encoding="utf-8") as f:
        f.write('{"text": "a broken \\udc00 pair in a record long enough to be kept"}\n')
    result = build_shard_set(shard_cfg(tmp_path / "out", [corpus], shard_multiple=1))
    assert result.manifest["stats"]["undecodable"] == 1
    assert any(f"not valid UTF-8 (first in {corpus / 'a.jsonl'})" in w for w in result.manifest["warnings"])


def test_a_damaged_gz_is_one_line_naming_the_file(tmp_path):
    from data_prep.corpus import iter_documents, stat_key
    from data_prep.errors import DataPrepError

    raw = bytearray(gzip.compress("".join(f"line {i} of some text\n" for i in range(2000)).encode(), mtime=0))
    raw[12] ^= 0xFF  # inside the deflate stream: zlib.error ("invalid code lengths set"), not a cut file
    path = tmp_path / "b.txt.gz"
    path.write_bytes(bytes(raw))
    assert stat_key([path])  # the BOM sniff of the build key reads the damaged start too
    with pytest.raises(DataPrepError, match=r"input .*b\.txt\.gz is truncated or corrupt after 0 documents \(zlib"):
        list(iter_documents([path]))


def test_an_emoji_record_within_max_chars_is_read(tmp_path):
    from data_prep.corpus import CorpusStats, iter_documents

    emoji = "\U0001f600" * 800  # json.dumps: 12 bytes each (\ud83d\ude00), 9602 bytes for 800 characters
    path = _jsonl(tmp_path / "e.jsonl", [emoji, "short"])
    stats = CorpusStats()
    assert list(iter_documents([path], max_chars=1000, stats=stats)) == [emoji, "short"]
    assert stats.too_long == 0


def test_a_walk_names_the_hidden_entries_and_dangling_links_it_skips(tmp_path, caplog):
    from data_prep.corpus import resolve_inputs

    root = tmp_path / "corpus"
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "notes.txt").write_text("not read")
    (root / ".draft.txt").write_text("not read")
    (root / "a.txt").write_text("read")
    (root / "t.csv").write_text("a,b\n")
    os.symlink(tmp_path / "gone.txt", root / "b.txt")
    caplog.set_level("WARNING")
    assert resolve_inputs([str(root)]) == [root / "a.txt"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"input {root}:")]
    assert lines == [
        f"input {root}: 1 file(s) not read (.csv 1; first {root / 't.csv'}): a directory walk reads .jsonl .md "
        ".parquet .rst .text .txt (and their .gz); name other text files directly or with a glob, convert tables to "
        ".jsonl or .parquet",  # the suffix count as before
        f"input {root}: a directory walk skipped 2 hidden entries (names starting with '.'; first "
        f"{root / '.draft.txt'}): give them as inputs of their own to include them; and 1 dangling symlink(s) (first "
        f"{root / 'b.txt'} -> {tmp_path / 'gone.txt'}): fix or remove the links",
    ], lines


# --- the tokenizer and the CLI ---------------------------------------------------------------------------------


def _tokenizer_dir(tmp_path: Path) -> Path:
    from data_prep.tokenizer import train_bpe

    tk = tmp_path / "tok"
    tk.mkdir()
    train_bpe(_docs(50, "tok"), 300).save(str(tk / "tokenizer.json"))
    return tk


def _corpus(tmp_path: Path, files: int = 4) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(files):
        (corpus / f"f{i:03d}.txt").write_text("\n".join(_docs(20, f"file {i}")) * 3)
    return corpus


def _shard(*args: str) -> list[str]:
    return ["shard", *args, "--set", "seq_len=16", "shard_size_mb=0.01", "tokenize_processes=1", "progress=false"]


@pytest.mark.parametrize(
    "text, why", [('{"eos_token": ', "Expecting value at line 1 column 15"), ('["eos"]', "it holds an array")]
)
def test_a_malformed_tokenizer_config_is_one_line_and_leaves_no_build(tmp_path, capsys, text, why):
    from data_prep.__main__ import main

    tk = _tokenizer_dir(tmp_path)
    (tk / "tokenizer_config.json").write_text(text)
    out = tmp_path / "out"
    assert main(_shard("--input", str(_corpus(tmp_path)), "--out", str(out), "--set", f"tokenizer={tk}")) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {tk / 'tokenizer_config.json'}: not a JSON object ({why}); fix it or set data.eos_token"), (
        err
    )
    assert not list(out.glob(".tmp-*"))


def test_unused_settings_are_said_and_vocab_size_beside_a_given_tokenizer_keys_nothing(tmp_path, capsys, caplog):
    from data_prep.__main__ import main

    tk, corpus, out = _tokenizer_dir(tmp_path), _corpus(tmp_path), tmp_path / "out"
    caplog.set_level("WARNING")
    given = ("--input", str(corpus), "--out", str(out), "--set", f"tokenizer={tk}")
    assert main(_shard(*given, "--set", "vocab_size=9999", "loader_workers=8", "prefetch_factor=9")) == 0
    assert capsys.readouterr().out.startswith("built ")
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("data.vocab_size 9999 is not used: the given tokenizer") for m in said), said
    assert any(m.startswith("loader_workers=8, prefetch_factor=9: the loader's setting(s)") for m in said), said
    assert main(_shard(*given)) == 0  # vocab_size changed no byte: the same set, found
    assert capsys.readouterr().out.startswith(f"cached {out}/shards-")
    # built afresh elsewhere, without it: the same bytes and version (its later steps keyed the layout's seed and the
    # version with it, and the manifest recorded the unused value)
    (first,) = out.glob("shards-*")
    other = tmp_path / "out2"
    assert main(_shard("--input", str(corpus), "--out", str(other), "--set", f"tokenizer={tk}")) == 0
    (second,) = other.glob("shards-*")
    assert second.name == first.name and digest(second) == digest(first)
    assert "vocab_size" not in load_manifest(first)["config"]


# --- identical builds at once ----------------------------------------------------------------------------------


def test_identical_builds_at_once_wait_and_find_the_published_set(tmp_path):
    corpus = _corpus(tmp_path, files=80)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "data_prep", *_shard("--input", str(corpus), "--out", str(out))]
    cmd += ["--set", "partitions=2", "vocab_size=300"]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "abc"]
    done = [(p.wait(timeout=600), p.stdout.read(), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert all(rc == 0 for rc, _, _ in done), [err.strip().splitlines()[-1:] for _, _, err in done]
    firsts = sorted(o.split()[0] for _, o, _ in done)
    assert firsts == ["built", "cached", "cached"], firsts
    assert len({o.split()[1] for _, o, _ in done}) == 1
    assert not list(out.glob(".tmp-*"))


def test_the_steps_of_a_build_another_one_published_return_the_published_set(tmp_path):
    from data_prep.build import build_shard_set, publish
    from data_prep.job import Job, prepare
    from data_prep.layout import run_layout
    from data_prep.partition import run_partition
    from data_prep.writer import run_write
    from tests.helpers.shards import shard_cfg

    cfg = shard_cfg(tmp_path / "out", [_corpus(tmp_path)], partitions=2)
    job = prepare(cfg).job  # the DAG's first task, then the CLI builds the same inputs to the end
    run_partition(job, 0)
    result = build_shard_set(cfg)
    assert not result.cache_hit and not job.dir.exists()
    assert Job.load(job.dir).published == result.shard_dir
    assert run_partition(job, 1)["published"] == str(result.shard_dir)
    assert run_layout(job)["published"] is True
    assert run_write(job, 0)["published"] == str(result.shard_dir)
    found = publish(Job.load(job.dir))
    assert found.cache_hit and found.shard_dir == result.shard_dir and found.digest == result.digest
    assert not list((tmp_path / "out").glob(".tmp-*"))


# --- inputs read from the repository ----------------------------------------------------------------------------


def test_a_relative_glob_missing_at_the_repository_but_matching_here_gets_the_hint(tmp_path, monkeypatch):
    from data_prep.config import repo_input
    from data_prep.errors import DataPrepError

    (tmp_path / "audit-only-corpus").mkdir()
    (tmp_path / "audit-only-corpus" / "a.txt").write_text("text")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataPrepError) as e:
        repo_input("audit-only-corpus/*.txt")
    assert str(e.value) == (
        f"audit-only-corpus/*.txt is read from the repository root ({REPO / 'audit-only-corpus/*.txt'}, which "
        f"matches nothing), not the working directory; give the absolute pattern {tmp_path}/audit-only-corpus/*.txt"
    )
    assert repo_input("nowhere-at-all/*.txt") == str(REPO / "nowhere-at-all/*.txt")  # no match anywhere: read later


def test_a_relative_input_that_exists_both_here_and_at_the_repository_is_refused_as_ambiguous(tmp_path, monkeypatch):
    """`docs` typed in a directory that has its own docs/: the repository's was read, silently (15 pages of this
    project instead of the user's corpus); both exist, so the user names one. From the repository root, as the
    pipeline itself runs, the two are one and nothing changes."""
    from data_prep.config import repo_input
    from data_prep.errors import DataPrepError

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "mine.md").write_text("text")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataPrepError) as e:
        repo_input("docs")
    assert str(e.value) == (
        f"docs is read from the repository root ({REPO / 'docs'}), and the working directory has its own "
        f"({tmp_path / 'docs'}); give the absolute path of the one you mean"
    )
    with pytest.raises(DataPrepError, match=r"docs/\*.md is read from the repository root .* which matches files"):
        repo_input("docs/*.md")
    monkeypatch.chdir(REPO)
    assert repo_input("docs") == str(REPO / "docs") and repo_input("docs/*.md") == str(REPO / "docs/*.md")


# --- bench/run_all.py ------------------------------------------------------------------------------------------

QUIET = {"load1_mean": 1.5, "cpus": 2, "loaded": False, "steal_pct": 0.0}
BUSY = {"load1_mean": 19.0, "cpus": 2, "loaded": True, "steal_pct": 1.0}


def _run_all(tmp_path, monkeypatch, benches: dict[str, str], load: dict = QUIET):
    """bench/run_all.py pointed at a scratch bench/ holding `benches` (name → module source) and docs file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_all_audit", REPO / "bench" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    bench = tmp_path / "bench"
    bench.mkdir(exist_ok=True)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    shutil.rmtree(bench / "__pycache__", ignore_errors=True)
    for name, source in benches.items():
        (bench / f"bench_{name}.py").write_text(source)
    docs = tmp_path / "benchmarks.md"
    if not docs.exists():
        docs.write_text(f"# B\n\n{run_all.BEGIN}\n{run_all.END}\n")
    for name, path in (("HERE", bench), ("RESULTS", bench / "results.json"), ("RESULTS_MD", bench / "results.md")):
        monkeypatch.setattr(run_all, name, path)
    monkeypatch.setattr(run_all, "DOCS", docs)
    monkeypatch.setattr(run_all, "DOC_FIGURES", {"X": ["a.v"]})
    monkeypatch.setattr(run_all.HostLoad, "result", lambda self: dict(load))
    return run_all, bench / "results.json"


def test_a_bench_that_exits_is_its_error_and_the_others_figures_are_written(tmp_path, monkeypatch):
    benches = {"a": "def run():\n    return {'a.v': 1}\n", "b": "def run():\n    raise SystemExit(3)\n"}
    benches["c"] = "def run():\n    return {'c.v': 2}\n"
    run_all, results = _run_all(tmp_path, monkeypatch, benches)
    assert run_all.main([]) == 1
    doc = json.loads(results.read_text())
    assert doc["figures"] == {"a.v": 1, "c.v": 2} and doc["errors"] == {"b": "SystemExit: 3"}


@pytest.mark.parametrize("how", ["raise KeyboardInterrupt", "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)"])
def test_an_interrupted_run_writes_what_finished_and_exits_non_zero(tmp_path, monkeypatch, how):
    import signal

    before = signal.getsignal(signal.SIGTERM)
    benches = {"a": "def run():\n    return {'a.v': 1}\n", "c": "def run():\n    return {'c.v': 2}\n"}
    benches["b"] = f"import os, signal, time\n\n\ndef run():\n    {how}\n"
    run_all, results = _run_all(tmp_path, monkeypatch, benches)
    assert run_all.main([]) == 130
    doc = json.loads(results.read_text())
    assert doc["figures"] == {"a.v": 1} and doc["errors"]["b"].startswith("interrupted (")  # c never ran
    assert signal.getsignal(signal.SIGTERM) == before


def test_docs_beside_bench_names_or_force_is_refused(tmp_path, monkeypatch, capsys):
    run_all, results = _run_all(tmp_path, monkeypatch, {"a": "def run():\n    return {'a.v': 1}\n"})
    results.write_text(json.dumps({"figures": {}, "provenance": {}, "errors": {}}))
    docs = run_all.DOCS.read_text()
    assert run_all.main(["nosuchbench", "--docs"]) == 2
    assert run_all.main(["--docs", "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("run_all: --docs runs no bench, nosuchbench does nothing beside it;")
    assert err[1].startswith("run_all: --docs runs no bench, --force does nothing beside it;")
    assert run_all.DOCS.read_text() == docs and not run_all.RESULTS_MD.exists()


def test_a_loaded_run_whose_figures_are_kept_keeps_their_timing_date_and_machine(tmp_path, monkeypatch):
    run_all, results = _run_all(tmp_path, monkeypatch, {"a": "def run():\n    return {'a.v': 1}\n"})
    assert run_all.main(["a"]) == 0
    doc = json.loads(results.read_text())
    old = {"seconds": {"a": 999.0}, "date": "2000-01-01", "machine": {"platform": "old"}}
    results.write_text(json.dumps({**doc, **old}))
    run_all, results = _run_all(tmp_path, monkeypatch, {"a": "def run():\n    return {'a.v': 2}\n"}, BUSY)
    assert run_all.main(["a"]) == 3
    kept = json.loads(results.read_text())
    assert kept["figures"]["a.v"] == 1 and {k: kept[k] for k in old} == old
    assert run_all.main(["a", "--force"]) == 0
    forced = json.loads(results.read_text())
    assert forced["figures"]["a.v"] == 2 and forced["seconds"]["a"] != 999.0 and forced["date"] != "2000-01-01"
