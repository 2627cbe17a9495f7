"""Evaluation gate: the INT8 model against the unquantized model (in quantize.dtype, BF16 by default: what INT8
replaces) on the evaluation part of the val split — disjoint from the calibration part (inputs.SPLIT_RULE).

Measured side by side: perplexity, next-token top-1 accuracy, agreement of greedy continuations (INT8 vs BF16 over
evaluate.prompts and a fixed sample of evaluation windows), size on disk, and prefill/decode speed (KV cache,
batch 1) against BF16 and FP32 from the same run. The gate applies evaluate.max_drop_pct to evaluate.gate_metric
(default the relative top-1 accuracy drop). Passing → a new version in the MLflow Model Registry with alias
`candidate`, promoted to `champion` when it also beats the champion on the same data. Missing it with
quantize.qat_on_fail → quantization-aware training (tasks.quant.qat) and the same gate again on the same data; the
registered version says whether PTQ or QAT passed. Missing it for good → the stage fails with both figures and the
advice (and an AMCT QAT hand-off config).
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from tasks import runner, tracking
from tasks.config import PipelineConfig
from tasks.errors import StageError
from tasks.fsutil import atomic_save_figure, atomic_write_json, atomic_write_text, read_json
from tasks.quant import inputs, registry, report
from tasks.quant.artifact import META
from tasks.quant.plan import gate_advice

GATE_METRICS = {
    "accuracy_drop_pct": "relative next-token top-1 accuracy drop",
    "ppl_drop_pct": "relative perplexity rise",
    "greedy_disagreement_pct": "greedy-continuation token disagreement",
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=None, help="full-precision HF export (default: the train stage's)")
    runner.add_shard_dir_arg(parser, "with the val split")
    parser.add_argument("--quant-dir", default=None, help="quantized model (default: the quantize stage's)")


def _quant_dir(ctx) -> Path:
    path = getattr(ctx.args, "quant_dir", None) or ctx.inputs.get("quantize", {}).get("quant_dir")
    if not path or not (Path(path) / META).is_file():
        raise StageError("evaluate: no quantized model: run the quantize stage first or pass --quant-dir")
    return Path(path)


@dataclass
class EvalData:
    batches: list  # evaluation part of the val split
    split: dict  # its record (rule, count, window indices)
    windows: object = None  # [k, prompt_len] prompts cut from the first evaluation windows
    prompts: list = field(default_factory=list)  # token ids of evaluate.prompts
    prompt_texts: list = field(default_factory=list)
    new_tokens: int = 0


def eval_data(cfg: PipelineConfig, shard_dir: Path, max_seq_len: int) -> EvalData:
    import torch
    from tokenizers import Tokenizer

    e = cfg.evaluate
    batches, split = inputs.val_part(shard_dir, e.eval_batches, cfg.train.micro_batch, "evaluation")
    data = EvalData(batches, split, new_tokens=max(1, min(e.max_new_tokens, max_seq_len // 2)))
    if e.agreement_windows:
        rows = torch.cat([b[0] for b in batches])[: e.agreement_windows]
        data.windows = rows[:, : min(rows.size(1) // 2, max_seq_len - data.new_tokens)]
    tok = Tokenizer.from_file(str(shard_dir / "tokenizer.json"))
    for text in e.prompts:
        ids = tok.encode(text).ids[-(max_seq_len - data.new_tokens) :]
        if ids:
            data.prompts.append(ids)
            data.prompt_texts.append(text)
    return data


def quality(model, data: EvalData, device) -> dict:
    """Perplexity and top-1 accuracy over the evaluation tokens, and the greedy continuations (KV cache)."""
    import torch

    from tasks.model.generate import greedy
    from tasks.quant import metrics

    scores = metrics.perplexity(model, data.batches, device)
    conts = []
    if data.windows is not None:
        conts += greedy(model, data.windows.to(device), data.new_tokens).tolist()
    conts += [greedy(model, torch.tensor([ids], device=device), data.new_tokens)[0].tolist() for ids in data.prompts]
    return dict(scores, continuations=conts)


def gate_figures(ref: dict, q: dict) -> dict:
    """The INT8 model's drops against the reference, in percent (positive: INT8 is worse)."""
    from tasks.quant import metrics

    out = {
        "ppl_drop_pct": registry.drop_pct(ref["ppl"], q["ppl"]),
        "accuracy_drop_pct": (ref["accuracy"] - q["accuracy"]) / ref["accuracy"] * 100 if ref["accuracy"] else 0.0,
    }
    if ref["continuations"]:
        agree = metrics.agreement(ref["continuations"], q["continuations"])
        out.update(
            greedy_agreement=agree,
            greedy_disagreement_pct=(1 - agree) * 100,
            agreement_tokens=sum(len(c) for c in ref["continuations"]),
        )
    return out


