"""Evaluation gate: the full-precision and the INT8 model on the same held-out tokens (perplexity, size, per-token
forward latency, greedy generations), logged to MLflow with a comparison table and plot. Perplexity drop within
evaluate.max_drop_pct → a new version in the MLflow Model Registry with alias `candidate`, promoted to `champion`
when it also beats the champion on the same validation data; otherwise the stage fails with the advice (and an
AMCT QAT hand-off config)."""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from tasks import runner, tracking
from tasks.config import PipelineConfig
from tasks.errors import StageError
from tasks.fsutil import atomic_save_figure, atomic_write_json, atomic_write_text, read_json
from tasks.quant import inputs, registry, report
from tasks.quant.artifact import META
from tasks.quant.plan import gate_advice


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=None, help="full-precision HF export (default: the train stage's)")
    runner.add_shard_dir_arg(parser, "with the val split")
    parser.add_argument("--quant-dir", default=None, help="quantized model (default: the quantize stage's)")


def _quant_dir(ctx) -> Path:
    path = getattr(ctx.args, "quant_dir", None) or ctx.inputs.get("quantize", {}).get("quant_dir")
    if not path or not (Path(path) / META).is_file():
        raise StageError("evaluate: no quantized model: run the quantize stage first or pass --quant-dir")
    return Path(path)


def _measure(cfg: PipelineConfig, model_dir: Path, shard_dir: Path, quant_dir: Path, meta: dict):
    """→ (metrics, greedy generations)."""
    import copy

    import torch

    from tasks import device as devices
    from tasks.model.hf_io import load_hf
    from tasks.quant import metrics
    from tasks.quant.artifact import load_quantized

    e = cfg.evaluate
    kind = devices.detect(cfg.hardware.device).kind
    device = devices.torch_device(kind)
    batches = inputs.val_batches(shard_dir, e.eval_batches, cfg.train.micro_batch, "validation")
    fp = load_hf(model_dir, device=device).eval()
    q = load_quantized(quant_dir, device=device)
    fp_ppl, q_ppl = metrics.perplexity(fp, batches, device), metrics.perplexity(q, batches, device)
    tokens = batches[0][0][:1, :e.latency_tokens]
    # BF16 runs beside FP32 and INT8: INT8 weight-only computes in BF16, so part of its speed-up over FP32 is BF16's.
    bf16 = copy.deepcopy(fp).to(torch.bfloat16)
    bf16.init_rope()
    lat = metrics.forward_latency({"fp32": fp, "bf16": bf16, "int8": q}, tokens, device)
    del bf16
    mb = 1024 ** 2
    m = {"fp_ppl": fp_ppl["ppl"], "int8_ppl": q_ppl["ppl"], "fp_nll": fp_ppl["nll"], "int8_nll": q_ppl["nll"],
         "eval_tokens": fp_ppl["tokens"], "ppl_drop_pct": registry.drop_pct(fp_ppl["ppl"], q_ppl["ppl"]),
         "int8_mb": meta["int8_bytes"] / mb, "bf16_mb": meta["bf16_bytes"] / mb, "fp32_mb": meta["fp32_bytes"] / mb,
         "size_ratio_vs_bf16": meta["int8_bytes"] / meta["bf16_bytes"],
         "size_ratio_vs_fp32": meta["int8_bytes"] / meta["fp32_bytes"],
         "fp32_ms_per_token": lat["fp32"] * 1e3, "bf16_ms_per_token": lat["bf16"] * 1e3,
         "int8_ms_per_token": lat["int8"] * 1e3, "latency_ratio_vs_fp32": lat["int8"] / lat["fp32"],
         "latency_ratio_vs_bf16": lat["int8"] / lat["bf16"], "latency_tokens": tokens.numel(), "device": kind,
         "method": meta["method"], "backend": meta["backend"], "max_drop_pct": e.max_drop_pct}
    gens = _generations(e, shard_dir, fp, q, device)
    return m, gens


def _generations(e, shard_dir: Path, fp, q, device) -> list[dict]:
    from tokenizers import Tokenizer

    from tasks.quant.metrics import greedy_generate

    tok = Tokenizer.from_file(str(shard_dir / "tokenizer.json"))
    out = []
    for prompt in e.prompts:
        ids = tok.encode(prompt).ids
        if not ids:
            continue
        gen = {name: tok.decode(greedy_generate(model, ids, e.max_new_tokens, model.config.max_seq_len, device))
               for name, model in (("fp", fp), ("int8", q))}
        out.append({"prompt": prompt, **gen})
    return out


def _tags(uri: str, ctx, meta: dict, m: dict, digest: str, key: str) -> dict:
    """Lineage on every version: the DAG run, the training run, the data, and this evaluation."""
    tags = {"train.run_id": ctx.inputs.get("train", {}).get("mlflow_run_id") or "unknown",
            registry.DIGEST_TAG: digest, registry.PPL_TAG: f"{m['int8_ppl']:.6f}", "eval.fp_ppl": f"{m['fp_ppl']:.6f}",
            "eval.ppl_drop_pct": f"{m['ppl_drop_pct']:.4f}", "eval.run_id": ctx.mlflow_run_id or "",
            "quant.method": meta["method"], "quant.backend": meta["backend"], "quant.key": key}
    if ctx.mlflow_run_id:
        import mlflow

        run_tags = mlflow.MlflowClient(uri).get_run(ctx.mlflow_run_id).data.tags
        tags.update({k: run_tags[k] for k in ("airflow.dag_id", "airflow.run_id") if k in run_tags})
    return tags


