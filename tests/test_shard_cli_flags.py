"""`python -m tasks shard` refuses, in one line, a flag or an explicit data.* value that cannot apply to what it does:
--manifest-digest without --shard-dir (it checks an adopted set only), --reduce / --publish-only with --shard-dir
(they build), and, when adopting, a data.* key that decides a set's contents and differs from the adopted set's
manifest (it was accepted and ignored; smoke then refused the seq_len recorded for the run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from data_prep.layout import ended_line
from data_prep.manifest import digest
from data_prep.testing import tiny_shard_set
from tasks.cli import main
from tests.helpers import REPO


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory) -> Path:
    """seq_len 32, vocabulary 512 (a BPE trained on 40 stdlib files); a val split big enough for demo-continuation."""
    return tiny_shard_set(tmp_path_factory.mktemp("data"), val_fraction=0.4)


@pytest.fixture(autouse=True)
def _var(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))


def shard(tmp_path, capsys, *args, run: str = "") -> tuple[int, list[str]]:
    """The shard stage as `python -m tasks shard --config ci-tiny …` runs it, in a new run directory (`run`, else
    run-0, run-1, …: a directory remembers its first stage's --set values): its exit code and error lines."""
    run_dir = tmp_path / run if run else next(p for n in range(100) if not (p := tmp_path / f"run-{n}").exists())
    rc = main(["shard", "--config", "ci-tiny", "--no-tracking", "--run-dir", str(run_dir), *args])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, [ln for ln in err if ln.startswith("error: ")]


def test_a_manifest_digest_without_shard_dir_is_refused(tmp_path, capsys, shard_set):
    """--manifest-digest checks an adopted set only: a build never read it, and exited 0 with another digest."""
    rc, err = shard(tmp_path, capsys, "--manifest-digest", "deadbeef", "--set", "data.inputs=[corp2]")
    assert rc == 2 and err == [
        "error: --manifest-digest checks a set adopted with --shard-dir, and none is given (this run builds a set "
        "from data.inputs); add --shard-dir DIR, or leave --manifest-digest out"
    ]
    assert not (tmp_path / "var" / "data").exists()  # refused before anything was built
    rc, err = shard(tmp_path, capsys, "--shard-dir", str(shard_set), "--manifest-digest", "")  # '' was no check
    assert rc == 2 and err[0].startswith("error: --manifest-digest '' is not a sha256 (64 hex digits); give ")
    rc, err = shard(tmp_path, capsys, "--shard-dir", str(shard_set), "--manifest-digest", digest(shard_set).upper())
    assert rc == 0 and err == []


@pytest.mark.parametrize("flag", ["--reduce", "--publish-only"])
def test_a_build_flag_with_shard_dir_is_refused(tmp_path, capsys, shard_set, flag):
    """--reduce and --publish-only are the fan-out's reduce/publish steps: adopting a set ignored them."""
    rc, err = shard(tmp_path, capsys, "--shard-dir", str(shard_set), flag, "--set", "data.inputs=[/nonexist]")
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(f"error: {flag} ") and err[0].endswith(
        f", and --shard-dir adopts a set as it is (nothing is built); leave {flag} out to adopt DIR, or --shard-dir "
        "out to build"
    )


def test_the_dags_adopting_shard_task_drops_its_reduce(tmp_path, cfg, shard_set):
    """The DAG's shard task gets reduce=True after its fan-out (dags/llm_pipeline.py SHARD_REDUCE); when an asset
    event makes it adopt a published set the fan-out was skipped: stage_args drops reduce and the set is adopted."""
    from tasks.pipeline import stage_args
    from tasks.runner import run_stage

    published = {"uri": shard_set.as_uri(), "manifest_digest": digest(shard_set)}
    args = stage_args("shard", published, {"reduce": True})
    assert not args.reduce and args.shard_dir == str(shard_set)
    result = run_stage("shard", cfg, tmp_path / "run", args=args)
    assert result["published"] and result["manifest_digest"] == digest(shard_set)


def test_an_explicit_data_value_must_match_the_adopted_set(tmp_path, capsys, shard_set):
    """A data.* key set explicitly that decides a set's contents, compared with the adopted set's manifest: seq_len
    128 was reported `ok — … sequences of 32` and recorded for the run, so the next smoke failed on it."""
    rc, err = shard(
        tmp_path, capsys, "--shard-dir", str(shard_set), "--set", "data.seq_len=128", "data.vocab_size=2048"
    )
    assert rc == 2 and err == [
        f"error: data.seq_len: 128 differs from the adopted shard set's 32 ({shard_set}); leave it unset to use the "
        f"set's, or build a new set with it without --shard-dir; data.vocab_size: 2048 differs from the adopted "
        f"shard set's 512 ({shard_set}); leave it unset to use the set's, or build a new set with it without "
        "--shard-dir"
    ]
    rc, err = shard(tmp_path, capsys, "--shard-dir", str(shard_set), "--set", "data.inputs=[/nonexist]")
    assert rc == 2 and err == [
        f"error: data.inputs: /nonexist differs from the adopted shard set's stdlib ({shard_set}); leave it unset to "
        "use the set's, or build a new set with it without --shard-dir"
    ]
    rc, err = shard(tmp_path, capsys, "--shard-dir", str(shard_set), "--set", "data.val_fraction=0.1")
    assert rc == 2 and err[0].startswith("error: data.val_fraction: 0.1 differs from the adopted shard set's 0.4 (")
    rc, err = shard(tmp_path, capsys, "--shard-dir", str(shard_set), "--set", "data.partitions=3")
    assert rc == 2 and err == [
        f"error: data.partitions: steers a build, and --shard-dir adopts {shard_set} as it is; leave it unset, or "
        "build a new set without --shard-dir"
    ]
    # the set's own values, and keys that do not change what a set holds (the loader's, where sets go), are fine
    same = ["data.seq_len=32", "data.vocab_size=512", "data.inputs=[stdlib]", "data.max_documents=40"]
    other = ["data.verify_sha256=true", "data.loader_workers=2", "data.prefetch_factor=4", "data.out_dir=/tmp/x"]
    rc, err = shard(
        tmp_path, capsys, "--shard-dir", str(shard_set), "--set", *same, *other, "data.tokenizer=train", run="ok"
    )
    assert rc == 0 and err == []
    recorded = json.loads((tmp_path / "ok" / "shard.json").read_text())
    assert recorded["seq_len"] == 32 and recorded["published"]
    ended = json.loads((shard_set / "manifest.json").read_text())["source"]["ended"]
    assert ended["max_documents"] == 40 and recorded["summary"].endswith(f"; {ended_line(ended)}")  # where 40 cut


def test_an_explicit_tokenizer_is_compared_by_its_files(tmp_path, capsys, shard_set):
    """data.tokenizer: `train` against a set with a given tokenizer (and the reverse) differs; two given ones are
    the same tokenizer when their files are (the identity the manifest records), wherever they lie."""
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    shutil.copy(shard_set / "tokenizer.json", tok)
    rc, err = shard(tmp_path, capsys, "--shard-dir", str(shard_set), "--set", f"data.tokenizer={tok}")
    assert rc == 2 and err[0].startswith(
        f"error: data.tokenizer: {tok} differs from the adopted shard set's train (a BPE trained on the corpus) ("
    )
    given = tmp_path / "given"  # the same set, as if built with the tokenizer at `tok`
    shutil.copytree(shard_set, given)
    manifest = json.loads((given / "manifest.json").read_text())
    manifest["tokenizer"]["source"] = str(tok)
    (given / "manifest.json").write_text(json.dumps(manifest))
    rc, err = shard(tmp_path, capsys, "--shard-dir", str(given), "--set", f"data.tokenizer={tok.parent}")
    assert rc == 0 and err == []
    rc, err = shard(tmp_path, capsys, "--shard-dir", str(given), "--set", "data.tokenizer=train")
    assert rc == 2 and err[0].startswith("error: data.tokenizer: train (a BPE trained on the corpus) differs from ")
    (tok.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))  # another one now
    rc, err = shard(tmp_path, capsys, "--shard-dir", str(given), "--set", f"data.tokenizer={tok.parent}")
    assert rc == 2 and err[0].startswith(f"error: data.tokenizer: {tok.parent} (identity ")
    assert f"differs from the adopted shard set's {tok} (identity " in err[0]


