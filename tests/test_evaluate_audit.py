"""The evaluate stage's audit findings, each at the cheapest level that shows it: an INT8 model quantized from
another export of the model, a lower-is-better task metric, a task definition changed through an include or a
`!function` file, few-shot counts the task cannot give, unreadable quantize records, a registered version whose newest
evaluation misses the gate, and a gate metric with nothing to measure it on — each refused (or recorded) in one line
before any model is loaded."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.errors import ConfigError, StageError
from tasks.runner import run_stage

ROWS = [
    {"question": "The return value of len([1, 2]) is", "choices": [" 2", " 3"], "answer": 0},
    {"question": "import os\nos.path.", "choices": ["join", "jump"], "answer": 0},
    {"question": "def f(x):\n    return", "choices": [" x", " def"], "answer": 0},
]


def _quiz(folder: Path, extra: str = "", rows=ROWS) -> Path:
    """A task split over an included base YAML and a `!function` utils file (lm-eval's own layout)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "quiz.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "base.yaml").write_text(
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {folder / 'quiz.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
    )
    (folder / "utils.py").write_text(
        "def _prompt(doc):\n    return doc['question']\n\n\ndef text(doc):\n    return _prompt(doc)\n"
    )
    path = folder / "quiz.yaml"
    path.write_text("include: base.yaml\ntask: audit_quiz\ndoc_to_text: !function utils.text\n" + extra)
    return path


def _load(path: Path, fewshot=None, metrics=("acc",)):
    from tasks.harness import suite

    return suite.load([str(path)], None, None, dict(fewshot or {}), list(metrics))


# ---- 1. an INT8 model quantized from another export ----------------------------------------------------------------


def _quant_dir(tmp_path: Path, model: Path, **meta) -> Path:
    q = tmp_path / "quantize"
    q.mkdir()
    (q / "quant_meta.json").write_text(json.dumps({"model_dir": str(model), "shard_dir": str(tmp_path / "s"), **meta}))
    return q


def _evaluate(cfg, tmp_path: Path, quant_dir: Path, model: Path):
    cfg.tracking.enabled = False
    args = argparse.Namespace(model_dir=str(model), shard_dir=str(tmp_path / "no-shards"), quant_dir=str(quant_dir))
    return run_stage("evaluate", cfg, tmp_path / "run", args=args)


def test_int8_of_another_export_is_refused_before_anything_is_loaded(cfg, tmp_path):
    from tasks.quant import inputs

    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"old weights")
    q = _quant_dir(tmp_path, model, model_fingerprint=inputs.fingerprint(model))
    with pytest.raises(StageError) as same:  # the same export: the check passes, the missing shard set stops it
        _evaluate(cfg, tmp_path, q, model)
    assert "another export" not in str(same.value)
    (model / "model.safetensors").write_bytes(b"re-exported weights")  # hf/ re-exported with other weights
    with pytest.raises(StageError) as e:
        _evaluate(cfg, tmp_path, q, model)
    assert str(e.value).startswith(
        f"evaluate: the INT8 model in {q} was quantized from another export of the model (fingerprint "
    )
    assert str(e.value).endswith("; rerun the quantize stage") and "\n" not in str(e.value)


def test_int8_version_key_names_the_export_it_was_quantized_from(tmp_path):
    from tasks.stages.evaluate import _version_key

    model = tmp_path / "hf"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"a")
    meta = {"weights_sha256": "w" * 64}
    key = _version_key(meta, tmp_path, model, "digest")
    assert _version_key(meta, tmp_path, model, "digest") == key  # a rerun: the same version
    (model / "model.safetensors").write_bytes(b"bb")
    assert _version_key(meta, tmp_path, model, "digest") != key  # another export: not that version


# ---- 2. lower-is-better task metrics --------------------------------------------------------------------------------


