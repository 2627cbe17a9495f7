"""Quantize-stage audit findings: QAT's embedding and sizes, what verify_output holds an earlier result to
(quantization_config.json, AMCT's ONNX models), the AMCT classic PTQ method, the tokenizer identity recorded for a
transformers-saved model, absolute model paths, unreadable earlier records, decimal MB, the skip_layers hint, a
checkpoint with fewer embedding rows than its tokenizer has tokens, one with NaN weights or non-finite logits."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasks.errors import StageError
from tasks.fsutil import read_json
from tasks.runner import run_stage
from tests.helpers.quant_fixture import tiny_trained


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_trained(tmp_path_factory.getbasetemp())


class _MissingGate:
    """tasks.quant.gate.Gate without a measurement: every model misses by 50 % (QAT follows)."""

    def __init__(self, cfg, run_dir, model_dir, shard_dir, device, suite=None):
        self.metric, self.max_drop, self.suite, self.ref_figures = cfg.evaluate.gate_metric, 2.0, suite, {}

    def judge(self, model) -> dict:
        return {"metric": self.metric, "value": 50.0, "passed": False, "figures": {}}


@pytest.fixture
def cfg(cfg, monkeypatch):
    cfg.evaluate.gate_metric = "accuracy_drop_pct"  # no task suite: the gate is faked where a test runs it
    cfg.quantize.qat_on_fail = False
    monkeypatch.setattr("tasks.quant.gate.Gate", _MissingGate)
    return cfg


def _args(model_dir, shard_dir):
    return argparse.Namespace(model_dir=str(model_dir), shard_dir=str(shard_dir))


@pytest.fixture(scope="module")
def ptq_dir(tiny, tmp_path_factory, mlflow_uri):
    """One torchao PTQ result (demo-cpu: skip_layers [], the embedding quantized too), copied by the tests."""
    from tasks.config import load_config

    c = load_config("demo-cpu")
    root = tmp_path_factory.mktemp("audit-ptq")
    c.tracking.uri, c.tracking.artifact_root, c.tracking.experiment = mlflow_uri, str(root / "ml"), "tests"
    c.evaluate.gate_metric, c.quantize.qat_on_fail = "accuracy_drop_pct", False
    mp = pytest.MonkeyPatch()
    mp.setattr("tasks.quant.gate.Gate", _MissingGate)
    try:
        r = run_stage("quantize", c, root / "run", args=_args(tiny["model_dir"], tiny["shard_dir"]))
    finally:
        mp.undo()
    return Path(r["ptq_dir"])


# ---- 1: QAT quantizes the embedding as PTQ does; the result reports the model handed on ----


def test_qat_quantizes_the_embedding_and_the_result_reports_the_qat_model(cfg, tiny, tmp_path):
    from tasks.units import MB

    cfg.quantize.qat_on_fail, cfg.quantize.qat_steps = True, 2
    r = run_stage("quantize", cfg, tmp_path, args=_args(tiny["model_dir"], tiny["shard_dir"]))
    qat_dir = Path(r["quant_dir"])
    assert qat_dir.name == "quantize_qat" and r["gate"]["qat"] == 50.0
    meta = read_json(qat_dir / "quant_meta.json")
    assert "tok_embeddings" in meta["quantized_layers"]
    import torchao  # noqa: F401

    sd = torch.load(qat_dir / "model_int8.pt", weights_only=True)
    assert type(sd["tok_embeddings.weight"]).__name__ == "Int8Tensor"  # not BF16 under an INT8 label
    assert r["int8_mb"] == round(meta["int8_bytes"] / MB, 3)  # the QAT model's size, not PTQ's
    assert r["size_ratio_vs_bf16"] == round(meta["int8_bytes"] / meta["bf16_bytes"], 4)


def test_the_result_and_mlflow_report_the_size_of_the_model_handed_on(cfg, tiny, tmp_path, monkeypatch):
    """Whichever model passes on (QAT's here, with another size than PTQ's), its own figures are reported."""
    from tasks.quant.artifact import META
    from tasks.stages import quantize

    qat_dir = tmp_path / "quantize_qat"
    qat_dir.mkdir()
    qat_meta = {"format": "torch_state_dict", "int8_bytes": 3_000_000, "bf16_bytes": 6_000_000}
    qat_meta.update(fp32_bytes=12_000_000, quantized_layers=["a", "b"], backend="torchao", method="int8_weight_only")
    (qat_dir / META).write_text(json.dumps(dict(qat_meta, model_dir=str(tiny["model_dir"]))))
    record = {"metric": "accuracy_drop_pct", "max_drop_pct": 2.0, "passed_by": "qat", "quant_dir": str(qat_dir)}
    record.update(ptq={"value": 5.0}, qat={"value": 1.0, "steps": 2}, final={"value": 1.0, "passed": True})
    monkeypatch.setattr(quantize, "_gate", lambda *a, **k: record)
    logged = {}
    monkeypatch.setattr("tasks.tracking.log_metrics", lambda m, *a, **k: logged.update(m))
    r = run_stage("quantize", cfg, tmp_path, args=_args(tiny["model_dir"], tiny["shard_dir"]))
    assert (r["int8_mb"], r["bf16_mb"], r["quantized_layers"], r["size_ratio_vs_bf16"]) == (3.0, 6.0, 2, 0.5)
    assert logged["int8_mb"] == 3.0 and r["summary"].startswith("torchao int8_weight_only: 3.00 MB")


# ---- 2: quantization_config.json is held to its recorded sha256 ----


def test_a_missing_or_altered_quant_config_is_a_problem(ptq_dir, tmp_path):
    from tasks.quant.artifact import QUANT_CONFIG, verify_output

    meta = read_json(ptq_dir / "quant_meta.json")
    assert meta["quant_config_sha256"]
    d = shutil.copytree(ptq_dir, tmp_path / "q")
    assert verify_output(d) is None
    (d / QUANT_CONFIG).unlink()
    assert verify_output(d) == f"{d / QUANT_CONFIG} is missing"
    (d / QUANT_CONFIG).write_text("{}\n")
    assert "is corrupt (sha256 differs" in verify_output(d)


# ---- 3 + 4: AMCT classic PTQ (a stand-in amct_pytorch with the real API's signatures) ----


@pytest.fixture
def fake_amct(monkeypatch):
    """hicann/amct master's classic PTQ calls (tests/fixtures/npu_api/amct_pytorch-master.json signatures)."""
    from tests.helpers.amct import fake_amct_ptq

    fake = fake_amct_ptq(
        on_config=lambda config_file, model, data: Path(config_file).write_text("{}"), onnx=b"onnx" * 10
    )
    monkeypatch.setitem(sys.modules, "amct_pytorch", fake)
    return fake


