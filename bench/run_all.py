"""Run every bench/bench_*.py (each `run() -> {"area.figure": value}`); write bench/results.json, bench/results.md and
the generated figures block of docs/benchmarks.md. This is the only writer of those three.

Each bench measures its figure side by side with a baseline in the same run and reports ratios. A bench that
fails (or exits: SystemExit) is recorded as an error (and makes this exit non-zero) without hiding the others'
figures; Ctrl-C or SIGTERM stops the run and still writes the figures of the benches that finished (exit 130).
`python bench/run_all.py [name …] [--force]` runs only the named benches (e.g. `data train_step`): their figures
replace that bench's old ones, every other figure is kept as it was, with its own provenance: the bench, date,
machine, commit and the host's load over that bench (`HostLoad`: 1-minute load average and CPU steal).
A bench run on a loaded host (mean 1-minute load average above the CPU count) says so, and its figures do not
replace the same bench's figures measured on a quieter host unless `--force` (exit 3 names what was kept).
A bench whose module sets `DETERMINISTIC = True` (figures that do not depend on the host) is never held back; the
test of deterministic figures recomputes those and compares them with results.json.
`python bench/run_all.py --docs` runs nothing: it rewrites results.md and the docs block from results.json (alone:
bench names or --force beside it are refused).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
RESULTS, RESULTS_MD, DOCS = HERE / "results.json", HERE / "results.md", ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
UNKNOWN = {"bench": None, "date": "unknown", "machine": {}, "commit": "unknown", "load": None}

# The figures docs/benchmarks.md shows (its prose says what each measures), per section.
DOC_FIGURES = {
    "Training step (`train_step`, `trainer`, `train`, `data`)": [
        "train_step.cpu_mfu",
        "train_step.cpu_matmul_peak_gflops",
        "train_step.achieved_gflops",
        "train_step.threads",
        "train_step.ratio_vs_plain_loop",
        "train_step.ratio_vs_transformers",
        "train_step.trainer_ratio_vs_plain_loop",
        "train_step.compile_speedup_vs_eager",
        "train_step.compile_speedup_vs_eager_math_attention",
        "train_step.compile_first_step_s",
        "train.dp2_speedup_ratio",
        "train.planner_over_measured_dp2",
        "loader.ratio_vs_plain_webdataset",
    ],
    "Checkpoints (`checkpoint`)": [
        "checkpoint.sync_save_s",
        "checkpoint.async_stall_s",
        "checkpoint.async_stall_ratio",
        "checkpoint.async_step_slowdown",
        "checkpoint.size_mb",
    ],
    "Smoke on a sibling (`smoke_sibling`)": [
        "smoke.sibling_of",
        "smoke.sibling_params_over_full",
        "smoke.sibling_time_over_full",
        "smoke.demo_estimate_over_tracked",
        "smoke.llama3_8b_estimate_over_tracked",
    ],
    "Rehearsal (`rehearsal`)": [
        "rehearsal.estimate_over_measured",
        "rehearsal.estimate_gb",
        "rehearsal.dp4_zero0_estimate_over_measured",
    ],
    "Evaluation (`eval`, lm-eval)": [
        "eval.0shot.wrapper_speedup_vs_hflm",
        "eval.3shot.wrapper_speedup_vs_hflm",
        "eval.0shot.max_loglikelihood_diff",
        "eval.0shot.wrapper_accuracy",
        "eval.0shot.hflm_accuracy",
    ],
    "Sharding fanned out (`fanout`, Celery)": [
        "data.fanout_speedup_2_workers",
        "data.fanout_tokens_per_s_1_worker",
        "data.fanout_tokens_per_s_2_workers",
        "data.fanout_reduce_share_2_workers",
    ],
    "INT8 (`quant`)": [
        "quant.config",
        "quant.decode_speed_vs_bf16.b1",
        "quant.decode_speed_vs_bf16.b8",
        "quant.prefill_speed_vs_bf16.b1",
        "quant.prefill_speed_vs_bf16.b8",
        "quant.size_ratio_vs_bf16",
        "quant.accuracy_drop_pct",
        "quant.greedy_agreement",
        "quant.bf16_decode_tokens_per_s.b1",
        "quant.bf16_decode_tokens_per_s.b8",
        "quant.torchao_plain_decode_speed_vs_bf16.b1",
        "quant.torchao_plain_decode_speed_vs_bf16.b8",
        "quant.compiled_decode_speed_vs_bf16_compiled.b1",
        "quant.compiled_decode_speed_vs_bf16_compiled.b8",
        "quant.w8a8.decode_speed_vs_bf16.b1",
        "quant.w8a8.decode_speed_vs_bf16.b8",
        "quant.w8a8.size_ratio_vs_bf16",
        "quant.w8a8.accuracy_drop_pct",
    ],
    "Sharding (`data`)": [
        "sharding.tokens_per_s_ratio_vs_tokenizer",
        "sharding.peak_rss_mb_by_size",
        "sharding.peak_pss_mb_by_size",
    ],
    "Mixture of experts (`moe`)": [
        "moe.tokens_per_s_ratio_vs_dense_same_active_params",
        "moe.grouped_mm_speedup_vs_loop",
        "moe.ep2_all_to_all_share",
        "moe.ep2_all_to_all_wait_share",
        "moe.ep2_all_to_all_transfer_share",
        "moe.ep2_all_to_all_transfer_ms_per_step",
        "moe.ep2_planner_all_to_all_share",
        "moe.ep2_planner_all_to_all_ms_per_step",
        "moe.gloo_all_to_all_latency_us",
        "moe.gloo_all_to_all_gbps",
        "moe.ep2_alpha_beta_measured_ms_per_step",
    ],
    "Planner (`planner`, deterministic)": [
        "planner.llama3_70b_8x8x910b.best_layout",
        "planner.llama3_70b_8x8x910b.best_total_gb",
        "planner.llama3_70b_8x8x910b.feasible_plans",
        "planner.13b_one_910b.verdict",
        "planner.act_estimate_over_saved.demo_s128_b4_bf16",
    ],
    "Scale (`scale`, Qwen2-0.5B shapes on 4 gloo ranks)": [
        "scale.qwen2_0_5b.peak_rss_gb_per_rank",
        "scale.qwen2_0_5b.rss_over_full_model",
        "scale.qwen2_0_5b.held_over_full_model",
        "scale.qwen2_0_5b.estimate_over_measured",
        "scale.qwen2_0_5b.estimate_gb",
        "scale.qwen2_0_5b.dp2_tp2_glibc_1mb.peak_rss_gb_per_rank",
        "scale.qwen2_0_5b.dp2_tp2_glibc_1mb.rss_over_full_model",
        "scale.qwen2_0_5b.dp2_tp2_glibc_1mb.estimate_over_measured",
        "scale.hf_import_peak_rss_over_shard",
        "scale.hf_export_peak_rss_over_shard",
        "zero.estimate_over_measured.0",
        "zero.estimate_over_measured.3",
    ],
}


def machine() -> dict:
    """What the figures were measured on: platform, CPU model and count (the committed figures are CPU-bound)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": cpu,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