def speed(models: dict, data: EvalData, cfg: PipelineConfig, device) -> dict:
    """Prefill and KV-cache decode at batch 1: a prompt of evaluate.latency_tokens, new tokens as for agreement."""
    from tasks.quant import metrics

    prompt = data.batches[0][0][:1, : cfg.evaluate.latency_tokens]
    s = metrics.generation_speed(models, prompt, data.new_tokens, device)
    out = {"latency_prompt_tokens": prompt.numel(), "latency_new_tokens": data.new_tokens}
    for name, v in s.items():
        out[f"{name}_prefill_tokens_per_s"] = prompt.numel() / v["prefill_s"]
        out[f"{name}_decode_tokens_per_s"] = v["decode_tokens_per_s"]
    for base in ("bf16", "fp32"):
        for what in ("prefill", "decode"):  # > 1: INT8 is faster than `base`
            out[f"{what}_speed_vs_{base}"] = out[f"int8_{what}_tokens_per_s"] / out[f"{base}_{what}_tokens_per_s"]
    return out


class Measurer:
    """The FP32 and reference models, the evaluation data and the reference's quality, loaded once: PTQ and QAT
    are measured against the same."""

    def __init__(self, cfg: PipelineConfig, model_dir: Path, shard_dir: Path, ref_dtype: str):
        import copy

        import torch

        from tasks import device as devices
        from tasks.model.hf_io import load_hf

        self.cfg = cfg
        self.kind = devices.detect(cfg.hardware.device).kind
        self.device = devices.torch_device(self.kind)
        self.fp32 = load_hf(model_dir, device=self.device).eval()
        self.ref_name = ref_dtype
        if ref_dtype == "fp32":
            self.bf16 = copy.deepcopy(self.fp32).to(torch.bfloat16)
            self.ref = self.fp32
        else:
            self.bf16 = self.ref = copy.deepcopy(self.fp32).to(torch.bfloat16)
        self.bf16.init_rope()
        self.data = eval_data(cfg, shard_dir, self.fp32.config.max_seq_len)
        self.ref_q = quality(self.ref, self.data, self.device)
        self.fp_q = self.ref_q if self.ref is self.fp32 else quality(self.fp32, self.data, self.device)

    def measure(self, model, meta: dict, stage: str) -> tuple[dict, dict]:
        """→ (metrics, the INT8 model's quality incl. continuations)."""
        q = quality(model, self.data, self.device)
        mb = 1024**2
        e = self.cfg.evaluate
        m = {
            "stage": stage,
            "reference": self.ref_name,
            "fp_ppl": self.fp_q["ppl"],
            "ref_ppl": self.ref_q["ppl"],
            "int8_ppl": q["ppl"],
            "fp_nll": self.fp_q["nll"],
            "int8_nll": q["nll"],
            "fp_accuracy": self.fp_q["accuracy"],
            "ref_accuracy": self.ref_q["accuracy"],
            "int8_accuracy": q["accuracy"],
            "eval_tokens": q["tokens"],
            **gate_figures(self.ref_q, q),
            "int8_mb": meta["int8_bytes"] / mb,
            "bf16_mb": meta["bf16_bytes"] / mb,
            "fp32_mb": meta["fp32_bytes"] / mb,
            "size_ratio_vs_bf16": meta["int8_bytes"] / meta["bf16_bytes"],
            "size_ratio_vs_fp32": meta["int8_bytes"] / meta["fp32_bytes"],
            "device": self.kind,
            "method": meta["method"],
            "backend": meta["backend"],
            "gate_metric": e.gate_metric,
            "max_drop_pct": e.max_drop_pct,
        }
        m.update(speed({"fp32": self.fp32, "bf16": self.bf16, "int8": model}, self.data, self.cfg, self.device))
        if e.gate_metric not in m:
            raise StageError(
                f"evaluate.gate_metric {e.gate_metric}: nothing to measure it on (evaluate.prompts is "
                "empty and evaluate.agreement_windows is 0); set one, or gate on accuracy_drop_pct"
            )
        m["gate_value"] = m[e.gate_metric]
        m["passed"] = m["gate_value"] <= e.max_drop_pct
        return m, q

    def generations(self, q: dict, tok) -> list[dict]:
        n = len(self.data.prompts)
        if not n:
            return []
        ref, int8 = self.ref_q["continuations"][-n:], q["continuations"][-n:]
        return [
            {"prompt": text, "fp": tok.decode(a), "int8": tok.decode(b)}
            for text, a, b in zip(self.data.prompt_texts, ref, int8)
        ]