def _amct_ptq(cfg, method="int8_dynamic"):
    cfg.quantize.backend, cfg.quantize.amct_flow, cfg.quantize.method = "amct", "ptq", method
    cfg.quantize.skip_layers = ["lm_head", "embed"]
    return cfg


def test_amct_ptq_records_published_onnx_paths_and_a_rerun_checks_them(cfg, tiny, fake_amct, tmp_path, capsys):
    args = _args(tiny["model_dir"], tiny["shard_dir"])
    r = run_stage("quantize", _amct_ptq(cfg), tmp_path, args=args)
    out = Path(r["quant_dir"])
    meta = read_json(out / "quant_meta.json")
    for k in ("deploy_onnx", "fake_quant_onnx"):
        assert Path(meta[k]).parent == out / "amct" and Path(meta[k]).is_file(), meta[k]
    assert run_stage("quantize", cfg, tmp_path, args=args)["reused"]
    Path(meta["deploy_onnx"]).unlink()
    again = run_stage("quantize", cfg, tmp_path, args=args)
    assert not again["reused"] and Path(meta["deploy_onnx"]).is_file()
    assert f"{meta['deploy_onnx']} is missing; rebuilding it" in capsys.readouterr().err
    Path(meta["fake_quant_onnx"]).write_bytes(b"x")  # another size than recorded
    assert not run_stage("quantize", cfg, tmp_path, args=args)["reused"]


