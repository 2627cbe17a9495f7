"""INT8 post-training quantization of the trained model: AMCT on an Ascend host where `amct_pytorch` imports,
torchao elsewhere; layers in quantize.skip_layers stay in quantize.dtype. Writes <run-dir>/quantize/ and reports
its size on disk against the same weights saved in BF16 and FP32."""

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
from tasks.quant.artifact import DTYPES, META, WEIGHTS, describe_layers, save_model, verify_output
from tasks.quant.plan import choose_backend, select_layers


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=None, help="HF export to quantize (default: the train stage's)")
    runner.add_shard_dir_arg(parser, "for calibration")


def _settings(cfg: PipelineConfig, model_dir: Path, backend: str) -> dict:
    q = cfg.quantize
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
    }  # an artifact calibrated on other tokens is not reused


def run(cfg: PipelineConfig, ctx) -> dict:
    import torch

    from tasks import device as devices
    from tasks.model.hf_io import check_tokenizers, load_hf
    from tasks.model.model_dir import accepted_tokenizers
    from tasks.quant import metrics

    q = cfg.quantize
    model_dir, shard_dir = inputs.model_dir(ctx), runner.shard_set(cfg, ctx)
    check_tokenizers(model_dir, shard_dir, "quantize")  # calibrating on another tokenizer's ids is silent otherwise
    kind = devices.detect(cfg.hardware.device).kind
    amct_error = None
    if q.backend != "torchao":
        from tasks.quant.amct_backend import amct_import_error

        amct_error = amct_import_error()
    backend = choose_backend(q.backend, amct_error, kind, q.amct_flow, q.dtype)
    settings = _settings(cfg, model_dir, backend)
    out = ctx.run_dir / "quantize"
    recover_dir(out)
    if (out / META).is_file() and {k: read_json(out / META).get(k) for k in settings} == settings:
        problem = verify_output(out)
        if problem is None:
            return _result(read_json(out / META), out, reused=True)
        print(f"warning: quantize: {problem}; rebuilding it", file=sys.stderr, flush=True)

    model = load_hf(model_dir, device="cpu").eval()
    fp32_bytes = metrics.state_dict_bytes(model, torch.float32)
    bf16_bytes = metrics.state_dict_bytes(model, torch.bfloat16)
    layers = describe_layers(model)
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
        tokenizer=accepted_tokenizers(model_dir),  # checked by evaluate against its shard set
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
        if meta["format"] != "onnx":
            save_model(model, tmp / WEIGHTS, meta["format"])
            meta["int8_bytes"] = metrics.size_on_disk(tmp / WEIGHTS)
            meta["weights_sha256"] = sha256_file(tmp / WEIGHTS)  # checked whenever the file is reused
        else:
            meta["int8_bytes"] = metrics.size_on_disk(meta["deploy_onnx"])
        atomic_write_json(tmp / META, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_dir(tmp, out)  # an older result is replaced only by a complete new one, never a moment with neither
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
    tracking.log_metrics(
        {
            k: result[k]
            for k in ("int8_mb", "bf16_mb", "fp32_mb", "size_ratio_vs_bf16", "size_ratio_vs_fp32", "quantized_layers")
        }
    )
    tracking.log_json_artifact(meta, "quantize/quant_meta.json")
    return result


def _result(meta: dict, out: Path, reused: bool) -> dict:
    mb = 1024**2
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
    r["summary"] = (
        f"{meta['backend']} {meta['method']}: {r['int8_mb']:.2f} MB = {r['size_ratio_vs_bf16']:.2f}x "
        f"BF16, {r['size_ratio_vs_fp32']:.2f}x FP32 ({r['quantized_layers']} layers INT8)"
    )
    r["status"] = "ok"
    return r