def _tags(uri: str, ctx, meta: dict, m: dict, digest: str, key: str, ptq: dict | None) -> dict:
    """Lineage on every version: the DAG run, the training run, the data, this evaluation, and which flow passed."""
    tags = {
        "train.run_id": ctx.inputs.get("train", {}).get("mlflow_run_id") or "unknown",
        registry.DIGEST_TAG: digest,
        registry.PPL_TAG: f"{m['int8_ppl']:.6f}",
        "eval.fp_ppl": f"{m['fp_ppl']:.6f}",
        "eval.ppl_drop_pct": f"{m['ppl_drop_pct']:.4f}",
        "eval.accuracy_drop_pct": f"{m['accuracy_drop_pct']:.4f}",
        "eval.gate_metric": m["gate_metric"],
        "eval.gate_value": f"{m['gate_value']:.4f}",
        "eval.run_id": ctx.mlflow_run_id or "",
        "quant.method": meta["method"],
        "quant.backend": meta["backend"],
        "quant.key": key,
        "quant.passed_by": m["stage"],
    }
    if ptq is not None:
        tags["eval.ptq_gate_value"] = f"{ptq['gate_value']:.4f}"
    if ctx.mlflow_run_id:
        import mlflow

        run_tags = mlflow.MlflowClient(uri).get_run(ctx.mlflow_run_id).data.tags
        tags.update({k: run_tags[k] for k in ("airflow.dag_id", "airflow.run_id") if k in run_tags})
    return tags


def _register(
    cfg: PipelineConfig, ctx, meta: dict, m: dict, digest: str, quant_dir: Path, model, ptq: dict | None
) -> dict:
    from tasks.quant.artifact import pip_requirements

    uri, name = tracking.tracking_uri(cfg), cfg.evaluate.registered_model
    # Same quantized files (names, sizes, mtimes) + same data → the same version on a rerun.
    key = hashlib.sha256(f"{inputs.fingerprint(quant_dir)}/{digest}".encode()).hexdigest()[:16]
    existing = registry.find_version(uri, name, "quant.key", key)
    champion = registry.current_champion(uri, name)
    if existing is not None:
        version = str(existing.version)
    else:
        version = registry.register(
            uri, name, model, _tags(uri, ctx, meta, m, digest, key, ptq), pip_requirements(meta)
        )
    registry.set_alias(uri, name, registry.CANDIDATE, version)
    if champion is not None and champion["version"] == version:
        decision = registry.Promotion(True, f"v{version} is already the champion")
    else:
        decision = registry.champion_decision(m["int8_ppl"], digest, champion)
    already = champion is not None and champion["version"] == version
    # evaluate.json's `approval` (docs/ARCHITECTURE.md): a person decides in the DAG's approve task
    ask = cfg.evaluate.require_approval and not already
    if decision.promote and not ask:
        registry.set_alias(uri, name, registry.CHAMPION, version)
    approval = {"needed": ask, "reason": "", "version": version}
    if ask:
        approval["reason"] = f"evaluate.require_approval is set; the comparison says: {decision.reason}"
    return {
        "registered_model": name,
        "version": version,
        "champion": decision.promote and not ask,
        "champion_reason": decision.reason,
        "comparable": decision.comparable,
        "aliases": registry.aliases(uri, name),
        "approval": approval,
    }


def _figures(m: dict) -> str:
    return (
        f"{m['gate_metric']} {m['gate_value']:+.2f}% (gate ≤ {m['max_drop_pct']}%); top-1 "
        f"{m['ref_accuracy']:.3f} → {m['int8_accuracy']:.3f}, ppl {m['ref_ppl']:.3f} → {m['int8_ppl']:.3f}"
        + (f", greedy agreement {m['greedy_agreement']:.0%}" if "greedy_agreement" in m else "")
    )