@pytest.mark.parametrize("method", ["int8_weight_only", "smoothquant"])
def test_amct_ptq_refuses_a_method_it_does_not_implement(cfg, tiny, fake_amct, tmp_path, monkeypatch, method):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr("tasks.model.hf_io.load_hf", no_load)
    with pytest.raises(StageError, match=rf"^quantize.method {method}: quantize.amct_flow=ptq .*int8_dynamic"):
        run_stage("quantize", _amct_ptq(cfg, method), tmp_path, args=_args(tiny["model_dir"], tiny["shard_dir"]))


# ---- 5: a transformers-saved model dir (no llm-pipeline.json) with the shard set's tokenizer ----


def test_a_model_dir_without_our_manifest_records_the_shard_sets_tokenizer(cfg, tiny, tmp_path):
    from tasks.model.model_dir import MANIFEST, identity_problem, shard_tokenizer

    model_dir = shutil.copytree(tiny["model_dir"], tmp_path / "hf")
    (model_dir / MANIFEST).unlink()
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    assert shard_tokenizer(model_dir) != shard_tokenizer(tiny["shard_dir"])  # same tokenizer.json, other identity
    r = run_stage("quantize", cfg, tmp_path / "run", args=_args(model_dir, tiny["shard_dir"]))
    meta = read_json(Path(r["ptq_dir"]) / "quant_meta.json")
    assert shard_tokenizer(tiny["shard_dir"]) in meta["tokenizer"]
    assert identity_problem(meta["tokenizer"], tiny["shard_dir"], "evaluate") is None  # what evaluate asks
    again = run_stage("quantize", cfg, tmp_path / "run", args=_args(model_dir, tiny["shard_dir"]))
    assert again["reused"]
    # a result written before this fix (the model's own identity only) is rebuilt, not handed on to be refused
    (Path(r["ptq_dir"]) / "quant_meta.json").write_text(json.dumps(dict(meta, tokenizer=[shard_tokenizer(model_dir)])))
    assert not run_stage("quantize", cfg, tmp_path / "run", args=_args(model_dir, tiny["shard_dir"]))["reused"]


# ---- 6: a relative --model-dir is recorded absolute ----


def test_a_relative_model_dir_is_resolved(tiny, monkeypatch):
    from tasks.quant import inputs
    from tasks.runner import StageContext

    monkeypatch.chdir(tiny["model_dir"].parent)
    ctx = StageContext(run_dir=Path("."), stage="quantize", args=argparse.Namespace(model_dir="./hf"), inputs={})
    got = inputs.model_dir(ctx)
    assert got.is_absolute() and got == tiny["model_dir"].resolve()


# ---- 7: unreadable earlier records are rebuilt, not a traceback ----


def test_a_damaged_quant_meta_is_rebuilt(cfg, tiny, tmp_path, capsys):
    args = _args(tiny["model_dir"], tiny["shard_dir"])
    r = run_stage("quantize", cfg, tmp_path, args=args)
    meta = Path(r["ptq_dir"]) / "quant_meta.json"
    meta.write_text('{"model_dir": ')
    again = run_stage("quantize", cfg, tmp_path, args=args)
    assert not again["reused"] and read_json(meta)["quantized_layers"]
    assert f"warning: quantize: {meta} is unreadable" in capsys.readouterr().err


def test_a_damaged_gate_record_is_no_record(cfg, tiny, ptq_dir, tmp_path, capsys):
    from tasks.stages import quantize

    d = shutil.copytree(ptq_dir, tmp_path / "q")
    (d / "gate.json").write_text("{not json")
    assert quantize._reusable_gate(cfg, tiny["model_dir"], tiny["shard_dir"], d, "cpu", suite=object()) is None
    assert f"{d / 'gate.json'} is unreadable" in capsys.readouterr().err


# ---- 8: decimal MB ----