def test_relative_paths_flags_from_the_working_directory_config_values_named(tmp_path, capsys, shard_set, monkeypatch):
    """--shard-dir is read from the working directory, as --run-dir and --model-dir are; a relative data.inputs is
    the repository's (a config value), and one that exists only in the working directory is named with its fix."""
    work = tmp_path / "work"
    shutil.copytree(shard_set, work / "myset")
    (work / "corp").mkdir()
    (work / "corp" / "a.txt").write_text("some text\n" * 50)
    monkeypatch.chdir(work)
    rc, err = shard(tmp_path, capsys, "--shard-dir", "myset")
    assert rc == 0, err
    from argparse import Namespace

    from tasks.runner import StageContext, shard_dir

    ctx = StageContext(run_dir=tmp_path / "r", stage="smoke", args=Namespace(shard_dir="myset"))
    assert shard_dir(ctx) == work / "myset"  # every stage reading a set (smoke, train, quantize, …)
    rc, err = shard(tmp_path, capsys, "--set", "data.inputs=[corp]")
    assert rc == 2 and err == [
        f"error: data.inputs: corp is read from the repository root ({REPO / 'corp'}, which does not exist), not the "
        f"working directory; give the absolute path {work / 'corp'}"
    ], err
    # the same for the other paths a config value names (they read "no tokenizer.json found" in the repository's)
    shutil.copy(shard_set / "tokenizer.json", work / "corp")
    for key in ("data.tokenizer", "model.hf_path"):
        rc, err = shard(tmp_path, capsys, "--set", f"{key}=corp")
        assert rc == 2 and err == [
            f"error: {key}: corp is read from the repository root ({REPO / 'corp'}, which does not exist), not the "
            f"working directory; give the absolute path {work / 'corp'}"
        ], err
    rc, err = shard(tmp_path, capsys, "--set", "model.hf_path=docs")  # the repository's docs/ and one here
    assert err == [] or "is read from the repository root" not in err[0]
    (work / "docs").mkdir()
    rc, err = shard(tmp_path, capsys, "--set", "model.hf_path=docs")
    assert rc == 2 and err == [
        f"error: model.hf_path: docs is read from the repository root ({REPO / 'docs'}), and the working directory has "
        f"its own ({work / 'docs'}); give the absolute path of the one you mean"
    ], err
