"""The shard stage through the real runner: MLflow metrics, artifacts and dataset input; cache hit; one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.errors import StageError
from tasks.runner import run_stage
from tests.helpers.mlflow_store import fresh_store

CORPUS = Path(__file__).resolve().parent / "fixtures" / "data" / "corpus"


@pytest.fixture
def shard_cfg(cfg):
    cfg.data.inputs = [str(CORPUS)]
    cfg.data.vocab_size, cfg.data.seq_len, cfg.data.shard_size_mb = 300, 16, 0.02
    cfg.data.val_fraction, cfg.data.tokenize_processes, cfg.data.max_documents = 0.2, 1, 0
    return cfg


def test_shard_stage_logs_to_mlflow_and_caches(shard_cfg, tmp_path):
    import mlflow

    first = run_stage("shard", shard_cfg, tmp_path / "run1")
    shard_dir = Path(first["shard_dir"])
    manifest = json.loads(Path(first["manifest"]).read_text())
    assert not first["cache_hit"] and first["asset_uri"] == shard_dir.as_uri()
    assert first["status"] == "warn" and first["warnings"] == manifest["warnings"]  # latin1.txt: one line
    assert "1 document(s) are not valid UTF-8 (first in " in first["warnings"][0]
    assert first["tokenizer_identity"] == manifest["tokenizer"]["identity"] and first["partitions"] == 1
    assert manifest["shard_multiple"] == 2  # demo: 2 processes × 1 loader worker
    assert len(manifest["splits"]["train"]["shards"]) % 2 == 0 and first["vocab_size"] == manifest["vocab_size"]
    assert json.loads((tmp_path / "run1" / "shard.json").read_text())["manifest_digest"] == first["manifest_digest"]

    client = mlflow.MlflowClient(shard_cfg.tracking.uri)
    run = client.get_run(first["mlflow_run_id"])
    m = run.data.metrics
    assert m["shard.duplicates"] == 1 and m["shard.undecodable"] == 1 and m["shard.documents_out"] == 17
    assert m["shard.tokens"] == first["tokens"] and m["shard.shards"] == first["shards"] and m["shard.bytes"] > 0
    assert m["shard.tokens_per_s"] > 0 and m["shard.cache_hit"] == 0
    dataset = run.inputs.dataset_inputs[0]
    assert dataset.dataset.name == manifest["version"] and dataset.dataset.digest == first["manifest_digest"][:32]
    assert json.loads(dataset.dataset.source)["uri"] == first["asset_uri"]
    assert {t.key: t.value for t in dataset.tags}["manifest_sha256"] == first["manifest_digest"]
    assert {a.path for a in client.list_artifacts(run.info.run_id, "shards")} == {
        "shards/manifest.json",
        "shards/tokenizer.json",
    }
    again = run_stage("shard", shard_cfg, tmp_path / "run2")
    assert again["cache_hit"] and again["manifest_digest"] == first["manifest_digest"]
    assert "cache hit" in again["summary"]
    assert client.get_run(again["mlflow_run_id"]).data.metrics["shard.cache_hit"] == 1


def test_a_vocab_size_the_given_tokenizer_does_not_use_is_said(shard_cfg, tmp_path, capsys):
    """The DAG's Vocabulary size (data.vocab_size) beside a given tokenizer was accepted and ignored without a word;
    then said only in shard.json, the CLI's line reading `shard: warn` with no reason: it is on stderr too."""
    first = run_stage("shard", shard_cfg, tmp_path / "run1")
    shard_cfg.data.tokenizer = str(Path(first["shard_dir"]) / "tokenizer.json")
    shard_cfg.data.vocab_size = 32000
    quiet = run_stage("shard", shard_cfg, tmp_path / "run2")  # the preset's value, not asked for: nothing to say
    assert not any("data.vocab_size" in w for w in quiet["warnings"])
    shard_cfg.explicit.add("data.vocab_size")  # as --set data.vocab_size=32000 or the Param marks it
    capsys.readouterr()
    said = run_stage("shard", shard_cfg, tmp_path / "run3")
    assert "warning: data.vocab_size 32000 is not used: the given tokenizer" in capsys.readouterr().err
    assert said["status"] == "warn" and [w for w in said["warnings"] if "data.vocab_size" in w] == [
        f"data.vocab_size 32000 is not used: the given tokenizer (data.tokenizer) keeps its own vocabulary of "
        f"{first['vocab_size']} tokens; unset data.vocab_size (it sizes only a BPE trained on the corpus)"
    ]


def test_shard_stage_bad_input_is_one_line_stage_error(shard_cfg, tmp_path):
    shard_cfg.data.inputs = [str(tmp_path / "missing.jsonl")]
    with pytest.raises(StageError, match=r"^shard: input .*missing.jsonl does not exist$"):
        run_stage("shard", shard_cfg, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "shard.json").read_text())["status"] == "failed"


