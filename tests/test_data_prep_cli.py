"""`python -m data_prep shard`: every setting it is given is used or refused in one line, never silently dropped
(found by an audit): --input/--out beside --set inputs=/out_dir=, no inputs at all (it sharded the whole standard
library), keys beside a preset's data: section, the default output directory, a glob of JSON Lines named .json."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from data_prep import __main__ as cli
from data_prep.config import PIPELINE_SECTIONS, ShardConfig, default_out_dir
from data_prep.corpus import resolve_inputs
from data_prep.errors import DataPrepError
from data_prep.manifest import load_manifest
from tests.helpers.shards import CORPUS

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--set", "vocab_size=300", "seq_len=16", "shard_size_mb=0.02", "progress=false"]


@pytest.fixture
def built(monkeypatch):
    """build_shard_set replaced: the config it would build is recorded, then the CLI stops (exit 2, 'error: stub')."""
    seen: list[ShardConfig] = []

    def stub(cfg):
        seen.append(cfg)
        raise DataPrepError("stub")

    monkeypatch.setattr("data_prep.build.build_shard_set", stub)
    return seen


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


# --- 1. a flag and --set naming the same setting ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "setting"),
    [("--input", str(CORPUS), "inputs=[stdlib]"), ("--out", "o2", "out_dir=/x/o3")],
)
def test_a_flag_and_set_of_the_same_setting_is_refused(tmp_path, capsys, built, flag, value, setting):
    argv = ["shard", "--input", str(CORPUS), "--out", str(tmp_path / "o"), "--set", setting]
    argv[argv.index(flag) + 1] = value
    assert cli.main(argv) == 2
    key = setting.partition("=")[0]
    assert errors(capsys) == [f"error: {flag} and --set {key}=… both give {key}; keep one"]
    assert built == []


def test_an_empty_out_is_refused(tmp_path, capsys, built):
    assert cli.main(["shard", "--input", str(CORPUS), "--out", ""]) == 2
    assert errors(capsys) == ["error: --out is empty; give the output directory (or leave --out out for the default)"]


# --- 2. inputs are required -----------------------------------------------------------------------------------------


def test_no_inputs_is_refused_not_the_standard_library(tmp_path, capsys, built):
    flat = tmp_path / "flat.yaml"
    flat.write_text("seq_len: 16\n")
    for argv in (["--out", str(tmp_path / "o")], ["--config", str(flat)], ["--set", "seq_len=16"]):
        assert cli.main(["shard", *argv]) == 2
        (line,) = errors(capsys)
        assert line.startswith("error: no inputs: give --input PATH…") and "inputs in --config/--set" in line
    assert built == []


def test_inputs_from_the_config_or_set_are_enough(tmp_path, capsys, built):
    flat = tmp_path / "flat.yaml"
    flat.write_text(f"inputs: [{CORPUS}]\n")
    for argv in (
        ["--config", str(flat)],
        ["--config", str(REPO / "configs" / "ci-tiny.yaml")],
        ["--set", f"inputs={CORPUS}"],
        ["--set", f"data.inputs={CORPUS}"],  # as the pipeline, and this CLI's own warnings, name the key
    ):
        assert cli.main(["shard", *argv]) == 2 and errors(capsys) == ["error: stub"]
    assert [cfg.inputs for cfg in built] == [[str(CORPUS)], ["stdlib"], [str(CORPUS)], [str(CORPUS)]]
    # --input replaces the config file's inputs (the flag is the more specific; documented in --help)
    assert cli.main(["shard", "--config", str(flat), "--input", "stdlib"]) == 2 and built[-1].inputs == ["stdlib"]


# --- 3. a preset's keys beside its data: section ------------------------------------------------------------------


def test_a_data_key_beside_the_data_section_is_refused(tmp_path, capsys, built):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"seq_len: 32\ndata:\n  inputs: [{CORPUS}]\n")
    assert cli.main(["shard", "--config", str(cfg)]) == 2
    assert errors(capsys) == [f"error: config {cfg}: seq_len: a data key beside the data: section; move it under data:"]
    cfg.write_text(f"inputs: [{CORPUS}]\nmodel:\n  preset: debug\n")  # flat keys with a pipeline section
    assert cli.main(["shard", "--config", str(cfg)]) == 2
    assert errors(capsys) == [f"error: config {cfg}: inputs: a data key beside the sections model; move it under data:"]
    assert built == []


def test_an_unknown_section_is_refused_the_pipelines_are_read_past(tmp_path, capsys, built):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  inputs: [{CORPUS}]\n  seq_len: 32\ntrian:\n  steps: 5\n")
    assert cli.main(["shard", "--config", str(cfg)]) == 2
    (line,) = errors(capsys)
    assert line.startswith(f"error: config {cfg}: trian: unknown section; did you mean train? (a pipeline config's")
    assert built == []
    cfg.write_text(f"data:\n  inputs: [{CORPUS}]\n  seq_len: 32\ntrain:\n  steps: 5\nmodel:\n  preset: debug\n")
    assert cli.main(["shard", "--config", str(cfg)]) == 2 and errors(capsys) == ["error: stub"]
    assert built[-1].seq_len == 32 and built[-1].inputs == [str(CORPUS)]


def test_the_pipeline_sections_are_tasks_own():
    """data_prep cannot import tasks: its copy of the section names must follow tasks.config."""
    from tasks.config import SECTIONS

    assert sorted(PIPELINE_SECTIONS) == sorted(SECTIONS)


# --- 4. the default output directory --------------------------------------------------------------------------------


def test_the_default_out_dir_is_the_pipelines_not_the_working_directorys(tmp_path, monkeypatch, capsys, built):
    from tasks.config import repo_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "v"))
    assert cli.main(["shard", "--input", str(CORPUS)]) == 2 and errors(capsys) == ["error: stub"]
    assert built[-1].out_dir == str(tmp_path / "v" / "data") == str(repo_path(ShardConfig().out_dir))
    monkeypatch.delenv("LLM_PIPELINE_VAR_DIR")
    assert cli.main(["shard", "--input", str(CORPUS)]) == 2
    assert built[-1].out_dir == str(REPO / "var" / "data") == str(repo_path(ShardConfig().out_dir))
    for argv in (["--out", "o1"], ["--set", "out_dir=o2"]):  # a given one is kept, as given
        assert cli.main(["shard", "--input", str(CORPUS), *argv]) == 2
        assert built[-1].out_dir == argv[-1].removeprefix("out_dir=")


def test_a_build_without_out_lands_under_the_var_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "v"))
    assert default_out_dir() == tmp_path / "v" / "data"
    assert cli.main(["shard", "--input", str(CORPUS / "alpha.txt"), *SMALL, "val_fraction=0"]) == 0
    out = capsys.readouterr().out.split()
    assert Path(out[1]).parent == tmp_path / "v" / "data" and load_manifest(out[1])["source"]["files"] == 1
    assert not (tmp_path / "var").exists()


# --- 5. a glob of .json files -------------------------------------------------------------------------------------


def test_a_glob_of_json_files_warns_once_with_the_count(tmp_path, caplog):
    for name in ("a.json", "b.json", "c.txt"):
        (tmp_path / name).write_text('{"text": "some words of a record"}\n' * 3)
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        files = resolve_inputs([str(tmp_path / "*")])
    assert len(files) == 3
    lines = [r.getMessage() for r in caplog.records if "read as one text document" in r.getMessage()]
    assert lines == [
        f"input {tmp_path / '*'} matched 2 .json file(s) (first {tmp_path / 'a.json'}): each is read as one text "
        "document (only .jsonl lines and .parquet rows are records); rename JSON Lines to .jsonl, convert other "
        "tables to .jsonl or .parquet"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        resolve_inputs([str(tmp_path / "*.txt")])
    assert not [r for r in caplog.records if "read as one text document" in r.getMessage()]


# --- 6. blank paths, a --config file's relative paths, what a directory walk passes by ------------------------------


def test_a_blank_path_is_refused_not_read_as_the_working_directory(tmp_path, monkeypatch, capsys, built):
    from tasks.config import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("a file of the working directory, which a blank input walked\n" * 4)
    for argv, want in (
        (["--input", ""], "error: inputs: [''] has a blank entry; give files, directories, globs or 'stdlib'"),
        (["--input", str(CORPUS), "--set", "tokenizer= "], "error: tokenizer: blank; give 'train' or a tokenizer"),
        (["--input", str(CORPUS), "--set", "out_dir= "], "error: out_dir: blank; give a directory"),
    ):
        assert cli.main(["shard", *argv]) == 2
        (line,) = errors(capsys)
        assert line.startswith(want), line
    assert built == []
    from tasks.config import apply_overrides, validate
    from tasks.errors import ConfigError

    c = load_config("ci-tiny")  # the pipeline's model is the same one: a blank data.out_dir was the repository root
    with pytest.raises(ConfigError, match=r"^data.out_dir: blank; give a directory$"):
        apply_overrides(c, {"data.out_dir": ""})
    c.data.out_dir = " "  # set by code, then checked
    with pytest.raises(ConfigError, match=r"^data.out_dir: blank; give a directory$"):
        validate(c)


def test_a_config_files_relative_paths_are_read_as_the_pipeline_reads_them(tmp_path, monkeypatch, capsys, built):
    from tasks.config import repo_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "v"))
    rel = CORPUS.relative_to(REPO)
    conf = tmp_path / "preset.yaml"
    conf.write_text(f"data:\n  inputs: [{rel}, stdlib]\n  out_dir: var/sets\n  tokenizer: {rel}/tok\n")
    assert cli.main(["shard", "--config", str(conf)]) == 2 and errors(capsys) == ["error: stub"]
    cfg = built[-1]
    assert cfg.inputs == [str(CORPUS), "stdlib"] == [str(repo_path(rel)), "stdlib"]  # the pipeline's reading
    assert cfg.out_dir == str(tmp_path / "v" / "sets") and cfg.tokenizer == str(CORPUS / "tok")
    # the command line's paths stay the working directory's
    assert cli.main(["shard", "--config", str(conf), "--input", "here", "--out", "o"]) == 2 and errors(capsys)
    assert (built[-1].inputs, built[-1].out_dir) == ([str(tmp_path / "here")], "o")
    # a relative input that exists only where the command runs: one line naming both places
    (tmp_path / "mine").mkdir()
    conf.write_text("inputs: [mine]\n")
    assert cli.main(["shard", "--config", str(conf)]) == 2
    (line,) = errors(capsys)
    assert line == (
        f"error: config {conf}: inputs: mine is read from the repository root ({REPO / 'mine'}, which does not "
        f"exist), not the working directory; give the absolute path {tmp_path / 'mine'} (or pass it with --input)"
    )


def test_a_directory_walk_names_the_files_it_does_not_read(tmp_path, caplog):
    for name in ("a.jsonl", "b.json", "c.json", "d.csv", "sub/e.txt", ".hidden/f.json", "README"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text('{"text": "some words of a record"}\n')
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        files = resolve_inputs([str(tmp_path)])
    assert files == [tmp_path / "a.jsonl", tmp_path / "sub" / "e.txt"]
    lines = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert lines == [
        f"input {tmp_path}: 4 file(s) not read (.json 2, (no suffix) 1, .csv 1; first {tmp_path / 'README'}): a "
        "directory walk reads .jsonl .md .parquet .rst .text .txt (and their .gz); name other text files directly or "
        "with a glob, convert tables to .jsonl or .parquet"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        resolve_inputs([str(tmp_path / "sub")])  # nothing passed by: nothing said
    assert not caplog.records
    # the build records the lines in the manifest's warnings, beside its own: they were printed, then lost
    (tmp_path / "sub" / "e.txt").write_text((CORPUS / "alpha.txt").read_text())
    notes: list[str] = []
    assert resolve_inputs([str(tmp_path)], notes) == files and notes[0] == lines[0]
    assert notes[1].startswith(f"input {tmp_path}: a directory walk skipped 1 hidden entry")
    out = tmp_path.parent / f"{tmp_path.name}-out"
    assert cli.main(["shard", "--input", str(tmp_path), "--out", str(out), *SMALL]) == 0
    (manifest,) = [load_manifest(d) for d in out.iterdir() if d.name.startswith("shards-")]
    assert manifest["warnings"][:2] == notes


def test_verify_of_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    """`verify /no/such/dir` read "is not a shard set (no manifest.json)", as if the directory were there."""
    assert cli.main(["verify", str(tmp_path / "nowhere")]) == 2
    assert errors(capsys) == [f"error: {tmp_path / 'nowhere'} does not exist; give the shard set's directory"]
    (tmp_path / "empty").mkdir()
    assert cli.main(["verify", str(tmp_path / "empty")]) == 2
    assert errors(capsys)[0].startswith(f"error: {tmp_path / 'empty'} is not a shard set (no manifest.json)")


def test_inputs_typed_relative_are_recorded_absolute(tmp_path, monkeypatch):
    """`--input c1` from /tmp/dp was recorded as `c1`: a later stage adopting the set read it from the repository
    (`differs from the adopted shard set's <repo>/c1`, a path that never existed)."""
    (tmp_path / "c1").mkdir()
    (tmp_path / "c1" / "a.txt").write_text((CORPUS / "alpha.txt").read_text())
    monkeypatch.chdir(tmp_path)
    for argv in (["--input", "c1", "c1/*.txt"], ["--set", "inputs=[c1]"]):
        out = tmp_path / f"out{len(argv)}"
        assert cli.main(["shard", *argv, "--out", str(out), *SMALL]) == 0
        (built,) = out.glob("shards-*")
        inputs = load_manifest(built)["source"]["inputs"]
        assert inputs == [str(tmp_path / "c1"), str(tmp_path / "c1" / "*.txt")][: len(inputs)], inputs
