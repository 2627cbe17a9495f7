"""What decides that quantize reuses its INT8 model and gate verdict: the calibration data (shard set, batch size)
for the methods that calibrate, and every input QAT reads for the gate/QAT record."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tasks.quant import inputs
from tasks.runner import run_stage
from tasks.stages import quantize
from tests.helpers.quant_fixture import grammar_task, shard_set, tiny_trained


def _other_shard_set(base: Path, shard_dir: Path) -> Path:
    """Another shard set (other documents) with the fixture's tokenizer: the same model may calibrate on it."""
    return shard_set(base / "quant-reuse-other", docs=200, seed=1, tokenizer=str(shard_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    t = tiny_trained(base)
    other = _other_shard_set(base, t["shard_dir"])
    assert inputs.manifest_digest(other) != inputs.manifest_digest(t["shard_dir"])
    return dict(t, other=other, grammar=grammar_task(base / "grammar-task"))


@pytest.fixture
def cfg(cfg, tiny):
    cfg.evaluate.tasks = [str(tiny["grammar"])]
    return cfg


@pytest.mark.parametrize(
    "backend,method,calibrates",
    [
        ("torchao", "smoothquant", True),
        ("amct", "int8_weight_only", True),  # every AMCT flow runs calibration forwards
        ("amct", "smoothquant", True),
        ("torchao", "int8_weight_only", False),
        ("torchao", "int8_dynamic", False),
    ],
)
def test_ptq_settings_name_the_calibration_data(cfg, tiny, backend, method, calibrates):
    cfg.quantize.method = method
    a = quantize._settings(cfg, tiny["model_dir"], backend, tiny["shard_dir"])
    assert quantize._settings(cfg, tiny["model_dir"], backend, tiny["shard_dir"]) == a  # same inputs: reused
    other_set = quantize._settings(cfg, tiny["model_dir"], backend, tiny["other"])
    cfg.train.micro_batch = 1
    other_batch = quantize._settings(cfg, tiny["model_dir"], backend, tiny["shard_dir"])
    if calibrates:
        assert a["calibration_data_digest"] == inputs.manifest_digest(tiny["shard_dir"])
        assert other_set != a and other_batch != a
    else:  # weights alone decide these INT8 weights: another shard set or batch size reuses them
        assert other_set == a and other_batch == a


@pytest.mark.parametrize(
    "field,value", [("seed", 5), ("micro_batch", 1), ("weight_decay", 0.0), ("grad_clip", 0.5), ("min_lr", 1e-5)]
)
def test_gate_settings_name_every_qat_input(cfg, tiny, field, value):
    """QAT (tasks/quant/qat.py) trains on train_batches(shard_dir, micro_batch, seed) with AdamW(min_lr,
    weight_decay) and grad_clip: a change to any of them must not reuse the QAT model and its verdict."""
    base = getattr(cfg.train, field)
    assert base != value
    a = quantize._gate_settings(cfg, tiny["shard_dir"])
    setattr(cfg.train, field, value)
    assert quantize._gate_settings(cfg, tiny["shard_dir"]) != a
    setattr(cfg.train, field, base)
    assert quantize._gate_settings(cfg, tiny["shard_dir"]) == a
    assert quantize._gate_settings(cfg, tiny["other"]) != a  # QAT's training batches come from the shard set


def test_gate_settings_without_qat_ignore_qat_inputs(cfg, tiny):
    cfg.quantize.qat_on_fail = False  # no QAT: the verdict is PTQ's alone
    a = quantize._gate_settings(cfg, tiny["shard_dir"])
    cfg.train.seed, cfg.train.micro_batch, cfg.train.weight_decay, cfg.train.grad_clip = 5, 1, 0.0, 0.5
    assert quantize._gate_settings(cfg, tiny["other"]) == a


def test_smoothquant_rerun_on_another_shard_set_calibrates_again(cfg, tiny, tmp_path):
    from tasks import device as devices
    from tasks.fsutil import read_json
    from tasks.quant.gate import load_suite

    def args(shard_dir):
        return argparse.Namespace(model_dir=str(tiny["model_dir"]), shard_dir=str(shard_dir))

    cfg.quantize.method = "smoothquant"
    first = run_stage("quantize", cfg, tmp_path, args=args(tiny["shard_dir"]))
    assert not first["reused"]
    again = run_stage("quantize", cfg, tmp_path, args=args(tiny["other"]))
    meta = read_json(Path(again["ptq_dir"]) / "quant_meta.json")
    assert not again["reused"] and meta["data_digest"] == inputs.manifest_digest(tiny["other"])
    assert meta["shard_dir"] == str(tiny["other"])

    # the gate record just written: reused as it is, not once a QAT input changed
    kind = devices.detect(cfg.hardware.device).kind
    suite = load_suite(cfg, tmp_path, tiny["other"], tiny["model_dir"])
    ptq_dir = Path(again["ptq_dir"])
    assert quantize._reusable_gate(cfg, tiny["model_dir"], tiny["other"], ptq_dir, kind, suite) is not None
    assert quantize._reusable_gate(cfg, tiny["model_dir"], tiny["shard_dir"], ptq_dir, kind, suite) is None
    cfg.train.seed = 5
    assert quantize._reusable_gate(cfg, tiny["model_dir"], tiny["other"], ptq_dir, kind, suite) is None


def _altered_header_copy(shard_dir: Path, out: Path) -> Path:
    """A copy of the shard set whose first val shard has one tar header field changed (its checksum fixed): the same
    size and the same samples (their crc32 still match), other bytes than the manifest's sha256."""
    import shutil

    from data_prep.manifest import load_manifest, shards

    shutil.copytree(shard_dir, out)
    path = out / shards(load_manifest(out), "val")[0]["name"]
    data = bytearray(path.read_bytes())
    data[265:269] = b"evil"  # the first member's uname (ustar offset 265)
    data[148:156] = b" " * 8  # the checksum is computed with its own field as spaces
    data[148:156] = f"{sum(data[:512]):06o}\0 ".encode()
    path.write_bytes(bytes(data))
    return out


def test_an_altered_val_shard_is_refused_by_quantize_with_verify_sha256(cfg, tiny, tmp_path):
    """data.verify_sha256 (on in the DAG) covers what quantize calibrates and gates on and what evaluate scores, as it
    covers what smoke and train read: a val shard of the right size with other bytes is one line naming it, before
    anything is loaded."""
    from tasks.errors import ConfigError

    altered = _altered_header_copy(tiny["shard_dir"], tmp_path / "altered")
    args = argparse.Namespace(model_dir=str(tiny["model_dir"]), shard_dir=str(altered))
    cfg.data.verify_sha256 = True
    with pytest.raises(ConfigError, match=r"shards \(val split, for calibration and the quality gate\): .*sha256"):
        run_stage("quantize", cfg, tmp_path / "run", args=args)
    # evaluate likewise: a model quantized on the intact set, then evaluated on the altered one
    run_stage(
        "quantize",
        cfg,
        tmp_path / "run",
        args=argparse.Namespace(**{**vars(args), "shard_dir": str(tiny["shard_dir"])}),
    )
    with pytest.raises(ConfigError, match=r"shards \(val split, for the evaluation\): .*sha256"):
        run_stage("evaluate", cfg, tmp_path / "run", args=argparse.Namespace(shard_dir=str(altered)))


def test_missing_inputs_name_their_cause(tmp_path):
    """After `train --no-export`, quantize names the flag (not "run the train stage first"); evaluate's --quant-dir
    that holds no quantized model is named as given (not "run the quantize stage first")."""
    from tasks.errors import StageError
    from tasks.runner import StageContext
    from tasks.stages import evaluate

    ok = {"status": "ok", "checkpoint": str(tmp_path / "checkpoints" / "step-6"), "hf_dir": None}
    ctx = StageContext(run_dir=tmp_path, stage="quantize", args=argparse.Namespace(), inputs={"train": ok})
    with pytest.raises(StageError, match=r"^quantize: the train stage here finished without an HF export \(--no-e"):
        inputs.model_dir(ctx)
    ctx = StageContext(run_dir=tmp_path, stage="evaluate", args=argparse.Namespace(quant_dir=str(tmp_path / "nope")))
    with pytest.raises(StageError, match=r"^evaluate: --quant-dir .*/nope holds no quantized model \(no quant_meta"):
        evaluate._quant_dir(ctx)


def test_a_skip_layers_entry_matching_no_layer_is_refused(cfg, tiny, tmp_path):
    """`lm_hed` would quantize the output projection the user meant to keep, without a word: one line naming the
    entry and the nearest names. The defaults stay accepted where they match nothing (a tied model's lm_head)."""
    from tasks.errors import StageError

    cfg.quantize.skip_layers = ["lm_hed", "embed"]
    args = argparse.Namespace(model_dir=str(tiny["model_dir"]), shard_dir=str(tiny["shard_dir"]))
    with pytest.raises(StageError, match=r"quantize.skip_layers: 'lm_hed' matches no layer .*did you mean 'lm_head'"):
        run_stage("quantize", cfg, tmp_path / "run", args=args)