SHORT = {"accuracy_drop_pct": "acc drop", "ppl_drop_pct": "ppl rise", "greedy_disagreement_pct": "greedy diff"}


def _headline(m: dict) -> str:
    """The summary's first 80 characters: gate metric and verdict's figure, decode speed vs BF16 (saying when INT8
    is slower), size."""
    d = m["decode_speed_vs_bf16"]
    return (
        f"{m['stage'].upper()} {SHORT[m['gate_metric']]} {m['gate_value']:+.2f}% (≤{m['max_drop_pct']:g}%), "
        f"decode {d:.2f}x BF16{' (INT8 slower)' if d < 1 else ''}, {m['size_ratio_vs_bf16']:.2f}x size"
    )


def _speed_note(m: dict) -> str:
    """Size and speed vs BF16 (the headline: INT8 weight-only computes in BF16), saying where INT8 is slower."""
    parts = [f"{m['size_ratio_vs_bf16']:.2f}x BF16 size"]
    for what in ("decode", "prefill"):
        r = m[f"{what}_speed_vs_bf16"]
        parts.append(f"{what} {r:.2f}x BF16 speed" + (" (INT8 slower here)" if r < 1 else ""))
    return ", ".join(parts)


def _log_stage(m: dict, prefix: str) -> None:
    tracking.log_metrics({f"{prefix}{k}": v for k, v in m.items() if isinstance(v, (int, float))})