def test_sizes_are_decimal_mb():
    from tasks.stages import quantize

    meta = {
        "model_dir": "m",
        "backend": "torchao",
        "method": "int8_weight_only",
        "format": "torch_state_dict",
        "int8_bytes": 2_000_000,
        "bf16_bytes": 4_000_000,
        "fp32_bytes": 8_000_000,
        "quantized_layers": ["a"],
    }
    r = quantize._result(meta, Path("q"), reused=False)
    assert (r["int8_mb"], r["bf16_mb"], r["fp32_mb"]) == (2.0, 4.0, 8.0)


# ---- 9: docs/stages.md's reload sentence ----


def test_model_int8_reloads_weights_only_after_import_torchao(ptq_dir):
    path = ptq_dir / "model_int8.pt"
    load = f"import torch; torch.load({str(path)!r}, weights_only=True)"
    without = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
    assert without.returncode != 0 and "weights_only" in without.stderr
    subprocess.run([sys.executable, "-c", "import torchao; " + load], check=True, capture_output=True)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "stages.md").read_text()
    assert "`torch.load(weights_only=True)` after `import torchao`" in doc


# ---- 10: the skip_layers hint names each candidate once ----


def test_skip_layers_hint_has_no_duplicates():
    from tasks.quant.plan import Layer, unmatched_skips

    with pytest.raises(StageError) as e:
        unmatched_skips([Layer("output", "Linear", (8, 8)), Layer("lm_head", "Linear", (8, 8))], ["lm_hed"])
    assert str(e.value).count("'lm_head'") == 1, str(e.value)


# ---- 11: a checkpoint whose embedding has fewer rows than its tokenizer has tokens ----


def _llama(path: Path, vocab: int, tokenizer: Path) -> Path:
    """A random tiny Llama saved by transformers with `vocab` embedding rows, `tokenizer` (a tokenizer.json) beside."""
    import transformers

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = transformers.LlamaConfig(**shape, num_key_value_heads=2, max_position_embeddings=256, vocab_size=vocab)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    shutil.copyfile(tokenizer, path / "tokenizer.json")
    return path


def test_a_model_vocab_below_its_tokenizers_is_one_line_before_anything_is_written(cfg, tiny, tmp_path):
    """vocab_size below its tokenizer's tokens: quantize wrote its PTQ model, then failed in the task gate with
    `IndexError: index out of range in self` (passed, with this gate that runs no model); quantize and evaluate now
    say it in one line first. A vocab_size above the tokenizer's (a padded embedding, as Qwen2's) is fine."""
    from tasks.model.hf_io import check_tokenizers, tokenizer_ids

    tok = tiny["shard_dir"] / "tokenizer.json"
    n = tokenizer_ids(tok)
    model = _llama(tmp_path / "small", n - 57, tok)
    with pytest.raises(StageError) as e:
        run_stage("quantize", cfg, tmp_path / "run", args=_args(model, tiny["shard_dir"]))
    assert str(e.value) == (
        f"quantize: the model {model} has vocab_size {n - 57} (config.json: its embedding rows) but its tokenizer "
        f"({model / 'tokenizer.json'}) has {n} tokens: ids {n - 57}..{n - 1} index past the embedding; the "
        "checkpoint and the tokenizer are not a pair: put the tokenizer it was trained with beside it (and shard with "
        "it), or use a checkpoint whose vocab_size covers this tokenizer"
    )
    assert not (tmp_path / "run" / "quantize").exists()
    with pytest.raises(StageError, match=f"^evaluate: the model {model} has vocab_size {n - 57} "):
        check_tokenizers(model, tiny["shard_dir"], "evaluate")  # evaluate reads the same model directory
    check_tokenizers(_llama(tmp_path / "padded", n + 63, tok), tiny["shard_dir"], "quantize")


# ---- 12: NaN weights or non-finite logits are one line before any gate or QAT; a NaN figure never passes ----


def _poison(model: Path, tensor: str, nbytes: int = 4096) -> Path:
    """`nbytes` of `tensor`'s data in model.safetensors overwritten with 0xFF (NaN in fp32), as a corrupt copy."""
    path = model / "model.safetensors"
    raw = bytearray(path.read_bytes())
    size = int.from_bytes(raw[:8], "little")
    start = 8 + size + json.loads(raw[8 : 8 + size])[tensor]["data_offsets"][0]
    raw[start : start + nbytes] = b"\xff" * nbytes
    path.write_bytes(bytes(raw))
    return model


