"""Quantize's gate and the evaluate stage end to end: real torchao model, real lm-eval tasks (the demo task from the
val split and a task YAML in lm-eval's format), real MLflow tracking and Model Registry, gate both ways, champion
against candidate on the same tasks."""

from __future__ import annotations

import argparse
import re
import shutil

import pytest

from tasks import tracking
from tasks.errors import ConfigError, StageError
from tasks.runner import run_stage
from tests.helpers.quant_fixture import grammar_task, tiny_trained, with_outlier_channels


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    return dict(tiny_trained(base), grammar=grammar_task(base / "grammar-task"), base=base)


def _args(tiny, quant_dir=None, model_dir=None):
    return argparse.Namespace(
        model_dir=str(model_dir or tiny["model_dir"]), shard_dir=str(tiny["shard_dir"]), quant_dir=quant_dir
    )


def _quantize(cfg, tiny, run_dir, method):
    cfg.quantize.method = method
    return run_stage("quantize", cfg, run_dir, args=_args(tiny))


@pytest.mark.slow
def test_gate_registry_and_champion(cfg, tiny, tmp_path, caplog):
    import logging

    from mlflow import MlflowClient

    caplog.set_level(logging.INFO, logger="tasks.progress")

    cfg.evaluate.registered_model = "evaluate-stage-test"
    cfg.evaluate.max_new_tokens = 6
    cfg.evaluate.tasks = ["demo-continuation", str(tiny["grammar"])]
    cfg.evaluate.demo_examples = 60
    client = MlflowClient(cfg.tracking.uri)
    parent = tracking.parent_run(cfg, "llm_pipeline", "manual__eval_test")
    q = _quantize(cfg, tiny, tmp_path / "a", "int8_weight_only")
    assert q["gate"]["passed_by"] == "ptq" and q["gate"]["metric"] == "task_accuracy_drop_pct"
    assert (tmp_path / "a" / "tasks" / "demo-continuation" / "demo-continuation.yaml").is_file()
    r = run_stage("evaluate", cfg, tmp_path / "a", args=_args(tiny, q["quant_dir"]), parent_run_id=parent)
    assert r["passed"] and r["status"] == "ok" and r["champion"]  # first version: champion
    assert r["task_scores_reused"]  # quantize scored BF16 and this INT8 model on these tasks: not again
    assert r["gate_metric"] == "task_accuracy_drop_pct" and r["gate_value"] == r["task_accuracy_drop_pct"]
    assert r["gate_value"] == pytest.approx(q["gate"]["ptq"], abs=1e-3)
    grammar = r["tasks"][str(tiny["grammar"])]
    assert grammar["name"] == "grammar" and grammar["metric"] == "acc" and grammar["n"] == 40
    assert grammar["bf16"] >= 0.6 and {"fp32", "bf16", "int8"} <= set(grammar)  # the tiny model knows the grammar
    assert r["tasks"]["demo-continuation"]["metric"] == "acc_mutual_info"
    macro = (grammar["int8"] + r["tasks"]["demo-continuation"]["int8"]) / 2
    assert r["task_macro"]["int8"] == pytest.approx(macro, abs=1e-4)
    v1 = client.get_model_version_by_alias(cfg.evaluate.registered_model, "champion")
    assert str(v1.version) == r["version"]
    assert v1.tags["airflow.run_id"] == "manual__eval_test" and v1.tags["data.manifest_digest"] == r["data_digest"]
    assert v1.tags["eval.gate_metric"] == "task_accuracy_drop_pct" and v1.tags["quant.passed_by"] == "ptq"
    assert "| grammar | acc | 40 |" in v1.description and "macro task accuracy" in v1.description
    assert "## Model card" in v1.description and f"manifest digest {r['data_digest']}" in v1.description
    assert "| DAG run | llm_pipeline / manual__eval_test |" in v1.description
    assert r["aliases_moved"] and v1.tags["bf16.registered_model"] == "evaluate-stage-test-bf16"
    bf16 = client.get_model_version("evaluate-stage-test-bf16", v1.tags["bf16.version"])  # linked both ways
    assert bf16.tags["int8.version"] == r["version"] and bf16.tags["airflow.run_id"] == "manual__eval_test"
    assert bf16.description.startswith("BF16: the unquantized model") and "## Model card" in bf16.description
    files = {
        a.path.rsplit("/", 1)[-1] for a in client.list_logged_model_artifacts(v1.source.split("/")[1], "extra_files")
    }
    assert {"model_int8.safetensors", "quantization_config.json", "tokenizer.json"} <= files
    files = {
        a.path.rsplit("/", 1)[-1] for a in client.list_logged_model_artifacts(bf16.source.split("/")[1], "extra_files")
    }
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files
    run = client.get_run(r["mlflow_run_id"]).data
    assert run.metrics["eval.task.grammar.int8_acc"] == pytest.approx(grammar["int8"])
    assert run.metrics["eval.task.demo-continuation.bf16_acc_mutual_info"] == r["tasks"]["demo-continuation"]["bf16"]
    assert (
        run.params["evaluate.gate_metric"] == "task_accuracy_drop_pct"
        and "window index % 4" in run.params["split.rule"]
    )
    assert {"int8_accuracy", "ppl_drop_pct", "greedy_agreement", "decode_speed_vs_bf16"} <= set(run.metrics)
    assert {a.path for a in client.list_artifacts(r["mlflow_run_id"], "evaluate")} >= {
        "evaluate/comparison.md",
        "evaluate/comparison.json",
        "evaluate/tasks_table.json",
    }
    md = (tmp_path / "a" / "evaluate" / "comparison.md").read_text()
    assert "## Tasks (lm-evaluation-harness)" in md and "| grammar | acc | 40 |" in md
    head = r["summary"][:80]  # what the run summary shows: gate figure, decode speed vs BF16 (and if slower), size
    assert head.startswith(f"v{r['version']} champion PTQ task acc drop ") and "x BF16" in head
    assert "tasks: demo-continuation acc_mutual_info FP32 " in r["summary"] and "grammar acc FP32 " in r["summary"]
    from tasks.summary import render

    assert f"task accuracy FP32 {r['task_macro']['fp32']:.3f}, BF16 " in render(tmp_path / "a", cfg)  # end of run

    again = run_stage("evaluate", cfg, tmp_path / "a", args=_args(tiny, q["quant_dir"]))  # rerun: same version
    assert again["version"] == r["version"] and again["champion"]
    assert again["bf16_model"] == r["bf16_model"]
    # its tags are this evaluation's, as its description is (not the first run's)
    assert (
        client.get_model_version(cfg.evaluate.registered_model, r["version"]).tags["eval.run_id"]
        == (again["mlflow_run_id"])
        != r["mlflow_run_id"]
    )

    # A CLI run (no DAG) registers a new version but moves no alias, and says so.
    q2 = _quantize(cfg, tiny, tmp_path / "b", "int8_dynamic")
    cli = run_stage("evaluate", cfg, tmp_path / "b", args=_args(tiny, q2["quant_dir"]))
    assert cli["version"] != r["version"] and not cli["aliases_moved"] and not cli["champion"]
    assert cli["aliases"] == {"candidate": r["version"], "champion": r["version"]}
    assert "a run outside Airflow (CLI or test) registers" in cli["champion_reason"]
    assert "registered (no alias moved)" in cli["summary"]

    # A second candidate: the champion (v1) is scored again on the same tasks in this run, the rule applied to both.
    parent2 = tracking.parent_run(cfg, "llm_pipeline", "manual__eval_test_2")
    r2 = run_stage("evaluate", cfg, tmp_path / "b", args=_args(tiny, q2["quant_dir"]), parent_run_id=parent2)
    assert r2["version"] == cli["version"] and r2["aliases"]["candidate"] == r2["version"]
    assert r2["champion_compared"] == {
        "version": r["version"],
        "macro": pytest.approx(r["task_macro"]["int8"], abs=1e-4),
    }
    assert r2["champion"] == (r2["task_macro"]["int8"] >= r["task_macro"]["int8"])
    assert r2["aliases"]["champion"] == (r2["version"] if r2["champion"] else r["version"])
    assert "champion" in r2["tasks"][str(tiny["grammar"])] and " vs champion v" in r2["champion_reason"]
    assert r2["summary_detail"].endswith(f", champion v{r['version']} {r['task_macro']['int8']:.3f}")
    # Progress lines per model and task (issue 28), from quantize's gate and evaluate, ending with "done"
    lines = [x.getMessage() for x in caplog.records if x.name == "tasks.progress"]
    for who in ("quantize BF16", "quantize INT8", "evaluate FP32", f"evaluate champion v{r['version']}"):
        for task in ("demo-continuation", "grammar"):
            mine = [x for x in lines if x.startswith(f"progress: {who} {task} request ")]
            assert mine and re.fullmatch(rf"progress: {who} {task} request 0/\d+ \(0%\)", mine[0]), (who, task, lines)
            assert mine[-1].endswith(", done") and "requests/s" in mine[-1], (who, task, lines)