def test_a_lower_is_better_task_metric_is_refused_on_load(tmp_path):
    (tmp_path / "text.jsonl").write_text(
        "".join(json.dumps({"text": f"def f{i}(x): return x"}) + "\n" for i in range(3))
    )
    ppl = tmp_path / "ppl.yaml"
    ppl.write_text(
        "task: audit_ppl\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {tmp_path / 'text.jsonl'}\n"
        "test_split: test\n"
        "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\n"
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n"
        "  - metric: word_perplexity\n"
        "  - metric: bits_per_byte\n"
    )
    with pytest.raises(StageError) as e:
        _load(ppl, metrics=["acc", "word_perplexity"])
    assert str(e.value) == (
        "evaluate.tasks: task audit_ppl is scored by word_perplexity (evaluate.task_metrics), for which lower is "
        "better; only higher-is-better metrics are gated: give a task reporting one (e.g. acc) or drop it"
    )
    assert _load(_quiz(tmp_path / "quiz")).metric == {"audit_quiz": "acc"}  # higher is better: accepted


# ---- 3. the task key covers includes and !function files ------------------------------------------------------------


def test_suite_key_changes_with_an_included_yaml_or_a_function_file(tmp_path):
    from tasks.quant.gate import suite_key

    cfg = SimpleNamespace(evaluate=SimpleNamespace(batch_size=16))
    path = _quiz(tmp_path / "quiz")
    key = suite_key(_load(path), cfg)
    assert suite_key(_load(path), cfg) == key  # loaded again, unchanged: the same key (scores reused)
    base = path.parent / "base.yaml"
    base.write_text(base.read_text() + 'description: "Answer:"\n')  # the prompt changes in the included YAML
    changed = suite_key(_load(path), cfg)
    assert changed != key
    utils = path.parent / "utils.py"  # a helper the !function calls changes its prompt
    utils.write_text(utils.read_text().replace("return doc['question']", "return 'Q: ' + doc['question']"))
    assert suite_key(_load(path), cfg) != changed
    # a task reading a local copy of a dataset (dataset_path: a folder, as docs/evaluation.md's MMLU recipe): its
    # data changed, the key changes (only data_files were hashed: quantize's old scores were reused)
    data = tmp_path / "local"
    data.mkdir()
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    local = tmp_path / "local.yaml"
    local.write_text(
        f"task: audit_local\ndataset_path: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: question\ndoc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )
    key = suite_key(_load(local), cfg)
    assert suite_key(_load(local), cfg) == key
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    assert suite_key(_load(local), cfg) != key


# ---- 4. few-shot counts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shots", [-1, -5])
def test_negative_fewshot_is_a_one_line_config_error(shots):
    from tasks.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config("demo-cpu", {"evaluate": {"num_fewshot": {"mmlu": shots}}})
    assert str(e.value) == f"evaluate.num_fewshot: mmlu: {shots} must be >= 0 (few-shot examples per prompt)"


def test_more_shots_than_the_fewshot_split_holds_is_refused_on_load(tmp_path):
    path = _quiz(tmp_path / "quiz")
    assert _load(path, {"audit_quiz": 3}).fewshot == {"audit_quiz": 3}  # the test split (3 rows) is the pool
    with pytest.raises(StageError) as e:
        _load(path, {"audit_quiz": 4})
    assert str(e.value) == (
        "evaluate.num_fewshot: task audit_quiz asks for 4 few-shot examples, but its few-shot split (test) has 3 "
        "rows; use at most 3 shots for it"
    )
    own = _quiz(tmp_path / "own", "fewshot_split: test\n")  # drawn from the evaluation split: one row is the prompt
    assert _load(own, {"audit_quiz": 2}).fewshot == {"audit_quiz": 2}
    with pytest.raises(StageError, match=r"has 3 rows \(one is the prompt itself\); use at most 2 shots for it$"):
        _load(own, {"audit_quiz": 3})


# ---- 5. unreadable quantize records ---------------------------------------------------------------------------------


def test_truncated_quant_meta_is_one_line(cfg, tmp_path):
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    q = _quant_dir(tmp_path, model)
    (q / "quant_meta.json").write_text('{"model_dir": "x", "shard')
    with pytest.raises(StageError) as e:
        _evaluate(cfg, tmp_path, q, model)
    assert str(e.value).startswith(f"evaluate: {q / 'quant_meta.json'} is unreadable (JSONDecodeError: ")
    assert str(e.value).endswith("; rerun the quantize stage") and "\n" not in str(e.value)


def test_corrupt_gate_record_is_one_line(tmp_path):
    from tasks.stages.evaluate import _quant_record

    rec = tmp_path / "gate.json"
    rec.write_text('{"key": "abc", "ref_sc')
    with pytest.raises(StageError, match=r"gate.json is unreadable \(JSONDecodeError: .*; rerun the quantize stage$"):
        _quant_record(rec)
    rec.write_text("[1, 2]")
    with pytest.raises(StageError, match=r"gate.json holds no JSON object \(a list\); rerun the quantize stage$"):
        _quant_record(rec)


# ---- 6. a registered version whose newest evaluation misses the gate -----------------------------------------------


def _figures(passed: bool, value: float) -> dict:
    return {
        "stage": "ptq",
        "passed": passed,
        "int8_ppl": 3.0,
        "int8_task_macro": 0.5,
        "fp_ppl": 2.9,
        "ppl_drop_pct": 1.0,
        "accuracy_drop_pct": 0.5,
        "task_accuracy_drop_pct": value,
        "gate_metric": "task_accuracy_drop_pct",
        "gate_value": value,
        "method": "int8_weight_only",
        "backend": "torchao",
        "max_drop_pct": 2.0,
        "reference": "bf16",
        "fp_task_macro": 0.52,
        "ref_task_macro": 0.51,
        "ref_ppl": 2.95,
        "ref_accuracy": 0.4,
        "int8_accuracy": 0.39,
        "size_ratio_vs_bf16": 0.55,
    }


ROWS_T = {"t": {"name": "t", "metric": "acc", "n": 40, "shots": 0, "fp32": 0.52, "bf16": 0.51, "int8": 0.5}}


def test_a_version_that_misses_a_re_evaluation_is_tagged_failed_and_keeps_its_aliases(cfg, tmp_path):
    from mlflow import MlflowClient

    from tasks.quant import registry, report
    from tasks.stages import evaluate

    cfg.evaluate.registered_model = "audit-retag"
    model, quant = tmp_path / "hf", tmp_path / "q"
    for d in (model, quant):
        d.mkdir()
        (d / "w.bin").write_bytes(b"weights")
    meta = {"weights_sha256": "a" * 64, "method": "int8_weight_only", "backend": "torchao"}
    ctx = SimpleNamespace(inputs={}, mlflow_run_id=None)
    client = MlflowClient(cfg.tracking.uri)
    missed = (_figures(False, 9.0), "d1", quant, model, None, ROWS_T, {"data": "shard set s"})
    assert evaluate._retag_missed(cfg, ctx, meta, *missed) is None  # none yet
    key = evaluate._version_key(meta, quant, model, "d1")
    passed = evaluate._tags(cfg.tracking.uri, ctx, meta, _figures(True, 0.5), "d1", key, {"value": 3.0}, ["t"])
    assert passed["eval.gate_passed"] == "true" and passed["quant.passed_by"] == "ptq"
    card = report.description(ROWS_T, _figures(True, 0.5), None, "", {"data": "shard set s"})
    assert card.startswith("INT8 int8_weight_only (torchao, PTQ): `task_accuracy_drop_pct` +0.50% (gate ≤ 2%)")
    client.create_registered_model("audit-retag")
    v = client.create_model_version("audit-retag", str(quant), tags=passed, description=card).version
    client.create_registered_model("audit-retag-bf16")  # the linked reference version copies the INT8 card
    ref = client.create_model_version("audit-retag-bf16", str(model), description=report.bf16_description(card)).version
    registry.link(
        cfg.tracking.uri, "audit-retag", str(v), {"bf16.registered_model": "audit-retag-bf16", "bf16.version": ref}
    )
    registry.link(
        cfg.tracking.uri, "audit-retag-bf16", ref, {"int8.registered_model": "audit-retag", "int8.version": v}
    )
    registry.set_alias(cfg.tracking.uri, "audit-retag", registry.CHAMPION, str(v))

    got = evaluate._retag_missed(cfg, ctx, meta, *missed)
    assert got == str(v)
    version = client.get_model_version("audit-retag", str(v))
    tags = version.tags
    assert tags["eval.gate_passed"] == "false" and tags["eval.gate_value"] == "9.0000"
    assert tags["quant.passed_by"] == "none" and "eval.ptq_gate_value" not in tags  # no earlier figure left
    # the model card says the newest evaluation too, first: never the earlier pass's gate line
    assert version.description.startswith(
        "GATE MISSED in the newest evaluation: INT8 int8_weight_only (torchao, PTQ) `task_accuracy_drop_pct` +9.00% "
        "exceeds the gate (≤ 2%)"
    )
    assert "+0.50%" not in version.description and "| t | acc | 40 | 0 |" in version.description
    ref_card = client.get_model_version("audit-retag-bf16", ref).description
    assert ref_card.startswith("BF16: the unquantized model") and "GATE MISSED in the newest evaluation" in ref_card
    assert registry.aliases(cfg.tracking.uri, "audit-retag") == {"champion": str(v)}  # aliases stay
    other = evaluate._retag_missed(cfg, ctx, meta, _figures(False, 9.0), "d2", *missed[2:])
    assert other is None  # other data: other weights' evaluation, not this version's


# ---- 7. a gate metric with nothing to measure it on -----------------------------------------------------------------


def test_greedy_gate_without_windows_or_prompts_is_a_config_error():
    from tasks.config import load_config

    bad = {"gate_metric": "greedy_disagreement_pct", "agreement_windows": 0, "prompts": []}
    with pytest.raises(ConfigError) as e:
        load_config("demo-cpu", {"evaluate": bad})
    assert str(e.value) == (
        "evaluate.gate_metric: greedy_disagreement_pct has nothing to be measured on (evaluate.agreement_windows is "
        "0 and evaluate.prompts is empty); set one of them, or gate on another metric"
    )
    load_config("demo-cpu", {"evaluate": dict(bad, prompts=["def "])})  # prompts to generate from: fine
    load_config("demo-cpu", {"evaluate": dict(bad, gate_metric="ppl_drop_pct")})


def test_a_wrong_value_inside_a_mapping_setting_is_one_line():
    """A type error on a key of a mapping field (evaluate.num_fewshot) is named by its path; it crashed the
    one-line reporter (an AttributeError walking into the dict as if it were a section)."""
    from tasks.config import apply_overrides, load_config
    from tasks.errors import ConfigError

    cfg = load_config("ci-tiny")
    for value, want in (
        ("{mmlu: abc}", "evaluate.num_fewshot.mmlu: expected an integer, got 'abc'"),
        ("{mmlu: 1.5}", "evaluate.num_fewshot.mmlu: expected an integer, got 1.5"),
    ):
        with pytest.raises(ConfigError) as e:
            apply_overrides(cfg, {"evaluate.num_fewshot": value})
        assert str(e.value) == want


# ---- 8. the shard set quantize calibrated on ---------------------------------------------------------------------


def test_evaluate_reads_the_shard_set_quantize_calibrated_on_and_refuses_another(cfg, tmp_path):
    """quantize --shard-dir A, then evaluate in a run directory whose shard stage built B: evaluate scored B's val
    split, whose evaluation windows could hold the tokens calibration saw on A. It reads A (quantize's record wins
    over the run directory's shard stage); an explicit --shard-dir B is refused in one line."""
    from data_prep.build import build_shard_set
    from tasks.quant import inputs
    from tasks.runner import StageContext, shard_dir
    from tests.helpers.shards import shard_cfg

    a = build_shard_set(shard_cfg(tmp_path / "a")).shard_dir
    b = build_shard_set(shard_cfg(tmp_path / "b", max_documents=3)).shard_dir
    assert inputs.manifest_digest(a) != inputs.manifest_digest(b)
    ctx = StageContext(
        tmp_path / "run", "evaluate", argparse.Namespace(shard_dir=None), {"shard": {"shard_dir": str(b)}}
    )
    assert shard_dir(ctx, recorded=str(a)) == a and shard_dir(ctx) == b
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    q = _quant_dir(tmp_path, model, model_fingerprint=inputs.fingerprint(model))
    meta = json.loads((q / "quant_meta.json").read_text())
    meta.update(shard_dir=str(a), calibration_data_digest=inputs.manifest_digest(a))
    (q / "quant_meta.json").write_text(json.dumps(meta))
    cfg.tracking.enabled = False
    args = argparse.Namespace(model_dir=str(model), shard_dir=str(b), quant_dir=str(q))
    with pytest.raises(StageError) as e:
        run_stage("evaluate", cfg, tmp_path / "run", args=args)
    assert str(e.value) == (
        f"evaluate: {b} is another shard set than the one quantize calibrated on ({a}): its evaluation windows could "
        f"hold tokens calibration saw; evaluate without --shard-dir (quantize's set), or rerun quantize --shard-dir {b}"
    )


# ---- 9. model.hf_path named after training ----------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["quantize", "evaluate"])
def test_a_model_hf_path_training_did_not_start_from_is_refused_not_ignored(cfg, tmp_path, stage):
    """`quantize --set model.hf_path=X` in a trained run directory quantized the train stage's export, exit 0, and
    remembered X, which then broke the next train. One line naming --model-dir; the path training started from, a
    --model-dir, and a train result from before train recorded `init_from` still pass this check."""
    from tasks.quant.inputs import check_hf_path
    from tasks.runner import StageContext

    other = tmp_path / "other-ckpt"
    other.mkdir()
    cfg.model.hf_path = str(other)
    train = {"status": "ok", "init_from": None, "hf_dir": str(tmp_path / "run" / "hf")}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.json").write_text(json.dumps(train))
    cfg.tracking.enabled = False
    with pytest.raises(StageError) as e:
        run_stage(stage, cfg, tmp_path / "run", args=argparse.Namespace(model_dir=None, shard_dir=None, quant_dir=None))
    assert str(e.value) == (
        f"{stage}: model.hf_path {other} is where training starts, and this run's model was trained from a random "
        f"init; {stage} reads its export ({tmp_path / 'run' / 'hf'}): pass --model-dir {other} to {stage} that "
        "checkpoint, or rerun train with it"
    )
    ctx = StageContext(tmp_path / "run", stage, argparse.Namespace(model_dir=None), {"train": train})
    for inputs in ({"train": {**train, "init_from": str(other)}}, {"train": {"status": "ok"}}):
        check_hf_path(cfg, StageContext(tmp_path / "run", stage, argparse.Namespace(model_dir=None), inputs))
    check_hf_path(cfg, StageContext(ctx.run_dir, stage, argparse.Namespace(model_dir=str(other)), ctx.inputs))


def test_the_model_card_names_the_set_trained_on_beside_the_one_evaluated_on(tmp_path):
    """Re-sharded after training, a registered version's card said only the evaluation set, as if the model had
    been trained on it; the train stage's result now names its set, and the card says both when they differ."""
    from tasks.runner import StageContext
    from tasks.stages.evaluate import _card

    evaluated = tmp_path / "set-b"
    evaluated.mkdir()
    (evaluated / "manifest.json").write_text(json.dumps({"vocab_size": 300, "tokenizer": {"source": "train"}}))
    train = {"manifest_digest": "a" * 64, "shard_dir": str(tmp_path / "set-a"), "steps": 5}
    ctx = StageContext(tmp_path / "run", "evaluate", argparse.Namespace(), {"train": train})
    assert _card(ctx, evaluated, "b" * 64, {})["data"] == (
        f"trained on shard set set-a (manifest digest {'a' * 64}); evaluated on shard set set-b, manifest digest "
        f"{'b' * 64}"
    )
    assert _card(ctx, evaluated, "a" * 64, {})["data"] == f"shard set set-b, manifest digest {'a' * 64}"


@pytest.mark.parametrize("stage", ["quantize", "evaluate"])
def test_a_model_without_its_tokenizer_is_one_line_before_quantizing(cfg, tmp_path, stage):
    """A transformers checkpoint saved without its tokenizer passed quantize (exit 0, minutes of work) and then
    failed evaluate in three lines: each stage says it in one, before any model is loaded."""
    from data_prep.build import build_shard_set
    from tasks.model.hf_io import check_tokenizers
    from tests.helpers.models import tiny_qwen2
    from tests.helpers.shards import shard_cfg

    shards = build_shard_set(shard_cfg(tmp_path / "s")).shard_dir
    model = tmp_path / "bare"
    tiny_qwen2(model, vocab=300)
    with pytest.raises(StageError) as e:
        check_tokenizers(model, shards, stage)
    assert str(e.value).startswith(f"{stage}: the model {model} has no tokenizer.json, which evaluate reads its text")
    assert "\n" not in str(e.value)


# ---- 9. quantize.* values evaluate was given that did not make the INT8 model ---------------------------------------


def test_a_quantize_setting_the_int8_model_was_not_made_with_is_refused_not_logged(cfg, tmp_path):
    """`evaluate --set quantize.method=smoothquant quantize.dtype=fp16 'quantize.skip_layers=[]'` on an int8_weight_only
    model quantized in BF16: evaluate measured the model as it was, against BF16, and logged the given values as
    this evaluation's. Each value that decides the INT8 model and differs from quant_meta.json is one line, before
    anything is loaded; a value equal to the record, or one not given, is no problem."""
    from tasks.config import apply_overrides

    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    recorded = {"method": "int8_weight_only", "backend": "torchao", "skip_layers": ["lm_head", "embed"]}
    q = _quant_dir(tmp_path, model, dtype="bf16", calibration_batches=4, calibration_data_digest=None, **recorded)
    cfg.quantize.method = "int8_dynamic"  # not given (a preset's value): not compared
    apply_overrides(cfg, {"quantize.method": "smoothquant", "quantize.dtype": "fp16", "quantize.skip_layers": []})
    apply_overrides(cfg, {"quantize.calibration_batches": 9, "quantize.backend": "auto"})  # decide nothing here
    with pytest.raises(ConfigError) as e:
        _evaluate(cfg, tmp_path, q, model)
    meta = q / "quant_meta.json"
    assert e.value.problems == [
        f"quantize.dtype: fp16 differs from the INT8 model's bf16 ({meta}); evaluate measures the model quantize "
        "made: rerun `python -m tasks quantize` with it (then evaluate), or leave it unset",
        f"quantize.method: smoothquant differs from the INT8 model's int8_weight_only ({meta}); evaluate measures "
        "the model quantize made: rerun `python -m tasks quantize` with it (then evaluate), or leave it unset",
        f"quantize.skip_layers: [] differs from the INT8 model's lm_head, embed ({meta}); evaluate measures the "
        "model quantize made: rerun `python -m tasks quantize` with it (then evaluate), or leave it unset",
    ]
    apply_overrides(cfg, {"quantize.method": "int8_weight_only", "quantize.dtype": "bf16"})
    apply_overrides(cfg, {"quantize.skip_layers": ["lm_head", "embed"], "quantize.backend": "torchao"})
    with pytest.raises(StageError) as same:  # the values quantize used: the check passes, the missing shards stop it
        _evaluate(cfg, tmp_path, q, model)
    assert not isinstance(same.value, ConfigError) or "quantize." not in str(same.value)
