"""Smoke stage: one device, N steps in FP32 then N in BF16 (FP16 where the device has no BF16, or where
train.precision is fp16; FP16 with training's dynamic loss scaler) from the same weights and batches.

The model is `smoke.model` (tasks/model/sibling.py): by default the configured model when it fits one device, else
a small sibling of it (same family and block structure, the shard set's vocabulary), recorded as `smoke_model`.
With model.hf_path the checkpoint's own first forward on the shard set runs first (tasks/model/checkpoint_check.py):
its loss must be far below ln(vocab), or the stage fails in one line before any training.

Passes when every loss is finite, the loss falls and the two curves agree; otherwise it names the first layer that
went non-finite, with likely causes, and raises a non-retryable StageError so training never starts on a broken set-up.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import time
import warnings
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from tasks import device as devices
from tasks import runner, tracking
from tasks.config import repo_path
from tasks.errors import ConfigError, StageError
from tasks.fsutil import atomic_save_figure, atomic_write_json
from tasks.units import MB


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    runner.add_shard_dir_arg(parser)


@dataclass
class Curve:
    precision: str
    losses: list = field(default_factory=list)
    tokens_per_s: float = 0.0
    peak_bytes: int = 0
    failure: dict | None = None
    loss_scaler: dict | None = None  # FP16: the loss scaler's state after the last step (tasks/train/loss_scale.py)
    converters: list = field(default_factory=list)  # what each model converter did (its repr, as the ranks log it)
    # From a trained checkpoint: the mean loss of the first k batches under its weights, and again after the last
    # step ([before, after]): the same batches, so a batch harder than another does not read as a rise.
    revisit: list | None = None


def tokenizer_vocab(shard_dir: Path) -> int:
    from tokenizers import Tokenizer

    path = shard_dir / "tokenizer.json"
    if not path.is_file():
        raise StageError(f"shard set {shard_dir} has no tokenizer.json")
    return Tokenizer.from_file(str(path)).get_vocab_size()


def load_batches(shard_dir: Path, n: int, batch_size: int, seed: int, verify: bool = False) -> list:
    """The first n training batches (over epochs if the set is small), kept so both precisions see the same data.
    `verify` (data.verify_sha256, on in the DAG): every train shard's sha256 is checked against the manifest."""
    from data_prep.loader import ShardLoader

    try:
        loader = ShardLoader(shard_dir, split="train", batch_size=batch_size, seed=seed, verify_sha256=verify)
        return list(islice(loader.batches(), n))
    except ValueError as e:  # data_prep's one-line DataPrepError (missing manifest, corrupt shard, too few samples)
        raise StageError(f"smoke: {e}") from None


def check_batches(batches, tcfg) -> None:
    top = max(int(x.max()) for x, _ in batches)
    if top >= tcfg.vocab_size:
        raise StageError(f"data: token id {top} >= model vocab_size {tcfg.vocab_size} (tokenizer and model differ)")
    seq = batches[0][0].shape[1]
    if seq > tcfg.max_seq_len:
        raise StageError(f"data: sequences of {seq} tokens exceed model max_seq_len {tcfg.max_seq_len}")


def initial_model(cfg, tcfg, own_weights: bool):
    """The CPU state dict smoke starts from: the weights of model.hf_path when smoke trains the checkpoint's own
    model (`own_weights`), else random init from train.seed."""
    from tasks.model import build_model, materialize
    from tasks.model.hf_io import load_hf

    if own_weights and cfg.model.hf_path:
        return load_hf(repo_path(cfg.model.hf_path), finite=False).state_dict()  # its hooks name the layer
    return materialize(build_model(tcfg), "cpu", cfg.train.seed).state_dict()


def low_precision(kind: str, train_precision: str, bf16_ok: bool, fp16_ok: bool) -> tuple[str | None, str | None]:
    """(the 16-bit precision the smoke compares with FP32, or None; one line when train.precision cannot run here).

    train.precision fp16 compares FP16 (also on CPU, where autocast fp16 runs, so CI covers it); otherwise BF16, or
    FP16 where the device has no BF16 (Ascend 910 A1 parts: the guides' answer there is FP16 with loss scaling)."""
    if train_precision == "fp16":
        if fp16_ok:
            return "fp16", None
        return None, f"train.precision: fp16 is not supported on this {kind} device (no FP16 kernels): use bf16 or fp32"
    if bf16_ok:
        return "bf16", None
    return ("fp16" if fp16_ok else None), None


