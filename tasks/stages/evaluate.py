"""Evaluation and registry: the INT8 model the quantize stage handed on (PTQ, or QAT when PTQ missed the gate),
measured beside the unquantized model in FP32 and in quantize.dtype (BF16 by default: what INT8 replaces).

Task accuracy (lm-evaluation-harness over evaluate.tasks: tasks.harness, tasks.quant.gate) is the gate: the relative
drop of the macro-average accuracy of INT8 against the reference must stay within evaluate.max_drop_pct (quantize
judged the same; its task scores are reused when they were measured on exactly these tasks and models). Beside it,
supplementary figures on the evaluation part of the val split, disjoint from calibration: perplexity, next-token
top-1 accuracy, greedy agreement, size on disk, prefill/decode speed (KV cache, batch 1).

Passing → a new version in the MLflow Model Registry (with its tokenizer and config, the per-task table in its
description), alias `candidate`; the current champion is scored on the same tasks in the same run with its own
tokenizer, and the candidate becomes `champion` unless its macro task accuracy is lower by more than
evaluate.champion_margin. Missing the gate → the stage fails with the figures, PTQ's and QAT's, and the advice (and
an AMCT QAT hand-off config).
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from pathlib import Path

from tasks import runner, tracking
from tasks.config import PipelineConfig
from tasks.errors import ConfigError, StageError
from tasks.fsutil import atomic_save_figure, atomic_write_json, atomic_write_text, read_json
from tasks.quant import gate, inputs, quality, registry, report
from tasks.quant.artifact import META
from tasks.quant.plan import gate_advice
from tasks.units import MB

GATE_METRICS = gate.GATE_METRICS
MODELS = ("fp32", "bf16", "fp16", "int8")  # the 16-bit model is named by its dtype (quantize.dtype)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-dir",
        default=None,
        help="full-precision HF export (default: the train stage's, else the one quantize used)",
    )
    runner.add_shard_dir_arg(parser, "with the val split", "the shard stage's result in --run-dir, else quantize's")
    parser.add_argument("--quant-dir", default=None, help="quantized model (default: the quantize stage's)")


def _quant_dir(ctx) -> Path:
    given = getattr(ctx.args, "quant_dir", None)
    if given and not (Path(given) / META).is_file():
        raise StageError(f"evaluate: --quant-dir {given} holds no quantized model (no {META}); pass the quantize "
                         "stage's output directory (quantize.json's quant_dir)")  # fmt: skip
    path = given or ctx.inputs.get("quantize", {}).get("quant_dir")
    if not path or not (Path(path) / META).is_file():
        raise StageError("evaluate: no quantized model: run the quantize stage first or pass --quant-dir")
    return Path(path)


def _quant_record(path: Path) -> dict:
    """quantize's quant_meta.json or gate.json; one line when it is unreadable (truncated, corrupt)."""
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        raise StageError(
            f"evaluate: {path} is unreadable ({type(e).__name__}: {str(e)[:120]}); rerun the quantize stage"
        ) from None
    if not isinstance(data, dict):
        raise StageError(f"evaluate: {path} holds no JSON object (a {type(data).__name__}); rerun the quantize stage")
    return data


def _recorded_quantize(meta: dict) -> dict:
    """The quantize.* values that made the INT8 model, as quant_meta.json records them: {key: value}. A key is left out
    where the record cannot say (an older record) or where the value did not decide this model (the AMCT flow of a
    torchao model, calibration batches of a method that reads none, QAT settings of a PTQ model)."""
    out = {k: meta[k] for k in ("method", "backend", "skip_layers") if k in meta}
    out["dtype"] = meta.get("dtype", "bf16")
    if meta.get("amct_flow") is not None:
        out["amct_flow"] = meta["amct_flow"]
    if meta.get("calibration_data_digest") and "calibration_batches" in meta:
        out["calibration_batches"] = meta["calibration_batches"]
    if meta.get("stage") == "qat":
        out["qat_on_fail"] = True
        if "qat_steps" in meta:
            out["qat_steps"] = meta["qat_steps"]
    return out


def _check_quantize_settings(cfg: PipelineConfig, meta: dict, quant_dir: Path) -> None:
    """evaluate measures the INT8 model quantize made; a quantize.* value given explicitly (--set, Params, the run
    directory's remembered values) that would have made another model is one line each, not ignored while MLflow
    and cli-config.json record it as this evaluation's (the same rule as data.* against a shard set)."""
    recorded, problems = _recorded_quantize(meta), []
    for dotted in sorted(k for k in cfg.explicit if k.startswith("quantize.")):
        key = dotted.partition(".")[2]
        if key not in recorded or (key == "backend" and cfg.quantize.backend == "auto"):  # auto: the host decides
            continue
        mine, theirs = getattr(cfg.quantize, key), recorded[key]
        if (list(mine) if isinstance(mine, (list, tuple)) else mine) == theirs:
            continue
        shown = [", ".join(map(str, v)) or "[]" if isinstance(v, (list, tuple)) else str(v) for v in (mine, theirs)]
        problems.append(
            f"{dotted}: {shown[0]} differs from the INT8 model's {shown[1]} ({quant_dir / META}); evaluate measures "
            "the model quantize made: rerun `python -m tasks quantize` with it (then evaluate), or leave it unset"
        )
    if problems:
        raise ConfigError(problems)


