"""Quantization-aware training when PTQ misses the gate (the guides' rule: PTQ first; over a 2 % drop, QAT).

From the trained FP checkpoint: fake-quantize the same layers PTQ chose, fine-tune `quantize.qat_steps` optimizer
steps on the training shards at `train.min_lr` (the end of the training schedule, where the weights came from),
then convert to the same INT8 format as PTQ.

- torchao (CPU/CUDA): the `qat_int8` model converter (tasks/quant/fake_quant.py) on the layers PTQ chose — torchao's
  FakeQuantizedLinear with int8 per-channel symmetric weights (W8A8 adds int8 per-token activations), the MoE
  experts' stacked weights int8 per row — then, the converter reverted, the PTQ config on the same names
  (`quantize_` with torchao_backend._configs, what `QATConfig(<the PTQ config>, step="convert")` applies) and the
  experts and the embedding (INT8 weight-only per row) as PTQ quantizes them (torchao_backend.quantize); the
  quantized names checked against PTQ's list, as PTQ checks them.
- AMCT (Ascend): `amct_backend.quantize_retrain` (create_quant_retrain_config → create_quant_retrain_model → train →
  save_quant_retrain_model), where the installed AMCT has those functions.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from tasks.errors import StageError
from tasks.fsutil import atomic_write_json, recover_dir, sha256_file, swap_dir

QAT_DIR = "quantize_qat"


def train_batches(shard_dir: Path, batch_size: int, seed: int):
    from data_prep.loader import ShardLoader

    return ShardLoader(shard_dir, split="train", batch_size=batch_size, num_workers=0, seed=seed).batches()


def finetune(model, steps: int, batches, lr: float, weight_decay: float, grad_clip: float, device) -> list[float]:
    """`steps` AdamW steps on `batches` (an iterator of (inputs, targets)); returns the losses."""
    from tasks.model.loss import lm_loss

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    losses = []
    for _, (inputs, targets) in zip(range(steps), batches):
        loss = lm_loss(model(inputs.to(device)), targets.to(device))
        if not torch.isfinite(loss):
            raise StageError(
                f"QAT: loss became {loss.item()} at step {len(losses)}; lower train.min_lr or quantize.qat_steps"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses


def torchao_qat(
    model,
    method: str,
    names,
    steps: int,
    batches,
    lr: float,
    weight_decay: float,
    grad_clip: float,
    dtype: torch.dtype,
    device,
) -> tuple[torch.nn.Module, list[float]]:
    """Fake quant (the qat_int8 converter) → fine-tune in fp32 → revert, cast to `dtype` → convert to torchao INT8
    exactly as PTQ converts the same names; in place."""
    from torchao.quantization import quantize_

    from tasks.quant.fake_quant import QatInt8
    from tasks.quant.torchao_backend import _configs, _quantize_experts

    wanted = set(names)
    converter = QatInt8(layers=names, method=method)  # the model converter training runs can list
    converter.convert(model)
    losses = finetune(model, steps, batches, lr, weight_decay, grad_clip, device)
    converter.revert()  # the fine-tuned full-precision weights stay; the fake quantizers go
    model.eval().to(dtype)
    model.init_rope()
    _quantize_experts(model, method, wanted)
    # the embedding INT8 weight-only per row whatever the method, as torchao_backend.quantize does in PTQ
    quantize_(
        model,
        _configs("int8_weight_only"),
        filter_fn=lambda m, fqn: fqn in wanted and isinstance(m, torch.nn.Embedding),
    )
    quantize_(model, _configs(method), filter_fn=lambda m, fqn: fqn in wanted and isinstance(m, torch.nn.Linear))
    return model, losses


def run(cfg, model_dir: Path, shard_dir: Path, ptq_meta: dict, run_dir: Path, device) -> dict:
    """QAT from the FP checkpoint with PTQ's layer choice; writes <run-dir>/quantize_qat/ (torchao: PTQ's format;
    AMCT: the retrained module + the deploy ONNX). → {"quant_dir", "meta", "losses", "seconds"} (AMCT: also "model",
    the in-memory retrained model)."""
    from tasks.model.hf_io import load_hf
    from tasks.quant import metrics
    from tasks.quant.artifact import DTYPES, META, WEIGHTS, onnx_record, save_model, save_safetensors

    q, t = cfg.quantize, cfg.train
    started = time.time()
    model = load_hf(model_dir, device=device)
    batches = train_batches(shard_dir, t.micro_batch, t.seed)
    names = ptq_meta["quantized_layers"]
    ctx_dir = Path(run_dir)
    ctx_dir.mkdir(parents=True, exist_ok=True)
    recover_dir(ctx_dir / QAT_DIR)  # an earlier crash between swap_dir's renames undone; stale temp dirs removed
    tmp = Path(tempfile.mkdtemp(prefix=".quantize_qat.", dir=ctx_dir))
    meta = {
        k: v
        for k, v in ptq_meta.items()
        if k
        not in (
            "int8_bytes",
            "deploy_onnx",
            "fake_quant_onnx",
            "amct_config",
            "weights_sha256",
            "safetensors_bytes",
            "safetensors_sha256",
            "quant_config_sha256",
            "onnx_bytes",
        )
    }
    meta.update(stage="qat", qat_steps=q.qat_steps, qat_lr=t.min_lr)
    out = {}
    try:
        if ptq_meta["backend"] == "torchao":
            model, losses = torchao_qat(
                model,
                ptq_meta["method"],
                names,
                q.qat_steps,
                batches,
                t.min_lr,
                t.weight_decay,
                t.grad_clip,
                DTYPES[q.dtype],
                device,
            )
            from tasks.quant.torchao_backend import quantized_names

            done = quantized_names(model)  # the same check as PTQ's: a listed layer left unquantized is refused
            if sorted(done) != sorted(names):
                missed = sorted(set(names) - set(done))[:3]
                raise StageError(f"quantize: QAT left {missed} unquantized (quant_meta.json lists them as INT8)")
            meta["format"] = "torch_state_dict"
            save_model(model, tmp / WEIGHTS, meta["format"])
            meta["int8_bytes"] = metrics.size_on_disk(tmp / WEIGHTS)
            meta["weights_sha256"] = sha256_file(tmp / WEIGHTS)  # checked whenever the file is loaded (evaluate)
            meta.update(save_safetensors(model, tmp, meta))  # the same tensors without pickle, as PTQ's
        else:
            from tasks.quant.amct_backend import quantize_retrain

            sample = (next(iter(train_batches(shard_dir, 1, t.seed)))[0].to(device),)
            retrained, losses, paths = quantize_retrain(
                model,
                ptq_meta["skipped_layers"],
                sample,
                tmp / "amct",
                lambda m: finetune(m, q.qat_steps, batches, t.min_lr, t.weight_decay, t.grad_clip, device),
            )
            # The retrained (fake-quant) module is what the gate judged: saved as AMCT's LLM flow saves its model,
            # so evaluate measures and registers the same; the deploy ONNX for ATC beside it.
            out["model"] = retrained.eval()
            save_model(out["model"], tmp / WEIGHTS, "torch_module")
            meta.update(paths, format="torch_module", int8_bytes=metrics.size_on_disk(paths["deploy_onnx"]))
        meta["qat_final_loss"] = losses[-1] if losses else None
        atomic_write_json(tmp / META, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dest = ctx_dir / QAT_DIR
    swap_dir(tmp, dest)  # the previous QAT result stays until this one is complete
    if "deploy_onnx" in meta:  # the ONNX paths were written under tmp: point them at the published folder
        meta.update(onnx_record(dest, meta, tmp))
        atomic_write_json(dest / META, meta)
    return dict(out, quant_dir=str(dest), meta=meta, losses=losses, seconds=time.time() - started)