def test_nan_weights_are_one_line_before_the_gate_or_qat(cfg, tiny, tmp_path):
    """lm_head.weight holding NaN: the task gate scored the NaN reference and the NaN INT8 model alike (drop +0.00%,
    passed; evaluate registered it), and with QAT the advice was to lower train.min_lr. Now one line names the
    tensor and the fix before PTQ writes anything; evaluate loads the model the same way (load_hf)."""
    from tasks.model.hf_io import load_hf, tokenizer_ids

    tok = tiny["shard_dir"] / "tokenizer.json"
    model = _poison(_llama(tmp_path / "nan", tokenizer_ids(tok), tok), "lm_head.weight")
    said = (
        f"the model {model} holds NaN or infinite weights (lm_head.weight): its logits and perplexity are not finite, "
        "so no gate or score can judge it; the checkpoint is corrupt or its training diverged: re-export it, or use "
        "another (an earlier) checkpoint"
    )
    cfg.quantize.qat_on_fail = True
    with pytest.raises(StageError) as e:
        run_stage("quantize", cfg, tmp_path / "run", args=_args(model, tiny["shard_dir"]))
    assert str(e.value) == said
    assert not (tmp_path / "run" / "quantize").exists() and not (tmp_path / "run" / "quantize_qat").exists()
    with pytest.raises(StageError) as e:
        load_hf(model)
    assert str(e.value) == said


def test_a_reference_with_non_finite_logits_is_one_line(tiny, tmp_path):
    """Finite weights whose logits overflow (the final norm and lm_head at 1e20): the gate's reference is refused
    in one line before any INT8 model is judged against it."""
    import transformers

    from tasks.config import load_config
    from tasks.model.hf_io import tokenizer_ids
    from tasks.quant import gate

    tok = tiny["shard_dir"] / "tokenizer.json"
    model = _llama(tmp_path / "big", tokenizer_ids(tok), tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        hf.model.norm.weight.fill_(1e20)
        hf.lm_head.weight.fill_(1e20)
    hf.save_pretrained(model)
    c = load_config("demo-cpu")
    c.evaluate.gate_metric = "ppl_drop_pct"
    with pytest.raises(StageError) as e:
        gate.Gate(c, tmp_path / "run", model, tiny["shard_dir"], torch.device("cpu"))
    assert str(e.value) == (
        f"quantize: the reference model (BF16 of {model}): its logits on val tokens are not finite (NaN or infinity), "
        "so no INT8 model can be judged against it; the checkpoint is corrupt or its training diverged: re-export "
        "it, or use another (an earlier) checkpoint"
    )


def test_an_int8_model_with_nan_logits_misses_the_task_gate(tiny, monkeypatch):
    """NaN logits get task scores — the same for every such model (0.247 for FP32, BF16 and INT8 alike): a drop of
    0 passed. An INT8 model whose logits on the gate's check batch are not finite now has the figure NaN and misses."""
    from tasks.config import load_config
    from tasks.model.hf_io import load_hf
    from tasks.quant import gate

    g = gate.Gate.__new__(gate.Gate)
    g.cfg, g.device, g.metric, g.max_drop = load_config("demo-cpu"), torch.device("cpu"), gate.TASK_GATE, 2.0
    g.suite, g.tokenizer, g.ref_figures = None, None, {"macro": 0.247}
    g.probe = torch.arange(16).unsqueeze(0)
    monkeypatch.setattr(gate, "score", lambda *a, **k: {"macro": 0.247})
    model = load_hf(tiny["model_dir"]).eval()
    assert g.judge(model)["passed"]
    with torch.no_grad():
        model.output.weight.fill_(float("nan"))
    verdict = g.judge(model)
    assert not verdict["passed"] and verdict["value"] != verdict["value"]  # NaN