def _check_source(meta: dict, model_dir: Path, quant_dir: Path) -> None:
    """The INT8 model was quantized from this very export of the model (quantize records its fingerprint): else
    evaluate would score a stale INT8 against other weights, and register and link the pair."""
    recorded, here = meta.get("model_fingerprint"), inputs.fingerprint(model_dir)
    if recorded and recorded != here:
        raise StageError(
            f"evaluate: the INT8 model in {quant_dir} was quantized from another export of the model "
            f"(fingerprint {recorded}≠{here} of {model_dir}); rerun the quantize stage"
        )


def speed(models: dict, data: quality.EvalData, cfg: PipelineConfig, device) -> dict:
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


def task_table(scores: dict) -> dict:
    """{model: suite.score result} → {entry: {"name", "metric", "n", "shots", <model>: value}} (one row per task)."""
    rows = {}
    for model, s in scores.items():
        for entry, r in s["entries"].items():
            row = rows.setdefault(
                entry, {"name": r["name"], "metric": r["metric"], "n": r["n"], "shots": r.get("shots")}
            )
            row[model] = r["value"]
    return rows


class Measurer:
    """The FP32 and reference models, the tasks and the evaluation tokens, and what the models score on them."""

    def __init__(self, cfg: PipelineConfig, model_dir: Path, shard_dir: Path, ref_dtype: str, suite, kind: str):
        import copy

        import torch

        from tasks import device as devices
        from tasks.harness.models import full_precision, load_tokenizer

        self.cfg, self.suite, self.kind = cfg, suite, kind
        self.device = devices.torch_device(kind)
        self.tokenizer = load_tokenizer(model_dir)
        self.fp32 = full_precision(model_dir, "fp32", self.device)
        self.ref_name = ref_dtype
        # the 16-bit model sized and timed beside FP32 and INT8 (the `bf16_*` / `*_vs_bf16` figures): the reference
        # itself in BF16 or FP16 (quantize.dtype), a BF16 copy when the reference is FP32
        self.half = ref_dtype if ref_dtype in ("bf16", "fp16") else "bf16"
        if ref_dtype == "fp32":
            self.bf16 = copy.deepcopy(self.fp32).to(torch.bfloat16)
            self.ref = self.fp32
        else:
            self.bf16 = self.ref = full_precision(model_dir, ref_dtype, self.device)
        self.bf16.init_rope()
        self.data = quality.eval_data(cfg, shard_dir, self.fp32.config.max_seq_len)
        self.ref_q = quality.quality(self.ref, self.data, self.device)
        self.fp_q = self.ref_q if self.ref is self.fp32 else quality.quality(self.fp32, self.data, self.device)
        self.scores = {"fp32": self.score(self.fp32, "FP32")}

    def score(self, model, name: str, tokenizer=None) -> dict:
        """The model's task scores; `name` ("INT8") in its progress lines."""
        return gate.score(model, tokenizer or self.tokenizer, self.suite, self.cfg, self.device, f"evaluate {name}")

    def measure(self, model, meta: dict, stage: str, reused: dict | None) -> dict:
        """The INT8 model's figures beside the references'; the gate value under evaluate.gate_metric."""
        e = self.cfg.evaluate
        q = quality.quality(model, self.data, self.device)
        ref_key = "fp32" if self.ref is self.fp32 else self.ref_name
        if reused:  # quantize scored the reference and this very model on these very tasks
            self.scores[ref_key] = self.scores.get(ref_key) or reused["ref"]
            self.scores["int8"] = reused["int8"]
        else:
            if ref_key not in self.scores:
                self.scores[ref_key] = self.score(self.ref, self.ref_name.upper())
            self.scores["int8"] = self.score(model, "INT8")
        mb = MB  # decimal, as every figure (tasks.units)
        m = {
            "stage": stage,
            "reference": self.ref_name,
            "half": self.half,
            "fp_ppl": self.fp_q["ppl"],
            "ref_ppl": self.ref_q["ppl"],
            "int8_ppl": q["ppl"],
            "fp_nll": self.fp_q["nll"],
            "int8_nll": q["nll"],
            "fp_accuracy": self.fp_q["accuracy"],
            "ref_accuracy": self.ref_q["accuracy"],
            "int8_accuracy": q["accuracy"],
            "eval_tokens": q["tokens"],
            "fp_task_macro": self.scores["fp32"]["macro"],
            "ref_task_macro": self.scores[ref_key]["macro"],
            "int8_task_macro": self.scores["int8"]["macro"],
            gate.TASK_GATE: gate.relative_drop(self.scores[ref_key]["macro"], self.scores["int8"]["macro"]),
            "task_scores_reused": bool(reused),
            **quality.drops(self.ref_q, q),
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
                "empty and evaluate.agreement_windows is 0); set one, or gate on task_accuracy_drop_pct"
            )
        m["gate_value"] = m[e.gate_metric]
        m["passed"] = m["gate_value"] <= e.max_drop_pct
        self.int8_q = q
        return m

    def generations(self, tok) -> list[dict]:
        n = len(self.data.prompts)
        if not n:
            return []
        ref, int8 = self.ref_q["continuations"][-n:], self.int8_q["continuations"][-n:]
        return [
            {"prompt": text, "fp": tok.decode(a), "int8": tok.decode(b)}
            for text, a, b in zip(self.data.prompt_texts, ref, int8)
        ]