def commit() -> str:
    """HEAD's short hash, `-dirty` when tracked files other than the ones this script writes differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        outputs = [":!bench/results.json", ":!bench/results.md", ":!docs/benchmarks.md"]  # what this script writes
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *outputs],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def _load1() -> float | None:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cpu_times() -> list[int] | None:
    """/proc/stat's aggregate cpu line: user nice system idle iowait irq softirq steal … (in clock ticks)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return [int(v) for v in fields[1:]] if fields and fields[0] == "cpu" else None
    except (OSError, ValueError):
        return None


class HostLoad:
    """How busy the host was during a bench: the 1-minute load average (/proc/loadavg) at the start and every
    `every` seconds by a sampler thread (mean, max), and CPU steal — the hypervisor's share of all CPU time, the 8th
    column of /proc/stat's cpu line — between start and end. `loaded`: mean load above the host's CPU count (a
    bench's own processes count too). Off Linux the figures are None."""

    def __init__(self, every: float = 1.0):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._before = self._after = None

    def _add(self) -> None:
        value = _load1()
        if value is not None:
            self.samples.append(value)

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self._add()

    def __enter__(self) -> HostLoad:
        self._before = _cpu_times()
        self._add()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._add()
        self._after = _cpu_times()

    def result(self) -> dict:
        cpus, s = os.cpu_count() or 1, self.samples
        steal = None
        if self._before and self._after and len(self._before) >= 8 and len(self._after) >= 8:
            delta = [b - a for a, b in zip(self._before[:8], self._after[:8])]
            steal = round(100 * delta[7] / sum(delta), 2) if sum(delta) > 0 else 0.0
        mean = round(statistics.fmean(s), 2) if s else None
        return {
            "load1_start": s[0] if s else None,
            "load1_mean": mean,
            "load1_max": max(s) if s else None,
            "steal_pct": steal,
            "cpus": cpus,
            "loaded": mean is not None and mean > cpus,
        }