@pytest.mark.slow
def test_retrain_on_other_data_becomes_champion_without_a_hand_step(cfg, tiny, tmp_path):
    """A model of another shard set (another tokenizer) against a champion of the first: both run on the same text
    tasks, each with its own tokenizer — comparable, so the margin decides, no promotion by hand."""
    cfg.evaluate.registered_model = "evaluate-retrain-test"
    cfg.evaluate.tasks = [str(tiny["grammar"])]
    q = _quantize(cfg, tiny, tmp_path / "a", "int8_weight_only")
    dag = {"parent_run_id": tracking.parent_run(cfg, "llm_pipeline", "manual__retrain_test")}
    first = run_stage("evaluate", cfg, tmp_path / "a", args=_args(tiny, q["quant_dir"]), **dag)
    assert first["champion"]
    other = tiny_trained(tiny["base"], vocab_size=300, name="retrain")
    assert other["shard_dir"] != tiny["shard_dir"]
    args = argparse.Namespace(model_dir=str(other["model_dir"]), shard_dir=str(other["shard_dir"]), quant_dir=None)
    cfg.evaluate.champion_margin = 100.0  # whatever the two tiny models score: comparable, so promoted
    run_stage("quantize", cfg, tmp_path / "b", args=args)
    r = run_stage("evaluate", cfg, tmp_path / "b", args=args, **dag)
    assert r["data_digest"] != first["data_digest"] and r["status"] == "ok"
    assert r["champion"] and r["aliases"]["champion"] == r["version"] and "by hand" not in r["champion_reason"]
    assert r["champion_compared"]["version"] == first["version"] and r["champion_compared"]["macro"] is not None