def _champion_scores(cfg, ctx, champion: dict, digest: str, shard_dir: Path, measurer: Measurer) -> dict:
    """The champion measured here, on the same tasks, with its own tokenizer: {"version", "macro", "scores"}, or
    {"version", "problem"} when it cannot be."""
    from tasks.harness import suite as suites
    from tasks.harness.models import load_tokenizer

    v = champion["version"]
    with tempfile.TemporaryDirectory(prefix=".champion.", dir=ctx.run_dir) as tmp:
        try:
            local = registry.download(champion["uri"], Path(tmp))
        except Exception as e:  # noqa: BLE001 — an unreadable registry entry is the champion's problem, not ours
            return {"version": v, "problem": f"its files could not be read from the registry ({str(e)[:200]})"}
        extra = local / registry.EXTRA
        if (extra / "tokenizer.json").is_file():
            tok = load_tokenizer(extra)
        elif champion.get("digest") == digest:  # registered before tokenizers were: same shard set, same tokenizer
            tok = load_tokenizer(shard_dir, eos=read_json(shard_dir / "manifest.json").get("eos_token"))
        else:
            return {
                "version": v,
                "problem": "registered without its tokenizer (before task evaluation) and measured on other data "
                f"({champion.get('digest') or '?'}), so it cannot be run on text here",
            }
        try:
            model = registry.load_registered(local, measurer.device)
        except StageError as e:
            return {"version": v, "problem": str(e)}
    try:
        suites.check_generation(measurer.suite, model.config.max_seq_len, f"champion v{v}")
    except StageError as e:
        return {"version": v, "problem": str(e)}
    scores = measurer.score(model, f"champion v{v}", tok)
    return {"version": v, "macro": scores["macro"], "scores": scores}


PER_EVALUATION = ("eval.ptq_gate_value",)  # tags an evaluation may not set: a rerun without it drops the old one


def _tags(uri: str, ctx, meta: dict, m: dict, digest: str, key: str, ptq: dict | None, tasks: list[str]) -> dict:
    """Lineage on every version: the DAG run, the training run, the data, this evaluation, and which flow passed."""
    tags = {
        "train.run_id": ctx.inputs.get("train", {}).get("mlflow_run_id") or "unknown",
        registry.DIGEST_TAG: digest,
        registry.PPL_TAG: f"{m['int8_ppl']:.6f}",
        registry.TASKS_TAG: f"{m['int8_task_macro']:.6f}",
        "eval.fp_ppl": f"{m['fp_ppl']:.6f}",
        "eval.ppl_drop_pct": f"{m['ppl_drop_pct']:.4f}",
        "eval.accuracy_drop_pct": f"{m['accuracy_drop_pct']:.4f}",
        "eval.task_accuracy_drop_pct": f"{m[gate.TASK_GATE]:.4f}",
        "eval.tasks": ",".join(tasks),
        "eval.gate_metric": m["gate_metric"],
        "eval.gate_value": f"{m['gate_value']:.4f}",
        "eval.run_id": ctx.mlflow_run_id or "",
        "quant.method": meta["method"],
        "quant.backend": meta["backend"],
        "quant.key": key,
        "quant.passed_by": m["stage"] if m["passed"] else "none",
        "eval.gate_passed": str(bool(m["passed"])).lower(),
    }
    if ptq is not None:
        tags["eval.ptq_gate_value"] = f"{ptq['value']:.4f}"
    tags.update(_dag_tags(uri, ctx))
    return tags