def load_label(load: dict | None) -> str:
    if not load or load.get("load1_mean") is None:
        return "load not recorded"
    steal = "" if load.get("steal_pct") is None else f", steal {load['steal_pct']}%"
    flag = " ⚠ loaded" if load.get("loaded") else ""
    return f"load {load['load1_mean']}/{load['cpus']} CPUs{steal}{flag}"


def _legacy_provenance(previous: dict) -> dict:
    """A results.json from before per-figure provenance: every figure gets that file's one date and machine."""
    stamp = dict(UNKNOWN, date=previous.get("date", "unknown"), machine=previous.get("machine", {}))
    return {k: dict(stamp) for k in previous.get("figures", {})}


def merge(previous: dict, fresh: dict[str, dict], stamps: dict[str, dict]) -> tuple[dict, dict]:
    """Old figures + this run's: a rerun bench's old figures are dropped (also ones it no longer reports), every
    other figure keeps its value and its own provenance. `fresh` maps bench name → its figures, `stamps` bench
    name → its provenance (date, machine, commit, load). → (figures, provenance)."""
    figures = dict(previous.get("figures", {}))
    prov = previous.get("provenance") or _legacy_provenance(previous)
    prov = {k: dict(UNKNOWN, **(prov.get(k) or {})) for k in figures}
    for name, figs in fresh.items():
        areas = {k.split(".", 1)[0] for k in figs}
        stale = [
            k
            for k, p in prov.items()
            if p.get("bench") == name or (p.get("bench") is None and k.split(".", 1)[0] in areas)
        ]
        for k in stale:
            figures.pop(k, None)
            prov.pop(k, None)
        for k, v in figs.items():
            figures[k] = v
            prov[k] = dict(stamps[name], bench=name)
    return figures, prov


def quieter_kept(previous: dict, name: str, load: dict) -> dict | None:
    """The provenance of bench `name`'s committed figures when a loaded run must not replace them: they were
    measured on a quieter host (lower mean load) than `load`. None when the new figures may replace them."""
    if not load.get("loaded"):
        return None
    olds = [
        p
        for p in (previous.get("provenance") or {}).values()
        if p.get("bench") == name and (p.get("load") or {}).get("load1_mean") is not None
    ]
    if not olds:
        return None  # nothing recorded says the old figures were quieter
    quietest = min(olds, key=lambda p: p["load"]["load1_mean"])
    return quietest if quietest["load"]["load1_mean"] < load["load1_mean"] else None


def _value(v) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def _machines(prov: dict) -> list[str]:
    labels: list[str] = []
    for p in prov.values():
        label = _machine_label(p.get("machine", {}))
        if label not in labels:
            labels.append(label)
    return labels


def _machine_label(m: dict) -> str:
    return f"{m.get('processor', '?')} ×{m.get('cpus', '?')}, {m.get('platform', '?')}" if m else "unknown"


def _measured(p: dict, machines: list[str]) -> str:
    m = machines.index(_machine_label(p.get("machine", {}))) + 1
    load = "deterministic" if p.get("deterministic") else load_label(p.get("load"))
    return f"{p['date']} M{m}, commit {p.get('commit', 'unknown')}, {load}"


