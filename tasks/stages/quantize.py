"""INT8 quantization of the trained model: AMCT on an Ascend host where `amct_pytorch` imports, torchao elsewhere;
layers in quantize.skip_layers stay in quantize.dtype. Writes <run-dir>/quantize/ and reports its size on disk against
the same weights saved in BF16 and FP32.

Then the gate (tasks.quant.gate, evaluate.gate_metric: by default the macro task accuracy drop over evaluate.tasks
against the unquantized model in quantize.dtype): post-training quantization first; missing the gate with
quantize.qat_on_fail → quantization-aware training (tasks.quant.qat) into <run-dir>/quantize_qat/, judged the same
way. The stage hands on the model that passed (or the last one tried, which evaluate refuses with both figures);
`gate.json` beside it records the figures, and the task scores evaluate reuses.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from tasks import runner, tracking
from tasks.config import PipelineConfig
from tasks.errors import StageError
from tasks.fsutil import atomic_write_json, read_json, recover_dir, sha256_file, swap_dir
from tasks.quant import inputs
from tasks.quant.amct_config import jsonable
from tasks.quant.artifact import (
    DTYPES,
    META,
    WEIGHTS,
    describe_layers,
    onnx_record,
    save_model,
    save_safetensors,
    verify_output,
)
from tasks.quant.plan import check_flow_method, choose_backend, select_layers, unmatched_skips
from tasks.units import MB


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=None, help="HF export to quantize (default: the train stage's)")
    runner.add_shard_dir_arg(parser, "for calibration")


def calibrates(backend: str, method: str) -> bool:
    """Whether the INT8 weights depend on the calibration batches: every AMCT flow and torchao's SmoothQuant observe
    activations; torchao weight-only and dynamic W8A8 quantize the weights alone."""
    return backend == "amct" or method == "smoothquant"


def _settings(cfg: PipelineConfig, model_dir: Path, backend: str, shard_dir: Path) -> dict:
    q = cfg.quantize
    calibrated = calibrates(backend, q.method)
    return {
        "model_dir": str(model_dir),
        "model_fingerprint": inputs.fingerprint(model_dir),
        "backend": backend,
        "method": q.method,
        "skip_layers": list(q.skip_layers),
        "dtype": q.dtype,
        "amct_flow": q.amct_flow if backend == "amct" else None,
        "calibration_batches": q.calibration_batches,
        "calibration_rule": inputs.SPLIT_RULE,
        # the tokens calibrated on: which shard set (its manifest digest) and how many sequences a batch holds
        # (train.micro_batch); None where the method reads no calibration data, so another shard set reuses it
        "calibration_data_digest": inputs.manifest_digest(shard_dir) if calibrated else None,
        "calibration_batch_size": cfg.train.micro_batch if calibrated else None,
    }  # an artifact calibrated on other tokens is not reused


def run(cfg: PipelineConfig, ctx) -> dict:
    from tasks import device as devices
    from tasks.model.hf_io import check_tokenizers

    inputs.check_hf_path(cfg, ctx)
    model_dir, shard_dir = inputs.model_dir(ctx), runner.shard_set(cfg, ctx)
    runner.verified(cfg, shard_dir, "val", "for calibration and the quality gate")
    check_tokenizers(model_dir, shard_dir, "quantize")  # calibrating on another tokenizer's ids is silent otherwise
    kind = devices.detect(cfg.hardware.device).kind
    suite = None
    if cfg.evaluate.gate_metric == "task_accuracy_drop_pct":  # the tasks checked before any model is loaded
        from tasks.quant.gate import load_suite

        suite = load_suite(cfg, ctx.run_dir, shard_dir, model_dir)
    meta, out, reused = _ptq(cfg, ctx, model_dir, shard_dir, kind)
    result = _result(meta, out, reused)
    if meta["format"] == "onnx":  # AMCT's ONNX flow: nothing here runs it; evaluate says how to judge it
        return result
    record = _reusable_gate(cfg, model_dir, shard_dir, out, kind, suite) if reused else None
    if record is None:
        record = _gate(cfg, ctx, model_dir, shard_dir, out, meta, devices.torch_device(kind), kind, suite)
    g = record["final"]
    if Path(record["quant_dir"]) != out:  # QAT's model is handed on: its sizes, not PTQ's, are the result's
        handed_on = _result(read_json(Path(record["quant_dir"]) / META), out, reused)
        sizes = {k: handed_on[k] for k in SIZE_FIGURES}
        result.update(sizes, summary=handed_on["summary"])
        tracking.log_metrics(sizes)
    result.update(
        quant_dir=record["quant_dir"],
        ptq_dir=str(out),
        gate={k: record[k] for k in ("metric", "max_drop_pct", "passed_by")} | {"ptq": record["ptq"]["value"]},
    )
    what = f"{record['metric']} {g['value']:+.2f}% (≤{record['max_drop_pct']:g}%)"
    if record.get("qat"):
        result["gate"]["qat"] = record["qat"]["value"]
        verdict = "passed after QAT" if g["passed"] else "missed after PTQ and QAT"
        what = f"PTQ {record['ptq']['value']:+.2f}%, QAT {record['qat']['steps']} steps {g['value']:+.2f}%"
        result["summary"] = f"{result['summary']}; gate {verdict}: {what} (≤{record['max_drop_pct']:g}%)"
    else:
        result["summary"] = f"{result['summary']}; gate {'passed' if g['passed'] else 'missed'}: {what}"
    result["status"] = "ok" if g["passed"] else "warn"
    tracking.log_metrics({"gate.ptq_value": record["ptq"]["value"], "gate.value": g["value"]})
    return result


def _ptq(cfg: PipelineConfig, ctx, model_dir: Path, shard_dir: Path, kind: str) -> tuple[dict, Path, bool]:
    """Post-training quantization into <run-dir>/quantize/ (reused when the same settings wrote it intact)."""
    import torch

    from tasks import device as devices
    from tasks.model.hf_io import load_hf
    from tasks.quant import metrics

    q = cfg.quantize
    amct_error = None
    if q.backend != "torchao":
        from tasks.quant.amct_backend import amct_import_error

        amct_error = amct_import_error()
    backend = choose_backend(q.backend, amct_error, kind, q.amct_flow, q.dtype)
    check_flow_method(backend, q.amct_flow, q.method)
    settings = _settings(cfg, model_dir, backend, shard_dir)
    out = ctx.run_dir / "quantize"
    recover_dir(out)
    old = _earlier(out / META)
    if old is not None and {k: old.get(k) for k in settings} == settings:
        problem = verify_output(out)
        if problem is None and old.get("format") == "torch_state_dict" and "safetensors_sha256" not in old:
            problem = "written before the safetensors form was"
        if problem is None and sorted(old.get("tokenizer") or []) != sorted(_tokenizers(model_dir, shard_dir)):
            problem = "its recorded tokenizer identities are not the ones evaluate is to accept now"
        if problem is None:
            return old, out, True
        print(f"warning: quantize: {problem}; rebuilding it", file=sys.stderr, flush=True)

    model = load_hf(model_dir, device="cpu").eval()
    fp32_bytes = metrics.state_dict_bytes(model, torch.float32)
    bf16_bytes = metrics.state_dict_bytes(model, torch.bfloat16)
    layers = describe_layers(model)
    unmatched_skips(layers, q.skip_layers)  # the whole model's layers: a typo is named, not quantized
    names = select_layers(layers, backend, q.amct_flow, q.method, q.skip_layers)
    skipped = [layer.name for layer in layers if layer.name not in names and len(layer.shape) >= 2]
    # Read for every method (SmoothQuant and AMCT calibrate on them): an empty val split fails here, not in evaluate.
    # Only the calibration part of the val split (inputs.SPLIT_RULE): evaluate measures on the disjoint rest.
    calib, calib_split = inputs.val_part(shard_dir, q.calibration_batches, cfg.train.micro_batch, "calibration")
    device = devices.torch_device(kind) if backend == "amct" else torch.device("cpu")
    # AMCT's ONNX PTQ calibrates an FP32 graph (ATC picks the deploy precision); the other flows run in q.dtype.
    dtype = torch.float32 if backend == "amct" and q.amct_flow == "ptq" else DTYPES[q.dtype]
    model.to(device=device, dtype=dtype)
    model.init_rope()  # the cast rounded the RoPE table to quantize.dtype: recompute it in fp32

    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".quantize.", dir=ctx.run_dir))
    meta = dict(
        settings,
        shard_dir=str(shard_dir),
        data_digest=inputs.manifest_digest(shard_dir),
        calibration_split=calib_split,
        quantized_layers=names,
        skipped_layers=skipped,
        layer_types={layer.name: layer.type for layer in layers if layer.name in names},
        fp32_bytes=fp32_bytes,
        bf16_bytes=bf16_bytes,
        tokenizer=_tokenizers(model_dir, shard_dir),  # checked by evaluate against its shard set
    )
    try:
        if backend == "torchao":
            from tasks.quant import torchao_backend

            torchao_backend.quantize(model, q.method, names, calib, device)
            done = torchao_backend.quantized_names(model)
            if sorted(done) != sorted(names):
                raise StageError(f"quantize: torchao left {sorted(set(names) - set(done))[:3]} unquantized")
            meta["format"] = "torch_state_dict"
        elif q.amct_flow == "llm":
            from tasks.quant.amct_backend import quantize_llm

            meta["amct_config"] = jsonable(quantize_llm(model, q.method, skipped, calib, device))
            meta["format"] = "torch_module"
        else:
            from tasks.quant.amct_backend import quantize_ptq

            meta.update(quantize_ptq(model, skipped, calib, tmp / "amct", device), format="onnx")
            meta.update(onnx_record(tmp, meta, tmp))  # their sizes, checked by verify_output
        if meta["format"] != "onnx":
            save_model(model, tmp / WEIGHTS, meta["format"])
            meta["int8_bytes"] = metrics.size_on_disk(tmp / WEIGHTS)
            meta["weights_sha256"] = sha256_file(tmp / WEIGHTS)  # checked whenever the file is reused
            if meta["format"] == "torch_state_dict":  # the same tensors without pickle, + quantization_config.json
                meta.update(save_safetensors(model, tmp, meta))
        else:
            meta["int8_bytes"] = metrics.size_on_disk(meta["deploy_onnx"])
        atomic_write_json(tmp / META, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_dir(tmp, out)  # an older result is replaced only by a complete new one, never a moment with neither
    if meta["format"] == "onnx":  # AMCT wrote them under the temporary folder: point them at the published one
        meta.update(onnx_record(out, meta, tmp))
        atomic_write_json(out / META, meta)
    result = _result(meta, out, reused=False)
    tracking.log_params(
        {
            "quantize": {k: v for k, v in settings.items() if k != "model_dir"},
            "split": {
                "rule": calib_split["rule"],
                "calibration_sequences": calib_split["sequences"],
                "calibration_keys_digest": calib_split["keys_digest"],
            },
        }
    )
    tracking.log_metrics({k: result[k] for k in SIZE_FIGURES})
    tracking.log_json_artifact(meta, "quantize/quant_meta.json")
    return meta, out, False


def _gate_settings(cfg, shard_dir: Path) -> dict:
    """What the verdict and the QAT model it may hand on depend on besides the PTQ model and the task key: the gate
    and, where QAT may run, everything tasks.quant.qat reads (its training batches: the shard set, train.micro_batch,
    train.seed; its optimizer: train.min_lr, train.weight_decay, train.grad_clip)."""
    q, t = cfg.quantize, cfg.train
    qat = q.qat_on_fail  # without QAT the verdict is PTQ's alone: a new seed or shard set need not judge it again
    return {
        "metric": cfg.evaluate.gate_metric,
        "max_drop_pct": cfg.evaluate.max_drop_pct,
        "qat_on_fail": q.qat_on_fail,
        "qat_steps": q.qat_steps,
        "qat_lr": t.min_lr,
        "qat_data_digest": inputs.manifest_digest(shard_dir) if qat else None,
        "qat_micro_batch": t.micro_batch if qat else None,
        "qat_seed": t.seed if qat else None,
        "qat_weight_decay": t.weight_decay if qat else None,
        "qat_grad_clip": t.grad_clip if qat else None,
    }


def _reusable_gate(cfg, model_dir: Path, shard_dir: Path, ptq_dir: Path, kind: str, suite) -> dict | None:
    """A rerun on a reused PTQ model: the earlier verdict, when it was reached on the same tasks, models and gate
    settings and the model it handed on is intact (task gate only: its key says what was measured)."""
    from tasks.quant import gate

    record = _earlier(ptq_dir / gate.RECORD) if suite is not None else None
    if record is None:
        return None
    final = Path(record.get("quant_dir", ""))
    if record.get("settings") != _gate_settings(cfg, shard_dir) or _earlier(final / META) is None:
        return None
    if verify_output(final):
        return None
    return record if record.get("key") == gate.record_key(cfg, suite, model_dir, final, kind) else None


def _gate(cfg, ctx, model_dir: Path, shard_dir: Path, ptq_dir: Path, meta: dict, device, kind: str, suite) -> dict:
    """PTQ judged; QAT when it misses and quantize.qat_on_fail. The record goes beside each judged model."""
    from tasks.quant import gate
    from tasks.quant import qat as qat_flow
    from tasks.quant.artifact import load_quantized

    g = gate.Gate(cfg, ctx.run_dir, model_dir, shard_dir, device, suite=suite)
    ptq = g.judge(load_quantized(ptq_dir, device=device))
    record = {
        "settings": _gate_settings(cfg, shard_dir),
        "metric": g.metric,
        "max_drop_pct": g.max_drop,
        "ptq": {"value": ptq["value"], "passed": ptq["passed"]},
        "qat": None,
        "quant_dir": str(ptq_dir),
    }
    final, final_dir = ptq, ptq_dir
    if not ptq["passed"] and cfg.quantize.qat_on_fail:
        qat = qat_flow.run(cfg, model_dir, shard_dir, meta, ctx.run_dir, device)
        final_dir = Path(qat["quant_dir"])
        final = g.judge(qat.get("model") or load_quantized(final_dir, device=device))
        record["qat"] = {
            "value": final["value"],
            "passed": final["passed"],
            "steps": len(qat["losses"]),
            "final_loss": qat["losses"][-1] if qat["losses"] else None,
            "seconds": qat["seconds"],
        }
        record["quant_dir"] = str(final_dir)
        tracking.log_metrics({"qat.steps": len(qat["losses"]), "qat.seconds": qat["seconds"]})
    record["final"] = {"value": final["value"], "passed": final["passed"]}
    record["passed_by"] = ("qat" if record["qat"] else "ptq") if final["passed"] else None
    if g.metric == gate.TASK_GATE:  # what evaluate would measure again: the reference's and this model's scores
        record["key"] = gate.record_key(cfg, g.suite, model_dir, final_dir, kind)
        record["ref_scores"], record["int8_scores"] = g.ref_figures, final["figures"]
    for folder in {ptq_dir, final_dir}:
        atomic_write_json(folder / gate.RECORD, record)
    tracking.log_json_artifact({k: v for k, v in record.items() if not k.endswith("_scores")}, "quantize/gate.json")
    return record


def _earlier(path: Path) -> dict | None:
    """An earlier run's JSON record, or None when there is none or it is unreadable (a warning naming it: the
    result is rebuilt, as a damaged model_int8.pt is)."""
    if not path.is_file():
        return None
    try:
        record = read_json(path)
    except (OSError, ValueError) as e:
        print(f"warning: quantize: {path} is unreadable ({e}); rebuilding it", file=sys.stderr, flush=True)
        return None
    if not isinstance(record, dict):
        print(f"warning: quantize: {path} is not a JSON object; rebuilding it", file=sys.stderr, flush=True)
        return None
    return record


def _tokenizers(model_dir: Path, shard_dir: Path) -> list[str]:
    """The tokenizer identities evaluate accepts for this model: its own; for a model directory without our manifest
    whose tokenizer check_tokenizers found the same as the shard set's, the shard set's too (as write_manifest
    records both), so evaluate's comparison agrees with quantize's."""
    from tasks.model.model_dir import accepted_tokenizers, read_manifest, shard_tokenizer

    own = accepted_tokenizers(model_dir)
    if not own or read_manifest(model_dir) is not None:
        return own
    return list(dict.fromkeys([*own, *filter(None, [shard_tokenizer(shard_dir)])]))


SIZE_FIGURES = ("int8_mb", "bf16_mb", "fp32_mb", "size_ratio_vs_bf16", "size_ratio_vs_fp32", "quantized_layers")


def _result(meta: dict, out: Path, reused: bool) -> dict:
    mb = MB  # decimal, as every memory figure (tasks.units)
    r = {
        "quant_dir": str(out),
        "model_dir": meta["model_dir"],
        "backend": meta["backend"],
        "method": meta["method"],
        "format": meta["format"],
        "int8_mb": round(meta["int8_bytes"] / mb, 3),
        "bf16_mb": round(meta["bf16_bytes"] / mb, 3),
        "fp32_mb": round(meta["fp32_bytes"] / mb, 3),
        "size_ratio_vs_bf16": round(meta["int8_bytes"] / meta["bf16_bytes"], 4),
        "size_ratio_vs_fp32": round(meta["int8_bytes"] / meta["fp32_bytes"], 4),
        "quantized_layers": len(meta["quantized_layers"]),
        "reused": reused,
    }
    ref = "FP16" if meta.get("dtype") == "fp16" else "BF16"  # the 16-bit reference (the same bytes either way)
    r["summary"] = (
        f"{meta['backend']} {meta['method']}: {r['int8_mb']:.2f} MB = {r['size_ratio_vs_bf16']:.2f}x "
        f"{ref}, {r['size_ratio_vs_fp32']:.2f}x FP32 ({r['quantized_layers']} layers INT8)"
    )
    r["status"] = "ok"
    return r