def _dag_tags(uri: str, ctx) -> dict:
    """The DAG run this evaluation belongs to ({} for a CLI or test run): the parent run's airflow tags."""
    if not ctx.mlflow_run_id:
        return {}
    import mlflow

    run_tags = mlflow.MlflowClient(uri).get_run(ctx.mlflow_run_id).data.tags
    return {k: run_tags[k] for k in ("airflow.dag_id", "airflow.run_id") if k in run_tags}


def _card(ctx, shard_dir: Path, digest: str, dag: dict) -> dict:
    """The model card's facts besides the figures: data, tokenizer, training, lineage."""
    manifest = read_json(shard_dir / "manifest.json")
    tok = manifest.get("tokenizer", {})
    train = ctx.inputs.get("train", {})
    trained = train.get("manifest_digest")  # the set the model was trained on, when this run trained it
    data = f"shard set {shard_dir.name}, manifest digest {digest}"
    if trained and trained != digest:
        data = f"trained on shard set {Path(train['shard_dir']).name} (manifest digest {trained}); evaluated on {data}"
    return {
        "data": data,
        "tokenizer": f"{tok.get('source', '?')}, vocab {manifest.get('vocab_size', '?')}, "
        f"sha256 {str(tok.get('sha256', '?'))[:16]}",
        "layout": train.get("layout") or "unknown (not trained in this run)",
        "steps": train.get("steps") or "unknown (not trained in this run)",
        "dag": f"{dag['airflow.dag_id']} / {dag.get('airflow.run_id', '?')}" if dag else "none (CLI or test run)",
        "train_run": train.get("mlflow_run_id") or "unknown",
        "evaluate_run": ctx.mlflow_run_id or "",
    }


def reference_model_name(cfg: PipelineConfig, half: str) -> str:
    """The registered model of the unquantized 16-bit model: `<registered_model>-bf16`, or `-fp16` when quantize.dtype
    is fp16 (its artifact loads as torch.float16: a registry user reads the dtype off the name)."""
    return f"{cfg.evaluate.registered_model}-{half}"


def _register_bf16(uri, ctx, cfg, digest, model_dir: Path, measurer, description: str, tags: dict) -> tuple[str, str]:
    """The unquantized model (the train stage's HF export, run in BF16, or FP16 with quantize.dtype fp16) as a version
    of `<registered_model>-bf16` (`-fp16`), with the export's files (config.json, safetensors, tokenizer) beside it;
    the same export and data → the same version on a rerun. → (name, version)."""
    from tasks.quant.artifact import pip_requirements

    name = reference_model_name(cfg, measurer.half)
    key = hashlib.sha256(f"{inputs.fingerprint(model_dir)}/{digest}".encode()).hexdigest()[:16]
    existing = registry.find_version(uri, name, "bf16.key", key)
    if existing is not None:
        registry.describe(uri, name, str(existing.version), description)
        return name, str(existing.version)
    files = [str(f) for f in sorted(model_dir.iterdir()) if f.is_file()]
    example = measurer.data.batches[0][0][:1, :16].long().numpy()
    version = registry.register(
        uri,
        name,
        measurer.bf16,
        dict(tags, **{"bf16.key": key, "reference.dtype": measurer.half}),
        pip_requirements({}),
        files,
        description,
        artifact="bf16_model",
        input_example=example,
    )
    return name, version


def _extra_files(model_dir: Path, quant_dir: Path) -> list[str]:
    """What runs the registered model on text later (a champion evaluation): its tokenizer and config.json; and
    the INT8 weights without pickle (safetensors + quantization_config.json, torchao artifacts)."""
    from tasks.harness.models import TOKENIZER_FILES
    from tasks.quant.artifact import QUANT_CONFIG, SAFETENSORS

    files = [model_dir / f for f in (*TOKENIZER_FILES, "config.json")] + [
        quant_dir / SAFETENSORS,
        quant_dir / QUANT_CONFIG,
    ]
    return [str(f) for f in files if f.is_file()]


def _version_key(meta: dict, quant_dir: Path, model_dir: Path, digest: str) -> str:
    """The INT8 version's `quant.key`: same quantized weights, from the same export of the model (the BF16 version
    it is linked to), on the same data → the same version on a rerun."""
    weights = meta.get("weights_sha256") or inputs.fingerprint(quant_dir)
    return hashlib.sha256(f"{weights}/{inputs.fingerprint(model_dir)}/{digest}".encode()).hexdigest()[:16]