def markdown(doc: dict) -> str:
    machines = _machines(doc["provenance"])
    refreshed = ", ".join(doc["refreshed"]) or "none"
    lines = [
        "# Benchmark results",
        "",
        f"Last run {doc['date']} refreshed: {refreshed}. Every other figure is from its own earlier run: each row "
        "says when, on which machine (M#), at which commit and under what host load (mean 1-minute load average "
        "over the bench / CPUs, CPU steal; ⚠ loaded: load above the CPU count) it was measured.",
        "",
    ]
    lines += [f"- M{i + 1}: {label}" for i, label in enumerate(machines)]
    lines += ["", "| figure | value | measured |", "|---|---|---|"]
    for k in sorted(doc["figures"]):
        lines.append(f"| `{k}` | {_value(doc['figures'][k])} | {_measured(doc['provenance'][k], machines)} |")
    if doc.get("kept"):
        lines += ["", "## Kept (this run was on a loaded host)", ""]
        lines += [f"- `{k}`: {v}" for k, v in doc["kept"].items()]
    if doc["errors"]:
        lines += ["", "## Errors (this run)", ""] + [f"- `{k}`: {v}" for k, v in doc["errors"].items()]
    return "\n".join(lines) + "\n"


def docs_block(doc: dict) -> str:
    """The generated part of docs/benchmarks.md: DOC_FIGURES' values from results.json, with their provenance."""
    shown = {k for keys in DOC_FIGURES.values() for k in keys}
    machines = _machines({k: p for k, p in doc["provenance"].items() if k in shown})
    lines = [BEGIN, "<!-- generated by bench/run_all.py from bench/results.json: do not edit by hand -->", ""]
    lines += [f"Machines: {'; '.join(f'M{i + 1} {m}' for i, m in enumerate(machines))}.", ""]
    for title, keys in DOC_FIGURES.items():
        lines += [f"**{title}**", "", "| figure | value | measured |", "|---|---|---|"]
        for k in keys:
            if k in doc["figures"]:
                lines.append(f"| `{k}` | {_value(doc['figures'][k])} | {_measured(doc['provenance'][k], machines)} |")
            else:
                lines.append(f"| `{k}` | — | not in results.json |")
        lines.append("")
    return "\n".join(lines + [END])


def rewrite_docs(text: str, block: str) -> str:
    """`text` with its marked block replaced by `block` (exactly one begin and one end marker, in order)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{DOCS} must hold exactly one {BEGIN} … {END} block")
    head, rest = text.split(BEGIN)
    return head + block + rest.split(END, 1)[1]


def write_outputs(doc: dict) -> None:
    from tasks.fsutil import atomic_write_text

    atomic_write_text(RESULTS_MD, markdown(doc))
    atomic_write_text(DOCS, rewrite_docs(DOCS.read_text(), docs_block(doc)))


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is (as Ctrl-C is): the benches that finished are still written."""


def _terminated(signum, frame) -> None:
    raise _Terminated("SIGTERM")


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _run_benches(names, base, fresh, stamps, errors, timings) -> str | None:
    """Run the benches in turn, each one's figures into `fresh` or its one-line error into `errors` (SystemExit
    too: a bench that exits is that bench's error, the others still run). Ctrl-C or SIGTERM stops the run: that
    bench is recorded as interrupted and its name returned, so that what finished is still written."""
    for name in names:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"bench_{name}.py")
        mod = importlib.util.module_from_spec(spec)
        started = time.time()
        print(f"== bench {name}", flush=True)
        stop = None
        with HostLoad() as load:
            try:
                spec.loader.exec_module(mod)
                figures = mod.run()
                fresh[name] = figures
                for k, v in figures.items():
                    print(f"   {k} = {v}", flush=True)
            except KeyboardInterrupt as e:  # stop here; the finished benches' figures are written
                stop = "SIGTERM" if isinstance(e, _Terminated) else "KeyboardInterrupt"
                errors[name] = f"interrupted ({stop}): no figures; rerun it"
            except BaseException:  # SystemExit, any error: keep the other benches' figures; report this one
                errors[name] = traceback.format_exc().strip().splitlines()[-1]
                print(traceback.format_exc(), file=sys.stderr)
        stamps[name] = dict(base, load=load.result(), deterministic=bool(getattr(mod, "DETERMINISTIC", False)))
        print(f"   host: {load_label(stamps[name]['load'])}", flush=True)
        timings[name] = round(time.time() - started, 1)
        if stop:
            print(
                f"run_all: bench {name} interrupted ({stop}); writing the figures of the benches that finished",
                file=sys.stderr,
            )
            return name
    return None