def run(cfg: PipelineConfig, ctx) -> dict:
    from tokenizers import Tokenizer

    from tasks.model.hf_io import check_tokenizers
    from tasks.quant.artifact import load_quantized

    max_drop = registry.check_threshold(cfg.evaluate.max_drop_pct)
    if cfg.evaluate.gate_metric not in GATE_METRICS:
        raise StageError(f"evaluate.gate_metric: {cfg.evaluate.gate_metric!r} is not one of {', '.join(GATE_METRICS)}")
    quant_dir = _quant_dir(ctx)
    meta = read_json(quant_dir / META)
    # Standalone (no earlier results, no flags): the model and the shard set the quantize stage used.
    model_dir = inputs.model_dir(ctx, fallback=meta["model_dir"])
    shard_dir = runner.shard_set(cfg, ctx, fallback=meta["shard_dir"])
    check_tokenizers(model_dir, shard_dir, "evaluate", quant_meta=meta, quant_dir=quant_dir)
    digest = inputs.manifest_digest(shard_dir)
    measurer = Measurer(cfg, model_dir, shard_dir, meta.get("dtype", "bf16"))
    ptq_model = load_quantized(quant_dir, device=measurer.device)
    m, q = measurer.measure(ptq_model, meta, "ptq")
    split = measurer.data.split
    tracking.log_params(
        {
            "evaluate.max_drop_pct": max_drop,
            "evaluate.gate_metric": cfg.evaluate.gate_metric,
            "evaluate.data_digest": digest,
            "split.rule": split["rule"],
            "split.evaluation_sequences": split["sequences"],
            "split.evaluation_keys_digest": split["keys_digest"],
            "split.calibration_keys_digest": meta.get("calibration_split", {}).get("keys_digest", ""),
        }
    )
    _log_stage(m, "ptq.")
    ptq, final, final_dir, final_meta, final_model, qat = None, m, quant_dir, meta, ptq_model, None
    if not m["passed"] and cfg.quantize.qat_on_fail:
        from tasks.quant import qat as qat_flow

        ptq = m
        qat = qat_flow.run(cfg, model_dir, shard_dir, meta, ctx.run_dir, measurer.device)
        final_dir, final_meta = Path(qat["quant_dir"]), qat["meta"]
        final_model = qat.get("model") or load_quantized(final_dir, device=measurer.device)
        final, q = measurer.measure(final_model, final_meta, "qat")
        final.update(qat_steps=len(qat["losses"]), qat_final_loss=qat["losses"][-1], qat_seconds=qat["seconds"])
        _log_stage(final, "qat.")
    tok = Tokenizer.from_file(str(shard_dir / "tokenizer.json"))
    gens = measurer.generations(q, tok)

    out = ctx.run_dir / "evaluate"
    stages = [m] + ([final] if ptq is not None else [])
    rows = report.comparison_rows(stages)
    atomic_write_json(
        out / "comparison.json",
        {
            "metrics": final,
            "ptq": m,
            "qat": final if ptq else None,
            "rows": rows,
            "generations": gens,
            "split": split,
            "calibration_split": meta.get("calibration_split"),
        },
    )
    atomic_write_text(out / "comparison.md", report.markdown(rows, stages, gens, split))
    atomic_save_figure(report.figure(stages), out / "comparison.png")
    tracking.log_metrics({k: v for k, v in final.items() if isinstance(v, (int, float))})
    for f in ("comparison.json", "comparison.md", "comparison.png"):
        tracking.log_artifact(out / f, "evaluate")
    tracking.set_tags({"quant.passed_by": final["stage"] if final["passed"] else "none"})

    passed = final["passed"]
    figures = f"{_headline(final)}; {_figures(final)}; {_speed_note(final)}"
    if ptq is not None:
        figures = f"{figures}; QAT {final['qat_steps']} steps after PTQ {_figures(ptq)}"
    result = {
        "passed": passed,
        "passed_by": final["stage"] if passed else None,
        "gate_metric": final["gate_metric"],
        "gate_value": round(final["gate_value"], 4),
        "ppl_drop_pct": round(final["ppl_drop_pct"], 4),
        "accuracy_drop_pct": round(final["accuracy_drop_pct"], 4),
        "fp_ppl": round(final["fp_ppl"], 4),
        "ref_ppl": round(final["ref_ppl"], 4),
        "int8_ppl": round(final["int8_ppl"], 4),
        "int8_accuracy": round(final["int8_accuracy"], 4),
        "ref_accuracy": round(final["ref_accuracy"], 4),
        "greedy_agreement": round(final["greedy_agreement"], 4) if "greedy_agreement" in final else None,
        "size_ratio_vs_bf16": round(final["size_ratio_vs_bf16"], 4),
        **{
            f"{w}_speed_vs_{b}": round(final[f"{w}_speed_vs_{b}"], 4)
            for w in ("prefill", "decode")
            for b in ("bf16", "fp32")
        },
        "ptq": {k: ptq[k] for k in ("gate_value", "ppl_drop_pct", "accuracy_drop_pct")} if ptq else None,
        "quant_dir": str(final_dir),
        "model_dir": str(model_dir),
        "data_digest": digest,
        "comparison": str(out / "comparison.md"),
    }
    if not passed:
        from tasks.quant.amct_backend import write_qat_handoff

        model = sample = None
        if meta["backend"] == "amct":  # AMCT's create_quant_retrain_config writes the per-layer JSON from the model
            from tasks.model.hf_io import load_hf

            model = load_hf(model_dir)
            sample = (inputs.val_batches(shard_dir, 1, cfg.train.micro_batch, "calibration")[0][0],)
        handoff = write_qat_handoff(
            out / "qat",
            list(meta["layer_types"].items()),
            meta["skipped_layers"],
            meta["calibration_batches"],
            model,
            sample,
        )
        tracking.log_artifact(out / "qat", "evaluate/qat")
        what = GATE_METRICS[final["gate_metric"]]
        if ptq is not None:
            reason = (
                f"INT8 {what} exceeds evaluate.max_drop_pct {max_drop}% after PTQ ({ptq['gate_value']:.2f}%) "
                f"and after QAT ({final['qat_steps']} steps: {final['gate_value']:.2f}%); try more "
                f"quantize.qat_steps, or {gate_advice(meta['method'], meta['backend'])}"
            )
        else:
            reason = (
                f"INT8 {what} {final['gate_value']:.2f}% exceeds evaluate.max_drop_pct {max_drop}% "
                f"({_figures(final)}); try {gate_advice(meta['method'], meta['backend'])}"
            )
        if cfg.evaluate.fail_on_gate:
            raise StageError(reason)
        return dict(result, status="warn", summary=f"gate missed: {figures}", qat=handoff, reason=reason)
    if not ctx.mlflow_run_id:
        return dict(result, status="warn", summary=f"not registered (tracking off): {figures}")
    reg = _register(cfg, ctx, final_meta, final, digest, final_dir, final_model, ptq)
    tracking.set_tags({"registry.version": reg["version"], "registry.champion": reg["champion"]})
    status = "ok" if reg.pop("comparable") else "warn"
    role = "champion" if reg["champion"] else "candidate"
    return dict(
        result,
        **reg,
        status=status,
        summary=f"v{reg['version']} {role} {figures}; {reg['registered_model']}: {reg['champion_reason']}",
    )