def _register(cfg, ctx, meta, m, digest, quant_dir, model, ptq, model_dir, shard_dir, measurer) -> dict:
    from tasks.quant.artifact import pip_requirements

    uri, name = tracking.tracking_uri(cfg), cfg.evaluate.registered_model
    key = _version_key(meta, quant_dir, model_dir, digest)
    existing = registry.find_version(uri, name, "quant.key", key)
    champion = registry.current_champion(uri, name)
    rows = task_table(measurer.scores)
    if champion is not None and existing is not None and champion["version"] == str(existing.version):
        decision, champ = registry.Promotion(True, f"v{existing.version} is already the champion"), None
    else:
        champ = _champion_scores(cfg, ctx, champion, digest, shard_dir, measurer) if champion else None
        decision = registry.champion_decision(m["int8_task_macro"], champ, cfg.evaluate.champion_margin)
        if champ and "scores" in champ:
            for entry, r in champ["scores"]["entries"].items():
                rows[entry]["champion"] = r["value"]
    dag = _dag_tags(uri, ctx)
    card = _card(ctx, shard_dir, digest, dag)
    description = report.description(rows, m, champ, decision.reason, card)
    lineage = {
        "train.run_id": ctx.inputs.get("train", {}).get("mlflow_run_id") or "unknown",
        registry.DIGEST_TAG: digest,
        "eval.run_id": ctx.mlflow_run_id or "",
        **dag,
    }
    bf16_name, bf16_version = _register_bf16(
        uri, ctx, cfg, digest, model_dir, measurer, report.bf16_description(description, measurer.half), lineage
    )
    link = {"bf16.registered_model": bf16_name, "bf16.version": bf16_version}
    tags = dict(_tags(uri, ctx, meta, m, digest, key, ptq, list(cfg.evaluate.tasks)), **link)
    if existing is not None:
        # The same weights on the same data, evaluated again (maybe on other tasks, another gate): the version's tags
        # say what this evaluation measured, as its description does, never the earlier one's figures.
        version = str(existing.version)
        registry.describe(uri, name, version, description)
        registry.link(uri, name, version, tags, drop=tuple(k for k in PER_EVALUATION if k not in tags))
    else:
        version = registry.register(
            uri,
            name,
            model,
            tags,
            pip_requirements(meta),
            _extra_files(model_dir, quant_dir),
            description,
            input_example=measurer.data.batches[0][0][:1, :16].long().numpy(),
        )
    registry.link(uri, bf16_name, bf16_version, {"int8.registered_model": name, "int8.version": version})
    movable, why_not = registry.may_move_aliases(uri, name, dag.get("airflow.dag_id"))
    already = champion is not None and champion["version"] == version
    # evaluate.json's `approval` (docs/ARCHITECTURE.md): a person decides in the DAG's approve task
    ask = movable and cfg.evaluate.require_approval and not already
    if movable:
        registry.set_alias(uri, name, registry.CANDIDATE, version)
        if decision.promote and not ask:
            registry.set_alias(uri, name, registry.CHAMPION, version)
    approval = {"needed": ask, "reason": "", "version": version}
    if ask:
        approval["reason"] = f"evaluate.require_approval is set; the comparison says: {decision.reason}"
    out = {
        "registered_model": name,
        "version": version,
        "bf16_model": {"registered_model": bf16_name, "version": bf16_version},
        "champion": already or (movable and decision.promote and not ask),
        "champion_reason": decision.reason if movable else f"{decision.reason}; {why_not}",
        "aliases_moved": movable,
        "comparable": decision.comparable,
        "aliases": registry.aliases(uri, name),
        "approval": approval,
    }
    if champ:
        out["champion_compared"] = {"version": champ["version"], "macro": champ.get("macro")}
        out.update({"champion_scores": champ["scores"]} if "scores" in champ else {})
    return out, rows


def _retag_missed(
    cfg, ctx, meta, m, digest, quant_dir: Path, model_dir: Path, ptq, rows: dict, card: dict | None
) -> str | None:
    """Weights already registered (the same quant.key) that miss the gate now: that version's tags and its model card
    (the description, and the linked BF16/FP16 version's when it is linked to this one) say this newest evaluation
    (eval.gate_passed false, its figures, "Gate missed"), never an earlier pass it contradicts. Aliases stay: a
    champion that fails a re-evaluation stays champion until a DAG run promotes another. → the version retagged, or
    None."""
    uri, name = tracking.tracking_uri(cfg), cfg.evaluate.registered_model
    key = _version_key(meta, quant_dir, model_dir, digest)
    existing = registry.find_version(uri, name, "quant.key", key)
    if existing is None:
        return None
    version = str(existing.version)
    tags = _tags(uri, ctx, meta, m, digest, key, ptq, list(cfg.evaluate.tasks))
    description = report.description(rows, m, None, "", card)
    registry.describe(uri, name, version, description)
    registry.link(uri, name, version, tags, drop=tuple(k for k in PER_EVALUATION if k not in tags))
    ref_name, ref_version = (existing.tags or {}).get("bf16.registered_model"), existing.tags.get("bf16.version")
    if ref_name and ref_version:  # its card copies this version's: rewritten while it is linked to this version
        import mlflow
        from mlflow.exceptions import MlflowException

        try:
            ref_tags = mlflow.MlflowClient(uri).get_model_version(ref_name, ref_version).tags or {}
        except MlflowException:  # deleted by hand: nothing to rewrite
            ref_tags = {}
        if ref_tags.get("int8.version") == version and ref_tags.get("int8.registered_model") == name:
            registry.describe(uri, ref_name, ref_version, report.bf16_description(description, m.get("half", "bf16")))
    return version