def checkpoint_first_loss(cfg, tcfg, batch, dev, defer_nonfinite: bool) -> dict:
    """model.hf_path's own first forward on the first batch (its embedding, smoke.hf_layers blocks, norm, head),
    logged as smoke.checkpoint.*; a loss not far below ln(vocab) fails in one line. A non-finite loss is left to the
    FP32 curve's layer diagnosis when that curve trains the checkpoint itself (`defer_nonfinite`)."""
    from tasks.model import checkpoint_check

    path = repo_path(cfg.model.hf_path)
    result = checkpoint_check.initial_loss(path, tcfg, batch[0], batch[1], cfg.smoke.hf_layers, dev)
    tracking.log_metrics(
        {f"smoke.checkpoint.{k}": result[k] for k in ("loss", "ln_vocab", "ratio", "layers") if result[k] is not None}
    )
    nonfinite = result["nonfinite_layer"] or not math.isfinite(result["loss"])
    if nonfinite and defer_nonfinite:
        return result
    problem = checkpoint_check.problem(result, cfg.smoke.hf_max_loss_ratio, path)
    if problem:
        raise StageError(problem)
    return result


def choose_model(cfg, vocab: int, seq_len: int):
    """(the configured model, the one smoke trains, its `smoke_model` record)."""
    from tasks.model import from_pipeline
    from tasks.model.sibling import choose

    full = from_pipeline(cfg, vocab_size=vocab)  # checks the configured model against the shard set first
    tcfg, record = choose(cfg, full, vocab, seq_len)
    return full, tcfg, record


def smoke_lr(cfg, tcfg) -> float:
    """smoke.lr, scaled by smoke.lr_width / hidden for a model wider than smoke.lr_width."""
    width = cfg.smoke.lr_width
    return cfg.smoke.lr * (width / tcfg.dim if width and tcfg.dim > width else 1.0)


def run_curve(
    precision: str, tcfg, state: dict, batches, dev, cfg, fp32_clean: bool, scaler=None, revisit: int = 0
) -> Curve:
    """`precision`'s curve from `state` over `batches`. FP16 runs with training's dynamic loss scaler (`scaler`, by
    default a fresh tasks.train.loss_scale.LossScaler as the trainer builds): the loss scaled before backward, the
    gradients unscaled and checked, a step with inf/NaN gradients skipped (its loss kept) and counted. `revisit` k > 0
    (a trained checkpoint): the first k batches' mean loss before the first step and after the last (Curve.revisit)."""
    import torch

    from tasks.model import build_model, converters, lm_loss
    from tasks.model.diagnose import diagnose_non_finite
    from tasks.train.loss_scale import LossScaler
    from tasks.train.step import single_process

    model = build_model(tcfg).to_empty(device=dev)
    convs = converters.build(cfg.model.converters, converters.ConvertContext(dev.type, tcfg, cfg))
    converters.apply(model, convs)  # the converters training uses (NPU kernels: identity off the NPU)
    model.tie_weights()
    model.load_state_dict(state)
    model.init_rope()
    opt = torch.optim.AdamW(model.parameters(), lr=smoke_lr(cfg, tcfg), weight_decay=cfg.train.weight_decay)
    autocast = devices.autocast(dev, precision)
    if precision == "fp16" and scaler is None:
        scaler = LossScaler()
    # The trainer's step, in one process (FP16: with its loss scaler).
    train_step = single_process(model, opt, cfg.train.grad_clip, lambda: autocast, converters=convs, scaler=scaler)
    curve = Curve(precision, converters=[repr(c) for c in convs])

    def mean_loss(some) -> float:
        with torch.no_grad(), autocast:
            return sum(lm_loss(model(x.to(dev)), y.to(dev)).item() for x, y in some) / len(some)

    before = mean_loss(batches[:revisit]) if revisit else None
    devices.reset_peak(dev)
    start, timed_tokens = time.perf_counter(), 0
    for step, (x, y) in enumerate(batches):
        x, y = x.to(dev), y.to(dev)
        result = train_step(x, y)
        loss, norm = result.loss, result.grad_norm
        curve.losses.append(loss)
        figures = {f"smoke.{precision}.loss": loss, f"smoke.{precision}.grad_norm": norm}
        if scaler is not None:  # the scale the next step uses (None grad norm: this step overflowed, skipped)
            figures |= {
                f"smoke.{precision}.loss_scale": scaler.scale,
                f"smoke.{precision}.skipped_steps": scaler.skipped,
            }
        tracking.log_metrics({k: v for k, v in figures.items() if v is not None}, step=step)
        # An FP16 overflow (inf/NaN gradients, finite loss) is skipped as training skips it, the scale lowered.
        if not math.isfinite(loss) or not (result.overflow or math.isfinite(norm)):
            norm = float("nan") if norm is None else norm
            curve.failure = diagnose_non_finite(model, x, autocast, precision, step, loss, norm, fp32_clean)
            break
        if step == 0:  # the first step pays for allocation and kernel selection: time the rest
            devices.synchronize(dev)
            start = time.perf_counter()
        else:
            timed_tokens += x.numel()
    devices.synchronize(dev)
    curve.tokens_per_s = timed_tokens / max(time.perf_counter() - start, 1e-9)
    if before is not None and curve.failure is None:
        curve.revisit = [before, mean_loss(batches[:revisit])]
    curve.peak_bytes = devices.memory_stats(dev)["peak_bytes"]
    curve.loss_scaler = scaler.state_dict() if scaler is not None else None
    return curve


