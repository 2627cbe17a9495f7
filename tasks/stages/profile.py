"""Profiling: a short profiled run of the same trainer and plan, analysed into one report with advisor findings and a
comparison with the last successful profile of the experiment.

`python -m tasks profile` collects (torch_npu.profiler on NPU, torch.profiler on CUDA/CPU, optionally wrapped in
msprof) and analyses; `python -m tasks profile analyze PATH [--json]` analyses any supported folder — torch_npu
`*_ascend_pt`/`ASCEND_PROFILER_OUTPUT`, msprof `PROF_*`, msprof-analyze `cluster_analysis_output`, torch.profiler
traces — in pure Python on any machine. Writes <run-dir>/profile/{report.json, report.md, *.png}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from tasks import runner, tracking
from tasks.bounds import stage_timeout
from tasks.config import PipelineConfig
from tasks.errors import StageError
from tasks.fsutil import atomic_write_json, atomic_write_text, read_json
from tasks.profiling import baseline, charts
from tasks.profiling.loader import load_profile
from tasks.profiling.msprof import find_msprof, msprof_wrap
from tasks.profiling.render import render_markdown
from tasks.profiling.report import build_report, headline


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        choices=("collect", "analyze"),
        default="collect",
        help="collect: profile a short training run, then analyse (default); analyze: analyse PATH",
    )
    parser.add_argument(
        "path",
        nargs="?",
        default=None,
        help="analyze: a profiling folder (*_ascend_pt, ASCEND_PROFILER_OUTPUT, PROF_*, "
        "cluster_analysis_output, a folder of them) or torch.profiler trace(s)",
    )
    runner.add_shard_dir_arg(parser, "for collect's training run")


def analyze(path: str | Path) -> dict:
    """The report of a profiling folder or trace, findings included (no baseline: that needs MLflow)."""
    from tasks.model import op_support
    from tasks.profiling.advisor import device_kind
    from tasks.profiling.rules_guides import evaluate

    report = build_report(load_profile(path))
    report["findings"], report["info"] = evaluate(report)  # again in engine.apply when it swaps the breakdown
    fmt = report["source"]["format"]
    kind = device_kind(report)
    per_rank_ops = fmt in ("ascend_pt", "msprof")  # msprof-analyze's cluster output has no operator table
    report["op_support"] = op_support.report(kind, ai_cpu=report["ai_cpu_ops"] if per_rank_ops else None)
    return report


def write_outputs(report: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "breakdown_png": charts.step_breakdown(report, out_dir / "step_breakdown.png"),
        "top_ops_png": charts.top_ops(report, out_dir / "top_ops.png"),
    }
    paths = {k: v for k, v in paths.items() if v}
    md = render_markdown(report, {k.removesuffix("_png"): p.name for k, p in paths.items()})
    paths["report_json"] = atomic_write_json(out_dir / "report.json", report)
    paths["report_md"] = atomic_write_text(out_dir / "report.md", md)
    return paths


def msprof_source(msprof_dir: Path) -> Path:
    """The folder to analyse after an msprof-wrapped run: msprof's PROF_* output (torch_npu.profiler is not started
    under msprof: torch_npu >= 2.10 disables it there, so the traces folder stays empty)."""
    if not any(Path(msprof_dir).rglob("PROF_*")):
        raise StageError(
            f"msprof wrapped the run but wrote no PROF_* folder under {msprof_dir}: check msprof's "
            "output above and that the CANN toolkit's msprof matches the driver"
        )
    return Path(msprof_dir)


def _npu_option_checks(cfg: PipelineConfig) -> list[str]:
    """Refuse profiler options the installed torch_npu lacks (one line), return the warnings as notes."""
    from tasks.envcheck.compat import torchnpu_release
    from tasks.device import package_version
    from tasks.profiling.collect import npu_option_problems

    errors, warnings = npu_option_problems(cfg.profile, torchnpu_release(package_version("torch-npu")))
    if errors:
        raise StageError(errors[0])
    return warnings


def planned_launch(cfg: PipelineConfig, ctx) -> dict:
    """{"layout", "world"} a collect would launch now, resolved as train.prepare resolves them (pinned degrees, else
    the plan's choice in ctx.inputs["plan"]): the marker records the same two from the launch spec."""
    from tasks import layout as layouts
    from tasks.launch import torchrun

    plan = ctx.inputs.get("plan")
    _, _, world = torchrun.world(cfg, plan)
    return {"layout": layouts.resolve(cfg, plan, world).to_dict(), "world": world}


# profile.* settings that change only the analysis of the collected traces (or whether the stage runs at all), never
# what the profiled run collects: changing them re-analyses the traces of an earlier collect instead of collecting again
ANALYSIS_ONLY = ("enabled", "analyzer", "fail_on_regression", "regression_threshold")


# Config sections the profiled run (train.prepare, the launch, the ranks) never reads, so their change cannot change
# what a collect records: smoke (the smoke stage's model choice: tasks/model/sibling.py), evaluate (the evaluate
# stage, its gate and the registry), tracking (no rank reads it: a training stage's own process sends metrics.jsonl
# to MLflow, tasks.parallel.metrics.MetricsFollower, and collect starts none), timeouts
# (bounds on how long a stage may take: a collect that finished ran within them) and quantize, which only the
# qat_int8 model converter reads (quantize.method and skip_layers: kept when model.converters lists it, as
# tasks.parallel.checkpoint.shaping_config keeps them). Any other section, a new one included, collects again.
NOT_COLLECTED = ("smoke", "evaluate", "tracking", "timeouts", "quantize")


def collect_digest(cfg: PipelineConfig) -> str:
    """The config's digest without what a collect does not depend on: the sections the profiled run never reads
    (NOT_COLLECTED, but the quantize settings qat_int8 trains with) and the analysis-only profile settings
    (ANALYSIS_ONLY)."""
    from tasks.parallel.checkpoint import shaping_config

    config = cfg.to_dict()
    body = {k: v for k, v in config.items() if k != "preset" and k not in NOT_COLLECTED}
    body["profile"] = {k: v for k, v in body["profile"].items() if k not in ANALYSIS_ONLY}
    body["qat"] = {k: v for k, v in shaping_config(config).items() if k.startswith("quantize.")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def reusable(
    marker: Path, cfg: PipelineConfig, shard_dir: str, layout: dict | None = None, world: int | None = None
) -> Path | None:
    """The folder an earlier collect in this run directory left, when it profiled this config on this shard set
    (a --shard-dir is not part of the config's digest: another set is another profile) with this layout and world
    size (`planned_launch`: a re-plan — `plan --zero 3` after a collect under zero 1 — changes neither the config nor
    the shard set, only what train.prepare would launch). A marker without them (older) is not reused. "This config"
    is `collect_digest`'s: a change of profile.analyzer or the regression settings only re-analyses (a marker
    written before collect_hash existed is compared by the whole config's digest)."""
    done = read_json(marker) if marker.is_file() else {}
    if "collect_hash" in done:
        same = done["collect_hash"] == collect_digest(cfg)
    else:
        same = done.get("config_hash") == cfg.digest()
    if not same or done.get("shard_dir") != shard_dir:
        return None
    if done.get("layout") != layout or done.get("world") != world:
        return None
    return Path(done.get("source") or marker.parent)


def missing_ranks(traces: Path, backend: str | None, world: int | None) -> list[int]:
    """Ranks of `world` without their trace in `traces` (collect.make_profiler's names: `rank<r>.pt.trace.json` on
    CPU/CUDA, `rank<r>_<time>_ascend_pt/` from torch_npu's tensorboard_trace_handler); an empty file is missing."""
    from tasks.profiling.collect import trace_path

    if not world or backend not in ("cpu", "cuda", "npu"):
        return []
    if backend == "npu":
        return [r for r in range(world) if not any(p.is_dir() for p in traces.glob(f"rank{r}_*_ascend_pt"))]
    return [r for r in range(world) if not (trace_path(traces, r).is_file() and trace_path(traces, r).stat().st_size)]


def msprof_note(backend: str, msprof: str | None, msprof_dir: Path) -> str:
    """The report's note under profile.use_msprof: what collected the profile, and why msprof did not."""
    if msprof:
        return f"msprof wrapped the run (torch_npu.profiler not started under it): {msprof_dir}"
    if backend == "npu":
        return "profile.use_msprof is set but msprof is not on PATH: collected with torch_npu.profiler only"
    return f"profile.use_msprof applies to NPU runs only: this {backend} run was collected with torch.profiler"


def collect(cfg: PipelineConfig, ctx, out_dir: Path) -> tuple[Path, list[str]]:
    """Run the training stage's own launcher for a few steps with `--profile-dir`; returns the folder to analyse
    (the traces, or msprof's PROF_* output when msprof wrapped the run).

    Same trainer, model, shard set and layout (train.prepare resolves them exactly as the train stage does);
    its checkpoints and metrics go under <run-dir>/profile/run so the training run is untouched.
    """
    from tasks.launch import torchrun
    from tasks.stages import train

    shards = str(runner.shard_set(cfg, ctx))  # before the digest: data.seq_len follows the shard set (as train)
    traces, marker = out_dir / "traces", out_dir / "traces" / "collected.json"
    launch = planned_launch(cfg, ctx)
    if source := reusable(marker, cfg, shards, **launch):
        # not when a trace was deleted or emptied since: the rest would be reported as the whole run, fewer ranks
        if source != traces or not missing_ranks(traces, read_json(marker).get("backend"), launch["world"]):
            return source, [f"reused the profile collected earlier in {source}"]
    shutil.rmtree(traces, ignore_errors=True)
    spec = train.prepare(cfg, ctx)
    if cfg.profile.analyzer == "msprof-analyze" and spec["backend"] != "npu":  # before the run, not after it
        raise StageError(
            f"profile.analyzer is msprof-analyze but this run collects on {spec['backend']} (torch.profiler traces, "
            "which msprof-analyze does not read); use profile.analyzer=auto or builtin"
        )
    notes = _npu_option_checks(cfg) if spec["backend"] == "npu" else []
    work = out_dir / "run"
    shutil.rmtree(work, ignore_errors=True)
    # Training steps only: no validation forwards inside the profiled steps, no early stop.
    spec["config"]["train"].update(
        steps=cfg.profile.steps_needed(), checkpoint_every=0, eval_samples=0, early_stop_patience=0
    )
    spec.update(run_dir=str(work), resume=False, validation=None)
    spec_path = atomic_write_json(work / "launch.json", spec)
    # elastic's per-rank files in the stage's logs (without --log-dir: a torchelastic_* directory left in the system's
    # temporary directory by every launch, torch/distributed/elastic/multiprocessing/api.py _make_log_dir)
    elastic_dir = out_dir / "logs" / "torchelastic"
    shutil.rmtree(elastic_dir, ignore_errors=True)
    argv = torchrun.argv(
        cfg,
        spec["nproc"],
        [spec_path],
        rdzv_id=f"{ctx.run_dir.name}-profile",
        log_dir=elastic_dir,
        backend=spec["backend"],
    )
    argv += ["--profile-dir", str(traces)]
    msprof = find_msprof() if cfg.profile.use_msprof and spec["backend"] == "npu" else None
    if cfg.profile.use_msprof:
        notes.append(msprof_note(spec["backend"], msprof, out_dir / "msprof"))
    shutil.rmtree(out_dir / "msprof", ignore_errors=True)
    log_path = out_dir / "logs" / "torchrun.log"
    rc, log = torchrun.run(
        msprof_wrap(argv, out_dir / "msprof", msprof),
        torchrun.env(cfg, spec["backend"], spec["nproc"]),
        log_path,
        timeout=stage_timeout("profile", cfg, ctx.run_dir),
    )
    if rc != 0:
        if "unrecognized arguments: --profile-dir" in log:
            raise StageError(
                "the training worker does not accept --profile-dir (tasks/train/trainer.py must call "
                "tasks.profiling.collect.make_profiler); analyse existing traces with "
                "`python -m tasks profile analyze PATH`"
            )
        raise StageError(
            f"profiled training run failed (exit {rc}); see {log_path} and {work}/logs/rank-*.log", retryable=True
        )
    if msprof:
        source = msprof_source(out_dir / "msprof")
    elif not traces.is_dir() or not any(traces.iterdir()):
        raise StageError(
            f"the profiled run wrote no traces to {traces}: with {cfg.profile.steps_needed()} steps the "
            "schedule (profile.skip_first/wait/warmup/active) never reached an active step"
        )
    elif lost := missing_ranks(traces, spec["backend"], spec["world"]):
        raise StageError(
            f"the profiled run exited 0 but rank(s) {', '.join(map(str, lost))} of {spec['world']} wrote no trace "
            f"to {traces}: see {work}/logs/rank-*.log, then run the profile stage again",
            retryable=True,
        )
    else:
        source = traces
    atomic_write_json(
        marker,
        {
            "config_hash": cfg.digest(),
            "collect_hash": collect_digest(cfg),  # what reuse compares (analysis-only settings left out)
            "shard_dir": shards,
            "steps": cfg.profile.steps_needed(),
            "backend": spec["backend"],
            "world": spec["world"],
            "source": str(source),
            "layout": spec["layout"],  # what ran (train.prepare resolved it: pinned, or the plan's): the baseline key
            "model": spec["model"],
        },
    )
    return source, notes


def _log(report: dict, paths: dict[str, Path], extra_dir: Path | None, key: dict) -> None:
    n_high = sum(f["severity"] == "high" for f in report["findings"])
    tracking.log_metrics(
        {
            **baseline.report_metrics(report),
            "profile.findings": len(report["findings"]),
            "profile.findings_high": n_high,
        }
    )
    tracking.set_tags(
        {
            baseline.FORMAT_TAG: report["source"]["format"],
            "profile.source": report["source"]["path"],
            "profile.rules": ",".join(sorted({f["rule"] for f in report["findings"]})),
            baseline.KEY_TAG: baseline.key_digest(key),
            baseline.KEY_JSON_TAG: json.dumps(key, sort_keys=True),
            "profile.info": " | ".join(f["title"] for f in report.get("info", []))[:5000],
            "profile.op_support": report["op_support"]["note"][:5000],
            "profile.analyzer": report.get("engine", {}).get("used", "builtin"),
        }
    )
    agreement = report.get("engine", {}).get("agreement")
    if agreement:
        tracking.log_metrics({"profile.analyzer_agreement_worst": agreement["worst"]})
    for p in paths.values():
        tracking.log_artifact(p, "profile")
    if extra_dir and extra_dir.is_dir():
        tracking.log_artifact(extra_dir, "profile/msprof_analyze")


def run(cfg: PipelineConfig, ctx) -> dict:
    out_dir = ctx.run_dir / "profile"
    path = getattr(ctx.args, "path", None)
    if getattr(ctx.args, "action", "collect") == "analyze":
        if not path:
            raise StageError("profile analyze needs the folder to analyse: python -m tasks profile analyze PATH")
        if getattr(ctx.args, "shard_dir", None):  # else ignored without a word: analyze runs no training
            raise StageError(
                "--shard-dir is for collect's training run; `profile analyze` reads only PATH: drop --shard-dir"
            )
        source, notes, device_kind, collected = Path(path).expanduser().resolve(), [], None, {}
    elif path:  # `profile collect PATH` would collect and never look at PATH
        raise StageError(
            f"profile collect takes no PATH (got {path}): to analyse that folder run "
            f"`python -m tasks profile analyze {path}`"
        )
    elif not cfg.profile.enabled:
        return {"status": "ok", "summary": "skipped (profile.enabled is false)", "skipped": True}
    else:
        source, notes = collect(cfg, ctx, out_dir)
        collected = read_json(out_dir / "traces" / "collected.json")
        device_kind = collected.get("backend")
    report = analyze(source)
    fmt = report["source"]["format"]
    report["source"]["notes"] += notes
    analyze_dir = out_dir / "msprof_analyze"
    from tasks.profiling import engine  # profile.analyzer: msprof-analyze as primary engine where installed

    engine.apply(cfg.profile.analyzer, report, source, analyze_dir)
    key = baseline.profile_key(cfg, report, device_kind, collected)
    found, note = baseline.find_baseline(cfg, key, ctx.mlflow_run_id)
    comparison, regressions = baseline.compare(report, found, cfg.profile.regression_threshold)
    report["baseline"] = comparison
    report["baseline_key"], report["baseline_note"] = key, note
    report["findings"] += regressions
    if getattr(ctx.args, "action", "collect") != "analyze":  # router statistics of the profiled run (MoE models)
        from tasks.profiling.collect import active_steps
        from tasks.profiling.moe_rules import MAX_OVER_MEAN, expert_imbalance, expert_load

        # the recorded steps only, as the trace's figures: not the skipped / warm-up steps' routing
        active = active_steps(cfg.profile)
        report["moe"] = expert_load(out_dir / "run" / "metrics.jsonl", MAX_OVER_MEAN, active)
        report["findings"] += expert_imbalance(out_dir / "run" / "metrics.jsonl", MAX_OVER_MEAN, active)
    paths = write_outputs(report, out_dir)
    if ctx.mlflow_run_id:
        _log(report, paths, analyze_dir, key)
        if report.get("moe"):
            tracking.log_metrics({"profile.moe_load_max_over_mean": report["moe"]["max_over_mean"]})
    summary = headline(report)
    if regressions and cfg.profile.fail_on_regression:
        raise StageError(f"{regressions[0]['title']} ({summary}); see {paths['report_md']}")
    findings = report["findings"]
    return {
        "status": "warn" if regressions or any(f["severity"] == "high" for f in findings) else "ok",
        "summary": summary,
        "report": str(paths["report_json"]),
        "report_md": str(paths["report_md"]),
        "findings": len(findings),
        "rules": [f"{f['severity']}:{f['rule']}" for f in findings],
        "info": [f["title"] for f in report.get("info", [])],
        "op_support": report["op_support"]["note"],
        "step_ms": round(report["step"]["step_us"] / 1000, 3),
        "comm_not_overlapped_share": round(report["step"]["shares"]["comm_not_overlapped"], 4),
        "all_to_all_share": round(report["step"]["all_to_all_share"], 4),
        "moe_load_max_over_mean": round(report["moe"]["max_over_mean"], 3) if report.get("moe") else None,
        "format": fmt,
        "source": str(source),
        "world": report["world"],
        "analyzer": report["engine"]["used"],
        "baseline_run_id": comparison["run_id"] if comparison else None,
        "baseline_note": note,
    }