def _figures(m: dict) -> str:
    return (
        f"{m['gate_metric']} {m['gate_value']:+.2f}% (gate ≤ {m['max_drop_pct']}%); task macro "
        f"{m['ref_task_macro']:.3f} → {m['int8_task_macro']:.3f}, top-1 {m['ref_accuracy']:.3f} → "
        f"{m['int8_accuracy']:.3f}, ppl {m['ref_ppl']:.3f} → {m['int8_ppl']:.3f}"
        + (f", greedy agreement {m['greedy_agreement']:.0%}" if "greedy_agreement" in m else "")
    )


SHORT = {
    gate.TASK_GATE: "task acc drop",
    "accuracy_drop_pct": "acc drop",
    "ppl_drop_pct": "ppl rise",
    "greedy_disagreement_pct": "greedy diff",
}


def _headline(m: dict) -> str:
    """The summary's first 80 characters: gate metric and verdict's figure, decode speed vs the 16-bit model (BF16,
    or FP16 with quantize.dtype fp16; saying when INT8 is slower), size."""
    d, half = m["decode_speed_vs_bf16"], report.half_label(m)
    return (
        f"{m['stage'].upper()} {SHORT[m['gate_metric']]} {m['gate_value']:+.2f}% (≤{m['max_drop_pct']:g}%), "
        f"decode {d:.2f}x {half}{' (INT8 slower)' if d < 1 else ''}, {m['size_ratio_vs_bf16']:.2f}x size"
    )


def _speed_note(m: dict) -> str:
    """Size and speed vs the 16-bit model (the headline: INT8 weight-only computes in it), saying where INT8 is
    slower."""
    half = report.half_label(m)
    parts = [f"{m['size_ratio_vs_bf16']:.2f}x {half} size"]
    for what in ("decode", "prefill"):
        r = m[f"{what}_speed_vs_bf16"]
        parts.append(f"{what} {r:.2f}x {half} speed" + (" (INT8 slower here)" if r < 1 else ""))
    return ", ".join(parts)


def _task_summary(rows: dict, m: dict) -> str:
    """Per-model task accuracy for the end-of-run summary: "demo-continuation acc FP32 0.61 BF16 0.61 INT8 0.60"."""
    ref = "BF16" if m["reference"] == "bf16" else m["reference"].upper()
    parts = []
    for r in rows.values():
        cols = (("FP32", "fp32"), (ref, m["reference"]), ("INT8", "int8"))
        vals = [f"{label} {r[k]:.3f}" for label, k in cols if k in r]
        vals += [f"champion {r['champion']:.3f}"] if "champion" in r else []
        parts.append(f"{r['name']} {r['metric']} " + " ".join(dict.fromkeys(vals)))
    return "; ".join(parts)


def _task_detail(scores: dict, m: dict, reg: dict | None) -> str:
    """The summary's second line: macro task accuracy per model ("tasks FP32 0.573 BF16 0.577 INT8 0.573 …")."""
    ref = "BF16" if m["reference"] == "bf16" else m["reference"].upper()
    names = {"fp32": "FP32", m["reference"]: ref, "int8": "INT8"}
    parts = [f"{label} {scores[k]['macro']:.3f}" for k, label in names.items() if k in scores]
    compared = (reg or {}).get("champion_compared") or {}
    if compared.get("macro") is not None:
        parts.append(f"champion v{compared['version']} {compared['macro']:.3f}")
    return "task accuracy " + ", ".join(parts)