def test_the_dag_steps_then_the_reduce_publish_one_set(tmp_path, monkeypatch):
    """The fanned-out tasks' bodies (tasks.pipeline.shard_step) in order, then the shard stage with --reduce:
    XCom-sized answers (paths and indices), the set of `python -m data_prep shard`; a bad input fails in one line
    and leaves the stage's failure record for the run summary."""
    from tasks.pipeline import DATA_DAG_SHARD_ARGS, run_for_dag_run, shard_step

    monkeypatch.setenv("LLM_PIPELINE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fresh_store(tmp_path / "m.db"))
    params = {"preset": "ci-tiny", "data_inputs": [str(CORPUS)], "partitions": 3, "seq_len": 16, "vocab_size": 300}
    parts = shard_step("prepare", params, "llm_data", "r1")
    assert [p["index"] for p in parts] == [0, 1, 2] and len(json.dumps(parts)) < 1000
    assert [shard_step("partition", params, "llm_data", "r1", p)["partition"] for p in reversed(parts)] == [2, 1, 0]
    writes = shard_step("layout", params, "llm_data", "r1", parts)
    assert writes and all(shard_step("write", params, "llm_data", "r1", w)["shards"] for w in writes)
    result = run_for_dag_run("shard", params, "llm_data", "r1", args=DATA_DAG_SHARD_ARGS)
    assert not result["cache_hit"] and result["partitions"] == 3
    assert shard_step("prepare", params, "llm_data", "r2") == []  # published: the next run's fan-out is empty
    assert shard_step("layout", params, "llm_data", "r2", []) == []
    again = run_for_dag_run("shard", params, "llm_data", "r2", args=DATA_DAG_SHARD_ARGS)
    assert again["cache_hit"] and again["manifest_digest"] == result["manifest_digest"]

    bad = {**params, "data_inputs": [str(tmp_path / "missing.txt")]}
    with pytest.raises(StageError, match=r"^shard: input .*missing.txt does not exist$"):
        shard_step("prepare", bad, "llm_data", "r3")
    record = json.loads((tmp_path / "var" / "runs" / "llm_data" / "r3" / "shard.json").read_text())
    assert record["status"] == "failed" and record["error"].endswith("missing.txt does not exist")


def test_a_val_split_too_small_for_evaluation_stops_the_run_at_shard(shard_cfg, tmp_path):
    """evaluate.tasks' demo-continuation is cut from the val split: cut by the shard stage, so a split too small for
    it fails the run there — before smoke and training spend hours on a model that cannot be evaluated — in
    evaluate's own one line with its fix; the set itself is kept (the data DAG publishes it, and a run evaluating on
    other tasks uses it); a set big enough gets its task written once, and the evaluate stage reuses it; the other
    evaluate.tasks entries are loaded there too (a missing task YAML stops the run at shard)."""
    from tasks.pipeline import stage_args
    from tasks.quant.gate import write_demo_task

    shard_cfg.data.val_fraction = 0.01  # 17 documents: none in val
    with pytest.raises(StageError, match=r"^demo-continuation: the val split of \S+ gives \d+ examples \(") as e:
        run_stage("shard", shard_cfg, tmp_path / "small")
    assert "fewer than 10; reshard with a larger data.val_fraction or corpus, or evaluate on other" in str(e.value)
    record = json.loads((tmp_path / "small" / "shard.json").read_text())
    assert record["status"] == "failed" and "\n" not in record["error"]
    assert not (tmp_path / "small" / "tasks" / "demo-continuation").exists()  # nothing half-written
    kept = run_stage("shard", shard_cfg, tmp_path / "data-dag", args=stage_args("shard", extra={"publish_only": True}))
    assert kept["cache_hit"] and kept["status"] in ("ok", "warn")  # the same set, built once, kept
    published = {"uri": Path(kept["shard_dir"]).as_uri(), "manifest_digest": kept["manifest_digest"]}
    with pytest.raises(StageError, match=r"^demo-continuation: the val split of "):  # a run that adopts it: the same
        run_stage("shard", shard_cfg, tmp_path / "adopts", args=stage_args("shard", published))

    shard_cfg.data.val_fraction = 0.4
    ok = run_stage("shard", shard_cfg, tmp_path / "big")
    task = tmp_path / "big" / "tasks" / "demo-continuation" / "demo-continuation.jsonl"
    written = task.stat().st_mtime_ns
    assert json.loads((task.parent / "meta.json").read_text())["examples"] >= 10
    # what the evaluate stage's load_suite calls first: the same task, reused, not cut again
    assert write_demo_task(shard_cfg, tmp_path / "big", Path(ok["shard_dir"])) == task.with_suffix(".yaml")
    assert task.stat().st_mtime_ns == written
    # the other evaluate.tasks entries are loaded as evaluate loads them (a YAML path: no lm-eval index to read)
    shard_cfg.evaluate.tasks = ["demo-continuation", str(tmp_path / "quiz.yaml")]
    with pytest.raises(StageError, match=r"^evaluate.tasks: \S+quiz.yaml: no such task YAML file \("):
        run_stage("shard", shard_cfg, tmp_path / "quiz")