@pytest.mark.slow
def test_gate_missed_fails_with_advice_and_qat_handoff(cfg, tiny, tmp_path):
    """INT8-hostile weights: the grammar task's accuracy drops far beyond 2 %; quantize says so (QAT off), evaluate
    refuses to register with the figures and the advice."""
    from mlflow import MlflowClient

    hostile = with_outlier_channels(tiny["model_dir"], tmp_path / "outlier-hf")
    cfg.evaluate.registered_model = "evaluate-gate-test"
    cfg.evaluate.tasks = [str(tiny["grammar"])]
    cfg.evaluate.prompts = []
    cfg.quantize.qat_on_fail = False
    cfg.quantize.skip_layers = ["lm_head", "embed"]  # the hand-off lists the skipped layers
    args = _args(tiny, model_dir=hostile)
    q = run_stage("quantize", cfg, tmp_path, args=args)
    assert q["status"] == "warn" and "gate missed: task_accuracy_drop_pct" in q["summary"]
    with pytest.raises(
        StageError,
        match=r"INT8 macro-average task accuracy drop (\d+\.\d+)% exceeds evaluate.max_drop_pct 2.0% "
        r".*task macro 0.\d+ → 0.\d+.*try SmoothQuant.*skip_layers.*QAT",
    ) as e:
        run_stage("evaluate", cfg, tmp_path, args=args)
    assert "\n" not in str(e.value) and float(re.search(r"drop ([\d.]+)%", str(e.value)).group(1)) > 2.0
    qat = tmp_path / "evaluate" / "qat"
    assert 'skip_layers: "tok_embeddings"' in (qat / "retrain.cfg").read_text()
    assert not MlflowClient(cfg.tracking.uri).search_model_versions("name = 'evaluate-gate-test'")


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """tiny's shard set and model shape, untrained: for the checks that fail before any weight is used (training the
    tiny model is most of its CPU)."""
    return tiny_trained(tmp_path_factory.getbasetemp(), steps=0, name="quant-untrained")


