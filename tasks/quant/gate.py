"""The INT8 gate, shared by quantize (PTQ, then QAT when PTQ misses it) and evaluate (registration).

Default: the relative drop of the macro-average task accuracy over evaluate.tasks (lm-evaluation-harness, tasks.harness)
of the INT8 model against the unquantized model in quantize.dtype (BF16: what INT8 replaces) — the field guide's
"over 2 % on tasks: QAT". The next-token figures on val tokens (tasks.quant.quality) can be the gate instead.

`Gate` loads the tasks and the reference once and judges any number of INT8 models against it; its record
(`gate.json` beside the PTQ artifact) carries the reference's and the final model's task scores under a key of
everything they depend on, so evaluate reuses them instead of scoring the same models on the same tasks again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

from tasks.errors import StageError

TASK_GATE = "task_accuracy_drop_pct"
GATE_METRICS = {
    TASK_GATE: "macro-average task accuracy drop",
    "accuracy_drop_pct": "relative next-token top-1 accuracy drop",
    "ppl_drop_pct": "relative perplexity rise",
    "greedy_disagreement_pct": "greedy-continuation token disagreement",
}
RECORD = "gate.json"


def relative_drop(ref: float, value: float) -> float:
    """How much lower `value` is than `ref`, in percent of `ref` (negative: higher; 0 when ref is 0)."""
    return (ref - value) / ref * 100.0 if ref else 0.0


def demo_keep(key) -> bool:
    from tasks.quant.inputs import in_part

    return in_part(key, "evaluation")


def write_demo_task(cfg, run_dir: Path, shard_dir: Path) -> Path | None:
    """demo-continuation's task folder in run_dir/tasks (its YAML's path), cut from `shard_dir`'s val split, when
    evaluate.tasks lists it (else None). Reused while the shard set and settings are the same: the shard stage writes
    it, so a val split too small for it stops a run before training (StageError, one line), and evaluate reads it."""
    from tasks.harness import demo_task
    from tasks.quant.inputs import SPLIT_RULE

    if "demo-continuation" not in cfg.evaluate.tasks:
        return None
    rule = f"passages from the evaluation part only: {SPLIT_RULE}"
    out = Path(run_dir) / "tasks" / demo_task.NAME
    return demo_task.write(shard_dir, out, cfg.evaluate.demo_examples, 0, demo_keep, rule)


def check_suite(cfg, run_dir: Path, shard_dir: Path) -> None:
    """evaluate.tasks checked before training (the shard stage): demo-continuation cut from the val split, and any
    other entry loaded as the evaluate stage will load it (an lm-eval name, a YAML, its dataset in the offline cache,
    a metric of evaluate.task_metrics) — all but the fit to the model's context, which needs the model. lm-eval's
    task index (~10 s) is read only when there is such an entry."""
    demo = write_demo_task(cfg, run_dir, shard_dir)
    if cfg.evaluate.num_fewshot or any(entry != "demo-continuation" for entry in cfg.evaluate.tasks):
        _load(cfg, demo)  # evaluate.num_fewshot too: the names it gives, the rows its shots draw from


def _load(cfg, demo: Path | None):
    """evaluate.tasks loaded by the harness (demo-continuation from `demo`, its YAML when listed)."""
    from tasks.harness import suite

    e = cfg.evaluate
    return suite.load(list(e.tasks), demo, e.limit, dict(e.num_fewshot), list(e.task_metrics))


def load_suite(cfg, run_dir: Path, shard_dir: Path, model_dir: Path):
    """evaluate.tasks loaded and checked against the model's context (demo-continuation written first when listed),
    before any model is loaded."""
    from tasks.harness import models, suite

    s = _load(cfg, write_demo_task(cfg, run_dir, shard_dir))
    suite.check_generation(s, models.max_seq_len(model_dir), f"the model {model_dir}")
    return s


def suite_key(s, cfg) -> dict:
    """What task scores depend on besides the model: entries and their files, each leaf task's whole definition
    (task_digest), limit, shots, metrics, lm-eval."""
    from importlib.metadata import version

    from tasks.harness import suite

    files = {}
    for entry, spec in s.specs.items():
        if suite.is_path(spec):
            files[entry] = hashlib.sha256(Path(spec).read_bytes()).hexdigest()
            for t in s.entries[entry]:  # local data files a YAML names (the demo task's JSONL)
                for p in s.data_files.get(t, []):
                    files[f"{t}:{p}"] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    for name, task in s.loaded["tasks"].items():  # a local copy of a hub dataset (dataset_path: /data/mmlu)
        where = getattr(getattr(task, "config", None), "dataset_path", None)
        if isinstance(where, str) and Path(where).is_dir():
            files[f"{name}:{where}"] = _folder_fingerprint(Path(where))
    return {
        "entries": s.entries,
        "files": files,
        "configs": {name: task_digest(task) for name, task in s.loaded["tasks"].items()},
        "limit": s.limit,
        "fewshot": s.fewshot,
        "versions": s.versions,
        "metrics": s.metric,
        "lm_eval": version("lm_eval"),
        "batch_size": cfg.evaluate.batch_size,
    }


def _folder_fingerprint(folder: Path) -> str:
    """A dataset folder's files by relative path, size and mtime (not read: a local MMLU is hundreds of MB; a file
    rewritten gets a new mtime): its data changed, the quantize stage's scores are not reused (only data_files
    were hashed)."""
    h = hashlib.sha256()
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in (".git", ".cache"))  # a clone's metadata, datasets' cache
        for n in sorted(names):
            st = os.stat(os.path.join(root, n))
            h.update(f"{os.path.relpath(os.path.join(root, n), folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def task_digest(task) -> str:
    """A leaf task's definition as lm-eval loaded it (its config with every include merged and shots applied, in a
    canonical form) and the source files of every function it references (`!function utils.x`: the whole file, so
    a helper it calls counts too): any change to what defines the task changes it."""
    sources: dict[str, str] = {}

    def canonical(value):
        if isinstance(value, dict):
            return {str(k): canonical(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [canonical(v) for v in value]
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        if callable(value):
            import inspect

            name = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
            try:
                path = inspect.getsourcefile(value)
            except TypeError:  # a builtin: no source of its own
                path = None
            if path and Path(path).is_file():
                sources[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            return f"<function {name}>"
        return f"<{type(value).__name__}>"  # no memory address: the same definition gives the same digest

    config = canonical(task.config.to_dict(keep_callable=True))
    body = json.dumps({"config": config, "sources": sorted(sources.values())}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def score(model, tokenizer, s, cfg, device, label: str) -> dict:
    """`label`: what the progress lines say is running ("evaluate INT8")."""
    from tasks.harness import suite
    from tasks.harness.lm import ProjectLM

    e = cfg.evaluate
    return suite.score(ProjectLM(model, tokenizer, device, e.batch_size, label=label, log_every=e.log_every), s)


class Gate:
    """evaluate.gate_metric of INT8 models against the reference, measured once."""

    def __init__(self, cfg, run_dir: Path, model_dir: Path, shard_dir: Path, device, suite=None):
        from tasks.harness.models import full_precision, load_tokenizer
        from tasks.quant import inputs, quality

        self.cfg, self.device, self.metric = cfg, device, cfg.evaluate.gate_metric
        self.max_drop, dtype = cfg.evaluate.max_drop_pct, cfg.quantize.dtype
        if self.metric == TASK_GATE:
            self.suite = suite or load_suite(cfg, run_dir, shard_dir, model_dir)
            self.tokenizer = load_tokenizer(model_dir)
        self.ref = full_precision(model_dir, dtype, device)  # NaN/inf weights: one line naming them (load_hf)
        # One batch every judged model's logits are checked on (NaN logits get task scores, the same for every such
        # model: a drop of 0), the reference's first, before any gate figure or QAT.
        if self.metric == TASK_GATE:
            self.probe = inputs.val_part(shard_dir, 1, 1, "calibration")[0][0][0]  # never empty in quantize
        else:
            self.data = quality.eval_data(cfg, shard_dir, self.ref.config.max_seq_len)
            self.probe = self.data.batches[0][0]
        what = f"quantize: the reference model ({dtype.upper()} of {model_dir})"
        if not quality.finite_logits(self.ref, self.probe, device):
            raise StageError(quality.reference_problem(what, dtype))
        if self.metric == TASK_GATE:
            self.ref_figures = score(self.ref, self.tokenizer, self.suite, cfg, device, f"quantize {dtype.upper()}")
        else:
            self.ref_figures = quality.quality(self.ref, self.data, device)
            if not all(math.isfinite(self.ref_figures[k]) for k in ("ppl", "accuracy")):
                ppl = self.ref_figures["ppl"]
                raise StageError(quality.reference_problem(what, dtype, f"its perplexity ({ppl}) and logits"))

    def judge(self, model) -> dict:
        """{"metric", "value", "passed", "figures"}: the INT8 model's figures and its drop against the reference.
        A figure that is not finite (NaN, as from an INT8 model whose logits are) misses the gate, never passes it."""
        from tasks.quant import quality

        finite = quality.finite_logits(model, self.probe, self.device)
        if self.metric == TASK_GATE:
            figures = score(model, self.tokenizer, self.suite, self.cfg, self.device, "quantize INT8")
            value = relative_drop(self.ref_figures["macro"], figures["macro"])
        else:
            figures = quality.quality(model, self.data, self.device)
            drops = quality.drops(self.ref_figures, figures)
            if self.metric not in drops:
                raise StageError(
                    f"evaluate.gate_metric {self.metric}: nothing to measure it on (evaluate.prompts is empty and "
                    "evaluate.agreement_windows is 0); set one, or gate on another metric"
                )
            value = drops[self.metric]
        value = value if finite else float("nan")
        passed = math.isfinite(value) and value <= self.max_drop
        return {"metric": self.metric, "value": value, "passed": passed, "figures": figures}


def record_key(cfg, s, model_dir: Path, quant_dir: Path, kind: str) -> str:
    """Identity of a task measurement: the tasks, the reference (model files, dtype), the INT8 weights, the device."""
    from tasks.fsutil import read_json, sha256_file
    from tasks.quant import inputs
    from tasks.quant.artifact import META, WEIGHTS

    int8 = read_json(Path(quant_dir) / META).get("weights_sha256") or sha256_file(Path(quant_dir) / WEIGHTS)
    body = {
        "suite": suite_key(s, cfg),
        "ref_dtype": cfg.quantize.dtype,
        "model": inputs.fingerprint(model_dir),
        "int8": int8,
        "device": kind,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def reusable_scores(path: Path, key: str) -> dict | None:
    """The reference's and the INT8 model's task scores from quantize's record, when measured on exactly this."""
    from tasks.fsutil import read_json

    try:
        rec = read_json(path)
    except (OSError, ValueError):
        return None
    if rec.get("key") != key or not rec.get("ref_scores") or not rec.get("int8_scores"):
        if path.is_file():
            why = "measured other tasks or models" if rec.get("ref_scores") else "scored no tasks (not a task gate)"
            print(f"note: {path} {why}; scoring the tasks now", file=sys.stderr, flush=True)
        return None
    return {"ref": rec["ref_scores"], "int8": rec["int8_scores"]}