def main(argv: list[str]) -> int:
    from tasks.fsutil import atomic_write_json

    flags = {a for a in argv if a.startswith("--")}
    if flags - {"--force", "--docs"}:
        print(
            f"run_all: unknown option {sorted(flags - {'--force', '--docs'})[0]}; use --force or --docs",
            file=sys.stderr,
        )
        return 2
    if "--docs" in flags:
        others = sorted(flags - {"--docs"}) + [a for a in argv if not a.startswith("--")]
        if others:  # --docs runs nothing: a bench name or --force beside it would be ignored without a word
            print(
                f"run_all: --docs runs no bench, {others[0]} does nothing beside it; use --docs alone, or run the "
                "benches without --docs (that rewrites the docs too)",
                file=sys.stderr,
            )
            return 2
        write_outputs(json.loads(RESULTS.read_text()))
        print(f"rewrote {RESULTS_MD} and the figures block of {DOCS} from {RESULTS}")
        return 0
    argv = [a for a in argv if not a.startswith("--")]
    # The data bench first (its peak RSS counts this process and its workers): a model bench before it grows the heap
    # (the full run at dd4dbf7 ran checkpoint first and reported 520–574 MB for a build that peaks at 164–232 MB).
    first_data = lambda name: (name != "data", name)  # noqa: E731
    everything = sorted((p.stem[len("bench_") :] for p in HERE.glob("bench_*.py")), key=first_data)
    names = sorted(set(argv), key=first_data) if argv else everything
    unknown = [n for n in names if n not in everything]
    if unknown:
        print(f"run_all: no bench/bench_{unknown[0]}.py; choose from {', '.join(everything)}", file=sys.stderr)
        return 2
    fresh, stamps, errors, timings = {}, {}, {}, {}
    base = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit()}
    interrupted = None
    # SIGTERM (a CI job cancelled, `timeout` late in `make bench`) as Ctrl-C: what finished is written, not lost
    on_term = signal.signal(signal.SIGTERM, _terminated) if _main_thread() else None
    try:
        interrupted = _run_benches(names, base, fresh, stamps, errors, timings)
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
    # Read now, not at the start: another partial run that finished meanwhile keeps its figures.
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    kept = {}
    for name in list(fresh):
        old = None if stamps[name]["deterministic"] else quieter_kept(previous, name, stamps[name]["load"])
        if old is not None and "--force" not in flags:
            kept[name] = (
                f"this run's {load_label(stamps[name]['load'])}; kept the figures of {old['date']} "
                f"({old.get('commit')}, {load_label(old['load'])}); rerun on a quieter host or pass --force"
            )
            print(f"run_all: bench {name}: {kept[name]}", file=sys.stderr)
            del fresh[name]
    if not argv:  # a full run: figures no current bench produces are stale
        prov = previous.get("provenance") or _legacy_provenance(previous)
        gone = [k for k in previous.get("figures", {}) if (prov.get(k) or {}).get("bench") not in everything]
        for k in gone:
            previous["figures"].pop(k)
            prov.pop(k, None)
        previous["provenance"] = prov
    figures, prov = merge(previous, fresh, stamps)
    doc = {
        "figures": figures,
        "provenance": prov,
        "refreshed": sorted(fresh),
        "kept": kept,
        "errors": errors,
        # only the benches whose figures were taken: a kept (loaded) or failed run leaves the recorded ones as they were
        "seconds": {**previous.get("seconds", {}), **{k: v for k, v in timings.items() if k in fresh}},
        "date": base["date"] if fresh else previous.get("date", base["date"]),
        "machine": base["machine"] if fresh else previous.get("machine", base["machine"]),
    }
    atomic_write_json(RESULTS, doc)
    # Rendered from the file as written (its keys sorted), as `--docs` and tests/test_bench_results.py render it: a
    # dict figure fresh from a bench keeps its insertion order in memory ({4mb, 8mb, 16mb}), not the file's.
    write_outputs(json.loads(RESULTS.read_text()))
    print(f"\nwrote {RESULTS}, {RESULTS_MD} and {DOCS}'s figures (refreshed: {', '.join(sorted(fresh)) or 'none'})")
    if interrupted:
        return 130  # as a shell reports Ctrl-C: the run did not finish
    return 1 if errors else 3 if kept else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