def _log_tasks(rows: dict, scores: dict, m: dict, suite) -> None:
    """MLflow metrics eval.task.<task>.<model>_<metric> (and eval.macro.<model>), and the table of every task."""
    metrics = {}
    for r in rows.values():
        for model in (*MODELS, "champion"):
            if model in r:
                metrics[f"eval.task.{r['name']}.{model}_{r['metric']}"] = r[model]
    for model, s in scores.items():
        metrics[f"eval.macro.{model}"] = s["macro"]
    metrics[f"eval.{gate.TASK_GATE}"] = m[gate.TASK_GATE]
    tracking.log_metrics(metrics)
    entry_of = {leaf: entry for entry, leaves in suite.entries.items() for leaf in leaves}
    table = {"model": [], "entry": [], "task": [], "metric": [], "value": [], "examples": []}
    for model, s in scores.items():
        for leaf, r in s["tasks"].items():
            for k, v in zip(table, (model, entry_of[leaf], leaf, r["metric"], r["value"], r["n"])):
                table[k].append(v)
    if tracking.active_run_id() is not None:
        import mlflow

        with tracking.best_effort("the task table"):
            mlflow.log_table(data=table, artifact_file="evaluate/tasks_table.json")


def run(cfg: PipelineConfig, ctx) -> dict:
    from tasks import device as devices
    from tasks.model.hf_io import check_tokenizers
    from tasks.quant.artifact import load_quantized

    max_drop = registry.check_threshold(cfg.evaluate.max_drop_pct)
    inputs.check_hf_path(cfg, ctx)
    quant_dir = _quant_dir(ctx)
    meta = _quant_record(quant_dir / META)
    _check_quantize_settings(cfg, meta, quant_dir)  # before anything is loaded
    # Standalone (no earlier results, no flags): the model and the shard set the quantize stage used.
    model_dir = inputs.model_dir(ctx, fallback=meta["model_dir"])
    _check_source(meta, model_dir, quant_dir)
    # The set quantize calibrated and gated on, whatever this run directory's shard stage holds now: evaluation
    # scores the part of its val split calibration never saw (inputs.SPLIT_RULE), which holds only within one set.
    shard_dir = runner.shard_set(cfg, ctx, recorded=meta["shard_dir"])
    if meta.get("calibration_data_digest") and inputs.manifest_digest(shard_dir) != meta["calibration_data_digest"]:
        raise StageError(
            f"evaluate: {shard_dir} is another shard set than the one quantize calibrated on ({meta['shard_dir']}): "
            "its evaluation windows could hold tokens calibration saw; evaluate without --shard-dir (quantize's set), "
            f"or rerun quantize --shard-dir {shard_dir}"
        )
    runner.verified(cfg, shard_dir, "val", "for the evaluation")
    check_tokenizers(model_dir, shard_dir, "evaluate", quant_meta=meta, quant_dir=quant_dir)
    digest = inputs.manifest_digest(shard_dir)
    suite = gate.load_suite(cfg, ctx.run_dir, shard_dir, model_dir)  # every task checked before a model is loaded
    kind = devices.detect(cfg.hardware.device).kind
    record = _quant_record(quant_dir / gate.RECORD) if (quant_dir / gate.RECORD).is_file() else {}
    reused = gate.reusable_scores(quant_dir / gate.RECORD, gate.record_key(cfg, suite, model_dir, quant_dir, kind))
    measurer = Measurer(cfg, model_dir, shard_dir, meta.get("dtype", "bf16"), suite, kind)
    model = load_quantized(quant_dir, device=measurer.device)
    stage = meta.get("stage", "ptq")
    final = measurer.measure(model, meta, stage, reused)
    ptq = record.get("ptq") if stage == "qat" else None  # QAT ran in quantize after PTQ missed: PTQ's figure
    if ptq is not None and record.get("qat"):
        final.update(qat_steps=record["qat"]["steps"], qat_final_loss=record["qat"]["final_loss"])
    split = measurer.data.split
    tracking.log_params(
        {
            "evaluate.max_drop_pct": max_drop,
            "evaluate.gate_metric": cfg.evaluate.gate_metric,
            "evaluate.limit": cfg.evaluate.limit,
            "evaluate.data_digest": digest,
            # what was evaluated: model.* params are the config's (a --model-dir run's preset, not the checkpoint's)
            "evaluate.model_dir": str(model_dir),
            "evaluate.model_fingerprint": inputs.fingerprint(model_dir),
            "evaluate.quant_dir": str(quant_dir),
            "split.rule": split["rule"],
            "split.evaluation_sequences": split["sequences"],
            "split.evaluation_keys_digest": split["keys_digest"],
            "split.calibration_keys_digest": meta.get("calibration_split", {}).get("keys_digest", ""),
        }
    )
    tracking.log_metrics({f"{stage}.{k}": v for k, v in final.items() if isinstance(v, (int, float))})
    if ptq is not None:
        tracking.log_metrics({"ptq.gate_value": ptq["value"]})
    from tokenizers import Tokenizer

    gens = measurer.generations(Tokenizer.from_file(str(shard_dir / "tokenizer.json")))
    tracking.log_metrics({k: v for k, v in final.items() if isinstance(v, (int, float))})
    passed = final["passed"]
    figures = f"{_headline(final)}; {_figures(final)}; {_speed_note(final)}"
    if ptq is not None:
        steps = final.get("qat_steps", "?")
        figures = f"{figures}; QAT {steps} steps after PTQ {final['gate_metric']} {ptq['value']:+.2f}%"
    result = {
        "passed": passed,
        "passed_by": final["stage"] if passed else None,
        "gate_metric": final["gate_metric"],
        "gate_value": round(final["gate_value"], 4),
        "task_accuracy_drop_pct": round(final[gate.TASK_GATE], 4),
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
        "task_macro": {k: round(s["macro"], 4) for k, s in measurer.scores.items()},
        "task_scores_reused": final["task_scores_reused"],
        "ptq": {"gate_value": ptq["value"]} if ptq else None,
        "quant_dir": str(quant_dir),
        "model_dir": str(model_dir),
        "data_digest": digest,
    }
    reg, rows = None, task_table(measurer.scores)
    if passed and ctx.mlflow_run_id:
        reg, rows = _register(cfg, ctx, meta, final, digest, quant_dir, model, ptq, model_dir, shard_dir, measurer)
    elif ctx.mlflow_run_id:
        card = _card(ctx, shard_dir, digest, _dag_tags(tracking.tracking_uri(cfg), ctx))
        result["retagged_version"] = _retag_missed(cfg, ctx, meta, final, digest, quant_dir, model_dir, ptq, rows, card)
    result["tasks"] = rows
    result["summary_detail"] = _task_detail(measurer.scores, final, reg)
    _write_report(ctx.run_dir / "evaluate", final, rows, gens, split, meta)
    scores = dict(measurer.scores)
    if reg and "champion_scores" in reg:
        scores["champion"] = reg.pop("champion_scores")
    _log_tasks(rows, scores, final, suite)
    tracking.set_tags({"quant.passed_by": final["stage"] if passed else "none"})
    figures = f"{figures}; tasks: {_task_summary(rows, final)}"
    result["comparison"] = str(ctx.run_dir / "evaluate" / "comparison.md")
    if not passed:
        return _missed(cfg, ctx, result, final, ptq, meta, model_dir, shard_dir, max_drop, figures)
    if reg is None:
        return dict(result, status="warn", summary=f"not registered (tracking off): {figures}")
    tracking.set_tags({"registry.version": reg["version"], "registry.champion": reg["champion"]})
    status = "ok" if reg.pop("comparable") else "warn"
    role = "champion" if reg["champion"] else "candidate" if reg["aliases_moved"] else "registered (no alias moved)"
    return dict(
        result,
        **reg,
        status=status,
        summary=f"v{reg['version']} {role} {figures}; {reg['registered_model']}: {reg['champion_reason']}",
    )