def test_bad_inputs(cfg, untrained, tmp_path):
    cfg.evaluate.max_drop_pct = -3
    with pytest.raises(ConfigError, match=r"^evaluate.max_drop_pct: -3 must be a number in \[0, 100\]"):
        run_stage("evaluate", cfg, tmp_path, args=_args(untrained))
    cfg.evaluate.max_drop_pct = 2.0
    with pytest.raises(StageError, match=r"--quant-dir .* holds no quantized model \(no quant_meta.json\)"):
        run_stage("evaluate", cfg, tmp_path, args=_args(untrained, str(tmp_path)))
    # A task problem is found before any model is loaded: here the model's weights are unreadable too, and the
    # task's line is what the stage says. (A task YAML that is not there: an unknown task name says the same before
    # the model too, tests/test_harness.py, but indexes lm-eval's 14 000 tasks for its close matches, ~10 s of CPU.)
    broken = tmp_path / "broken-hf"
    shutil.copytree(untrained["model_dir"], broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    cfg.evaluate.tasks = [str(tmp_path / "nowhere.yaml")]
    with pytest.raises(StageError, match=r"^evaluate.tasks: .*nowhere.yaml: no such task YAML file"):
        run_stage("quantize", cfg, tmp_path, args=_args(untrained, model_dir=broken))


@pytest.mark.slow
def test_qat_in_quantize_after_a_failed_ptq_gate(cfg, tiny, tmp_path):
    """INT8-hostile weights miss the gate after PTQ: quantize fine-tunes with fake quantization (QAT) and judges
    again on the same gate; evaluate then measures the model quantize handed on. On the task gate the stage figures
    say PTQ and QAT; on the perplexity gate QAT gets back under and is registered as QAT's."""
    from mlflow import MlflowClient

    hostile = with_outlier_channels(tiny["model_dir"], tmp_path / "outlier-hf")
    cfg.evaluate.registered_model = "evaluate-qat-test"
    cfg.evaluate.tasks = [str(tiny["grammar"])]
    cfg.evaluate.prompts = []
    cfg.quantize.qat_steps = 50
    args = _args(tiny, model_dir=hostile)
    q = run_stage("quantize", cfg, tmp_path / "a", args=args)
    assert q["quant_dir"].endswith("quantize_qat") and q["ptq_dir"].endswith("quantize")
    assert q["gate"]["ptq"] > 2.0 and "qat" in q["gate"] and "QAT 50 steps" in q["summary"]

    cfg.evaluate.gate_metric = "ppl_drop_pct"
    q = run_stage("quantize", cfg, tmp_path / "b", args=args)
    assert q["gate"]["passed_by"] == "qat" and q["gate"]["ptq"] > 2.0 >= q["gate"]["qat"]
    r = run_stage("evaluate", cfg, tmp_path / "b", args=args)  # the model quantize handed on (quantize.json)
    assert r["passed"] and r["passed_by"] == "qat" and r["ptq"]["gate_value"] > 2.0 >= r["ppl_drop_pct"]
    assert r["quant_dir"].endswith("quantize_qat")
    assert r["summary"].startswith(f"v{r['version']} registered (no alias moved) QAT ppl rise")  # a test: no DAG run
    assert "QAT 50 steps after PTQ ppl_drop_pct" in r["summary"]
    v = MlflowClient(cfg.tracking.uri).get_model_version(cfg.evaluate.registered_model, r["version"])
    assert v.tags["quant.passed_by"] == "qat" and float(v.tags["eval.ptq_gate_value"]) > 2.0


def test_an_fp16_reference_is_named_fp16_in_metrics_tables_figure_and_registry(cfg, untrained, tmp_path, monkeypatch):
    """quantize.dtype=fp16 (910A): the reference is FP16. Its task column, its eval.task.* metrics, comparison.md's
    main-table row, the figure's bars and the registered unquantized version (`-fp16`, described as FP16, loading as
    float16) all say so; before, the column and the per-task metric were dropped and the rest said BF16."""
    from mlflow import MlflowClient

    from tasks.quant import report

    labels = []
    real_figure = report.figure

    def figure(stages):  # the bars' labels as drawn
        fig = real_figure(stages)
        labels.extend(t.get_text() for ax in fig.axes for t in ax.get_xticklabels())
        return fig

    monkeypatch.setattr(report, "figure", figure)
    cfg.quantize.dtype = "fp16"
    cfg.quantize.qat_on_fail = False
    cfg.evaluate.registered_model = "evaluate-fp16-test"
    cfg.evaluate.max_drop_pct = 100.0  # an untrained model: the gate is not what this checks
    cfg.evaluate.demo_examples = 10
    cfg.evaluate.prompts = []
    cfg.evaluate.agreement_windows = 1
    q = run_stage("quantize", cfg, tmp_path, args=_args(untrained))
    assert "x FP16, " in q["summary"] and "BF16" not in q["summary"]  # quantize's own line too
    r = run_stage("evaluate", cfg, tmp_path, args=_args(untrained, q["quant_dir"]))
    assert r["passed"] and set(r["task_macro"]) == {"fp32", "fp16", "int8"}
    assert {"fp32", "fp16", "int8"} <= set(r["tasks"]["demo-continuation"])
    run = MlflowClient(cfg.tracking.uri).get_run(r["mlflow_run_id"]).data
    assert "eval.task.demo-continuation.fp16_acc_mutual_info" in run.metrics and "eval.macro.fp16" in run.metrics
    assert not any(".bf16_" in k or k.endswith(".bf16") for k in run.metrics if k.startswith("eval.task."))
    md = (tmp_path / "evaluate" / "comparison.md").read_text()
    assert "| task | metric | examples | shots | FP32 | FP16 | INT8 |" in md
    assert "| FP16 (reference) |" in md and "BF16" not in md
    assert "FP16" in labels and "BF16" not in labels
    assert "BF16" not in r["summary"] and "x FP16" in r["summary"]
    assert r["bf16_model"]["registered_model"] == "evaluate-fp16-test-fp16"
    client = MlflowClient(cfg.tracking.uri)
    int8 = client.get_model_version("evaluate-fp16-test", r["version"])
    assert "| FP32 | FP16 | INT8 |" in int8.description and "BF16" not in int8.description
    ref = client.get_model_version("evaluate-fp16-test-fp16", r["bf16_model"]["version"])
    assert ref.description.startswith("FP16: the unquantized model") and ref.tags["reference.dtype"] == "fp16"
    assert int8.tags["bf16.registered_model"] == "evaluate-fp16-test-fp16"
    assert run.params["evaluate.model_dir"] == str(untrained["model_dir"])  # --model-dir: what was evaluated