def _register(cfg: PipelineConfig, ctx, meta: dict, m: dict, digest: str, quant_dir: Path) -> dict:
    from tasks.quant.artifact import load_quantized, pip_requirements

    uri, name = tracking.tracking_uri(cfg), cfg.evaluate.registered_model
    # Same quantized files (names, sizes, mtimes) + same data → the same version on a rerun.
    key = hashlib.sha256(f"{inputs.fingerprint(quant_dir)}/{digest}".encode()).hexdigest()[:16]
    existing = registry.find_version(uri, name, "quant.key", key)
    champion = registry.current_champion(uri, name)
    if existing is not None:
        version = str(existing.version)
    else:
        reqs = pip_requirements(meta)
        version = registry.register(uri, name, load_quantized(quant_dir), _tags(uri, ctx, meta, m, digest, key), reqs)
    registry.set_alias(uri, name, registry.CANDIDATE, version)
    if champion is not None and champion["version"] == version:
        decision = registry.Promotion(True, f"v{version} is already the champion")
    else:
        decision = registry.champion_decision(m["int8_ppl"], digest, champion)
    if decision.promote:
        registry.set_alias(uri, name, registry.CHAMPION, version)
    return {"registered_model": name, "version": version, "champion": decision.promote,
            "champion_reason": decision.reason, "comparable": decision.comparable,
            "aliases": registry.aliases(uri, name)}


def run(cfg: PipelineConfig, ctx) -> dict:
    max_drop = registry.check_threshold(cfg.evaluate.max_drop_pct)
    quant_dir = _quant_dir(ctx)
    meta = read_json(quant_dir / META)
    # Standalone (no earlier results, no flags): the model and the shard set the quantize stage used.
    model_dir = inputs.model_dir(ctx, fallback=meta["model_dir"])
    shard_dir = runner.shard_dir(ctx, fallback=meta["shard_dir"])
    digest = inputs.manifest_digest(shard_dir)
    m, gens = _measure(cfg, model_dir, shard_dir, quant_dir, meta)

    out = ctx.run_dir / "evaluate"
    rows = report.comparison_rows(m)
    atomic_write_json(out / "comparison.json", {"metrics": m, "rows": rows, "generations": gens})
    atomic_write_text(out / "comparison.md", report.markdown(rows, m, gens))
    fig = report.figure(m)
    atomic_save_figure(fig, out / "comparison.png")
    tracking.log_metrics({k: v for k, v in m.items() if isinstance(v, (int, float))})
    tracking.log_params({"evaluate.max_drop_pct": max_drop, "evaluate.data_digest": digest})
    for f in ("comparison.json", "comparison.md", "comparison.png"):
        tracking.log_artifact(out / f, "evaluate")

    passed = m["ppl_drop_pct"] <= max_drop
    figures = (f"ppl {m['fp_ppl']:.3f} → {m['int8_ppl']:.3f} ({m['ppl_drop_pct']:+.2f}%), "
               f"{m['size_ratio_vs_bf16']:.2f}x BF16 size, {m['latency_ratio_vs_fp32']:.2f}x FP32 latency")
    result = {"passed": passed, "ppl_drop_pct": round(m["ppl_drop_pct"], 4), "fp_ppl": round(m["fp_ppl"], 4),
              "int8_ppl": round(m["int8_ppl"], 4), "size_ratio_vs_bf16": round(m["size_ratio_vs_bf16"], 4),
              "latency_ratio_vs_fp32": round(m["latency_ratio_vs_fp32"], 4),
              "latency_ratio_vs_bf16": round(m["latency_ratio_vs_bf16"], 4), "data_digest": digest,
              "comparison": str(out / "comparison.md")}
    if not passed:
        from tasks.quant.amct_backend import write_qat_handoff

        model = sample = None
        if meta["backend"] == "amct":  # AMCT's create_quant_retrain_config writes the per-layer JSON from the model
            from tasks.model.hf_io import load_hf

            model = load_hf(model_dir)
            sample = (inputs.val_batches(shard_dir, 1, cfg.train.micro_batch, "calibration")[0][0],)
        qat = write_qat_handoff(out / "qat", list(meta["layer_types"].items()), meta["skipped_layers"],
                                meta["calibration_batches"], model, sample)
        tracking.log_artifact(out / "qat", "evaluate/qat")
        reason = (f"INT8 perplexity drop {m['ppl_drop_pct']:.2f}% exceeds evaluate.max_drop_pct {max_drop}% "
                  f"({m['fp_ppl']:.3f} → {m['int8_ppl']:.3f}); try {gate_advice(meta['method'], meta['backend'])}")
        if cfg.evaluate.fail_on_gate:
            raise StageError(reason)
        return dict(result, status="warn", summary=f"gate missed: {figures}", qat=qat, reason=reason)
    if not ctx.mlflow_run_id:
        return dict(result, status="warn", summary=f"gate passed, not registered (tracking off): {figures}")
    reg = _register(cfg, ctx, meta, m, digest, quant_dir)
    tracking.set_tags({"registry.version": reg["version"], "registry.champion": reg["champion"]})
    status = "ok" if reg.pop("comparable") else "warn"
    role = "champion" if reg["champion"] else f"candidate ({reg['champion_reason']})"
    return dict(result, **reg, status=status,
                summary=f"{reg['registered_model']} v{reg['version']} {role}: {figures}")