def _write_report(out: Path, final: dict, rows: dict, gens: list, split: dict, meta: dict) -> None:
    table = report.comparison_rows([final])
    atomic_write_json(
        out / "comparison.json",
        {
            "metrics": final,
            "rows": table,
            "tasks": rows,
            "generations": gens,
            "split": split,
            "calibration_split": meta.get("calibration_split"),
        },
    )
    atomic_write_text(out / "comparison.md", report.markdown(table, [final], gens, split, rows))
    atomic_save_figure(report.figure([final]), out / "comparison.png")
    for f in ("comparison.json", "comparison.md", "comparison.png"):
        tracking.log_artifact(out / f, "evaluate")


def _missed(cfg, ctx, result, final, ptq, meta, model_dir, shard_dir, max_drop, figures) -> dict:
    from tasks.quant.amct_backend import write_qat_handoff

    out = ctx.run_dir / "evaluate"
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
            f"INT8 {what} exceeds evaluate.max_drop_pct {max_drop}% after PTQ ({ptq['value']:.2f}%) "
            f"and after QAT ({final.get('qat_steps', '?')} steps: {final['gate_value']:.2f}%); try more "
            f"quantize.qat_steps, or {gate_advice(meta['method'], meta['backend'])}"
        )
    else:
        reason = (
            f"INT8 {what} {final['gate_value']:.2f}% exceeds evaluate.max_drop_pct {max_drop}% "
            f"({_figures(final)}); try {gate_advice(meta['method'], meta['backend'])}"
        )
    if result.get("retagged_version"):
        reason += (
            f"; {cfg.evaluate.registered_model} v{result['retagged_version']} (these weights) is now tagged "
            "eval.gate_passed=false (its aliases stay)"
        )
    if cfg.evaluate.fail_on_gate:
        raise StageError(reason)
    return dict(result, status="warn", summary=f"gate missed: {figures}", qat=handoff, reason=reason)