def window(cfg) -> int:
    """k: the verdict compares the mean loss of k batches (smoke.window, at most half the steps)."""
    return max(1, min(cfg.smoke.window, cfg.smoke.steps // 2))


def verdict(curves: dict, cfg, pretrained: bool = False) -> tuple[list[str], dict]:
    """Failures (one line each) and the figures behind them. From random weights the loss must fall by
    smoke.min_drop; from a trained checkpoint (`pretrained`: model.hf_path's own weights), whose loss a few steps
    barely move, it must not rise by more than that — on the same batches (Curve.revisit: the first k before and
    after training; batch-to-batch the loss of a corpus mixing code and prose varies by more than smoke.min_drop).
    The 16-bit curve (BF16 or FP16) is compared with FP32 within smoke.bf16_tolerance."""
    k = window(cfg)
    need = -cfg.smoke.min_drop if pretrained else cfg.smoke.min_drop
    problems, figures = [], {}
    for name, c in curves.items():
        same = pretrained and c.revisit is not None
        first, last = c.revisit if same else (sum(c.losses[:k]) / k, sum(c.losses[-k:]) / k)
        drop = (first - last) / abs(first)
        figures[f"{name}.loss_drop"] = drop
        if drop < need:
            what = "rose from the checkpoint's" if pretrained else "did not fall"
            where = (
                f"the first {k} batches' mean {first:.4f} → {last:.4f} after {len(c.losses)} steps"
                if same
                else f"mean of first {k} {first:.4f} → last {k} {last:.4f}"
            )
            problems.append(
                f"{name.upper()} loss {what}: {where} ({_pct(drop, need)} < {'−' if pretrained else ''}smoke.min_drop "
                f"{_pct(cfg.smoke.min_drop)}); "
                f"check smoke.lr{' (a trained model wants a small one)' if pretrained else ''} and the data"
            )
    low = next((name for name in curves if name != "fp32"), None)
    if low:
        # Compare rolling means over the window: single-batch losses are noisy, and tiny weight differences shift
        # which batch looks hard; a real precision problem moves the whole curve.
        fp32, half = _rolling(curves["fp32"].losses, k), _rolling(curves[low].losses, k)
        gaps = [abs(b - f) / abs(f) for f, b in zip(fp32, half)]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        figures[f"{low}.max_rel_gap"] = gaps[worst]
        if gaps[worst] > cfg.smoke.bf16_tolerance:
            fix = "keep norms/loss in FP32, clip gradients" if low == "bf16" else _fp16_fix(curves[low])
            problems.append(
                f"{low.upper()} curve departs from FP32 by {_pct(gaps[worst], cfg.smoke.bf16_tolerance)} over "
                f"steps {worst}-{worst + k - 1} "
                f"(smoke.bf16_tolerance {_pct(cfg.smoke.bf16_tolerance)}); {fix}"
            )
    return problems, figures


def sibling_note(smoke_model: dict) -> str:
    """The summary's note when smoke trained another model than the configured one: its size to three digits
    (a 140K-parameter model read "0M-param")."""
    return f" on {smoke_model['params'] / 1e6:.3g}M-param sibling of {smoke_model['derived_from']}"


def _pct(x: float, limit: float | None = None) -> str:
    """A share as a percentage that never reads as another figure: a setting (`limit` None) as it is (5%, 0.4%); a
    measured one to 0.1 % (5.7%), or with as many more decimals as tell it apart from `limit` (0.003% against 0%).
    A tolerance of 0.4 % or a gap of 0.003 % printed as "0%" made the verdict's line contradict itself."""
    if limit is None:
        return f"{x * 100:g}%"
    decimals = next((d for d in range(1, 7) if round(x * 100, d) != round(limit * 100, d)), 6)
    return f"{x:.{decimals}%}"


def _fp16_fix(curve: Curve) -> str:
    """What the FP16 departure points to, with the loss scaler's record (training's scaler ran the curve)."""
    state = curve.loss_scaler or {}
    skipped = state.get("skipped_steps", 0)
    if not skipped:
        return "FP16 range: keep norms/softmax/loss in FP32, or train in bf16/fp32"
    return (
        f"{skipped} of {len(curve.losses)} FP16 steps overflowed and were skipped (loss scale now {state['scale']:g}): "
        "FP16's range is too narrow for this model; train in bf16 or fp32"
    )


def _rolling(values: list, k: int) -> list:
    return [sum(values[i : i + k]) / k for i in range(len(values) - k + 1)]


def plot_curves(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, c in curves.items():
        ax.plot(range(len(c.losses)), c.losses, marker=".", label=name.upper())
    ax.set(xlabel="step", ylabel="loss", title=f"Smoke run: {' vs '.join(n.upper() for n in curves)} autocast")
    ax.legend()
    atomic_save_figure(fig, path)
    tracking.log_artifact(path, "smoke")


def log_memory_estimate(cfg, tcfg, seq_len: int, peak_bytes: int) -> float:
    """Calibrate the planner: its estimate for the FP32 run over the measured peak (on CPU the peak is the process
    RSS, libraries included, so the ratio there is far below 1; on NPU/CUDA it is the allocator's peak)."""
    from tasks.planner import estimate_for_run

    ratio = estimate_for_run(tcfg, seq_len, cfg.smoke.micro_batch, precision="fp32") / max(peak_bytes, 1)
    tracking.log_metrics({"memory.estimate_over_measured": ratio})
    return ratio


def compare_precision(cfg, tcfg, state: dict, tokens, dev) -> dict:
    """smoke.compare_with_cpu: per-layer errors of one forward on the device against FP32 on the CPU, both models
    with model.converters as the curves apply them (MLflow: smoke.compare.* metrics, the per-layer max relative
    error as a step series, smoke/compare.json)."""
    from tasks.model import compare as cmp

    precision = cfg.smoke.compare_precision
    if precision == "bf16" and not devices.bf16_supported(dev.type):
        precision = "fp16" if devices.fp16_supported(dev.type) else "fp32"
    return cmp.compare_with_cpu(
        tcfg, state, tokens, dev, precision, cfg.smoke.compare_tolerance, cfg.model.converters, cfg
    )


def log_compare(result: dict) -> None:
    from tasks.model import compare as cmp

    tracking.log_metrics(
        {"smoke.compare.max_rel": result["max_rel"], "smoke.compare.logits_max_rel": result["logits_max_rel"] or 0.0}
    )
    # The series over the model's top-level parts (embedding, each block, norm, logits): the full table is the JSON.
    top = [r for r in result["layers"] if "max_rel" in r and re.fullmatch(r"[^.]+|layers\.\d+", r["layer"])]
    for i, row in enumerate(top):
        tracking.log_metrics({"smoke.compare.layer_max_rel": row["max_rel"]}, step=i)
    tracking.log_json_artifact(result, "smoke/compare.json")
    tracking.set_tags(
        {"smoke.compare.first_beyond": result["first_beyond"] or "none", "smoke.compare.summary": cmp.summary(result)}
    )


def _run_curves(precisions, tcfg, state, batches, dev, cfg, what: str, revisit: int = 0) -> dict:
    from tasks.model import num_params

    curves: dict[str, Curve] = {}
    for precision in precisions:
        fp32_clean = "fp32" in curves and curves["fp32"].failure is None
        try:
            curves[precision] = curve = run_curve(
                precision, tcfg, state, batches, dev, cfg, fp32_clean, revisit=revisit
            )
        except RuntimeError as e:  # torch.OutOfMemoryError on CUDA, a RuntimeError naming it on NPU
            if "out of memory" not in str(e).lower():
                raise
            raise StageError(
                f"smoke: {num_params(tcfg) / 1e9:.2f}B-parameter {what} does not fit one {dev} with "
                f"micro_batch {cfg.smoke.micro_batch} (AdamW, FP32); smoke is single-device: lower "
                f"smoke.micro_batch, or raise smoke.memory_margin with smoke.model=auto (a smaller sibling)"
            ) from None
        if curve.failure:
            break
    return curves


def log_op_support(kind: str, warning_texts: list[str]) -> dict:
    """Operators that fell back to the CPU during the smoke run (NPU), or why there are none (CPU/CUDA)."""
    from tasks.model import op_support

    rep = op_support.report(kind, warning_texts)
    tracking.log_json_artifact(rep, "smoke/op_support.json")
    tracking.log_metrics({"smoke.op_support.fallback_ops": len(rep["fallback"])})
    return rep


def run(cfg, ctx) -> dict:
    from tasks.model import num_params

    shard_dir = runner.shard_set(cfg, ctx)
    if cfg.model.hf_path:
        from tasks.model.hf_io import tokenizer_problem

        problem = tokenizer_problem(repo_path(cfg.model.hf_path), shard_dir)
        if problem:
            raise ConfigError(problem)
    vocab = tokenizer_vocab(shard_dir)
    batches = load_batches(shard_dir, cfg.smoke.steps, cfg.smoke.micro_batch, cfg.train.seed, cfg.data.verify_sha256)
    full, tcfg, smoke_model = choose_model(cfg, vocab, cfg.data.seq_len)
    backend = devices.detect(cfg.hardware.device)
    dev = devices.torch_device(backend.kind, 0)
    low, bad_precision = low_precision(
        backend.kind, cfg.train.precision, devices.bf16_supported(backend.kind), devices.fp16_supported(backend.kind)
    )
    if bad_precision:
        raise ConfigError(bad_precision)
    check_batches(batches, tcfg)
    tracking.log_params(
        {
            "smoke.device": str(dev),
            "smoke.params": num_params(tcfg),
            "smoke.family": tcfg.family,
            "smoke.lr": smoke_lr(cfg, tcfg),
            "smoke.shard_dir": str(shard_dir),
            **{f"smoke_model.{k}": v for k, v in smoke_model.items()},
        }
    )
    tracking.log_json_artifact(smoke_model, "smoke/smoke_model.json")
    own = tcfg is full  # smoke trains the configured model itself (the checkpoint's, with model.hf_path)
    checkpoint = checkpoint_first_loss(cfg, full, batches[0], dev, defer_nonfinite=own) if cfg.model.hf_path else None
    state = initial_model(cfg, tcfg, own)
    precisions = ["fp32"] + ([low] if low else [])
    (ctx.run_dir / "smoke_report.json").unlink(missing_ok=True)  # a rerun must not show an old failure
    recorder = warnings.catch_warnings(record=True) if backend.kind == "npu" else contextlib.nullcontext([])
    with recorder as seen:  # torch_npu's CPU-fallback warnings, for the operator-support report
        if backend.kind == "npu":
            warnings.simplefilter("always")
        what = "model" if own else f"smoke model (smoke.model={cfg.smoke.model})"
        pretrained = own and bool(cfg.model.hf_path)
        curves = _run_curves(precisions, tcfg, state, batches, dev, cfg, what, revisit=window(cfg) if pretrained else 0)
    op_report = log_op_support(backend.kind, [str(w.message) for w in seen])
    plot_curves(curves, ctx.run_dir / "smoke_loss.png")
    failure = next((c.failure for c in curves.values() if c.failure), None)
    problems, figures = ([], {}) if failure else verdict(curves, cfg, pretrained=pretrained)
    compared = None
    if cfg.smoke.compare_with_cpu:
        compared = compare_precision(cfg, tcfg, state, batches[0][0][:1], dev)  # one sequence of the first batch
        log_compare(compared)
    peak = max(c.peak_bytes for c in curves.values())
    tokens_per_s = {name: round(c.tokens_per_s, 1) for name, c in curves.items()}
    tracking.log_metrics(
        {
            **{f"smoke.{k}": v for k, v in figures.items()},
            "smoke.peak_memory_mb": peak / MB,
            **{f"smoke.{k}.tokens_per_s": v for k, v in tokens_per_s.items()},
        }
    )
    if failure or problems:
        report = failure or {"cause": "; ".join(problems), "layers": []}
        report["losses"] = {name: c.losses for name, c in curves.items()}
        report["revisit"] = {name: c.revisit for name, c in curves.items() if c.revisit}  # [before, after]
        report["loss_scaler"] = {name: c.loss_scaler for name, c in curves.items() if c.loss_scaler}
        report["op_support"] = op_report
        report["smoke_model"] = smoke_model
        if compared:
            report["compare"] = compared
        report_path = atomic_write_json(ctx.run_dir / "smoke_report.json", report)
        tracking.log_json_artifact(report, "smoke/layer_report.json")
        advice = f"; likely: {report['advice'][0]}" if failure else ""
        raise StageError(f"smoke failed: {report['cause']}{advice} (per-layer report: {report_path})")
    ratio = log_memory_estimate(cfg, tcfg, batches[0][0].shape[1], curves["fp32"].peak_bytes)
    fp32 = curves["fp32"].losses
    gap = figures.get(f"{low}.max_rel_gap")
    extra = {}
    if compared:
        from tasks.model.compare import summary as compare_summary

        atomic_write_json(ctx.run_dir / "smoke_report.json", {"compare": compared})
        extra["compare"] = {
            k: compared[k]
            for k in (
                "first_beyond",
                "first_beyond_rel",
                "logits_max_rel",
                "max_rel",
                "tolerance",
                "precision",
                "device",
            )
        }
        extra["compare"]["summary"] = compare_summary(compared)
        extra["compare"]["report"] = str(ctx.run_dir / "smoke_report.json")
    if checkpoint:
        extra["checkpoint"] = checkpoint
    on = "" if own else sibling_note(smoke_model)
    return {
        "status": "ok" if low and not (compared and compared["first_beyond"]) else "warn",
        "summary": (
            (f"checkpoint loss {checkpoint['loss']:.2f} ({checkpoint['ratio']:.0%} of ln V); " if checkpoint else "")
            + f"FP32 loss {fp32[0]:.3f}→{fp32[-1]:.3f}"
            + (f", {low.upper()} within {gap:.1%}" if gap is not None else ", no 16-bit precision on this device")
            + f", {tokens_per_s['fp32']:.0f} tok/s on {dev}{on}"
            + (f"; compare: {extra['compare']['summary']}" if compared else "")
        ),
        "op_support": op_report,
        **extra,
        "smoke_model": smoke_model,
        "precisions": precisions,
        "lr": smoke_lr(cfg, tcfg),
        "device": str(dev),
        "shard_dir": str(shard_dir),
        "params": num_params(tcfg),
        "losses": {name: [round(v, 5) for v in c.losses] for name, c in curves.items()},
        "loss_scaler": {name: c.loss_scaler for name, c in curves.items() if c.loss_scaler},  # FP16's, as training's
        "converters": curves["fp32"].converters,  # model.converters as applied (the trainer's ranks log the same)
        "figures": figures,
        "tokens_per_s": tokens_per_s,
        "peak_memory_bytes": peak,
        "memory_estimate_over_measured": ratio,
        "plot": str(ctx.run_dir / "smoke_loss.png"),
    }
