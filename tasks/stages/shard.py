"""Stage `shard`: corpus → byte-level BPE (or a given tokenizer) → packed windows → WebDataset shard set.

The work is data_prep.build_shard_set (also `python -m data_prep shard`); this module maps PipelineConfig.data
onto it, logs to MLflow (counters, the manifest and tokenizer as artifacts, the shard set as a dataset input with
the manifest digest) and returns the shard set's path and `asset_uri`, which the DAG emits as an Airflow Asset.

In the DAGs the build fans out (`tasks.pipeline.shard_step`): prepare → one task per partition → layout → one task
per write range → this stage with `--reduce`, which publishes what those tasks built and names any that is missing
or fails its check. Every step's state lives in the build's directory under data.out_dir, so a step can run on
any worker.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from tasks import tracking
from tasks.config import PipelineConfig, repo_path
from tasks.errors import ConfigError, StageError
from tasks.runner import BUILD_ONLY, data_inputs, differing_value, shard_multiple


def shard_config(cfg: PipelineConfig, check_model: bool = True):
    """cfg.data as data_prep builds it (the same model): paths resolved, the shard multiple decided. With
    `check_model` (every build of a pipeline run's set: this stage, the DAG's `prepare`), model.hf_path is first
    checked against it (check_checkpoint), before anything is tokenized."""
    d = cfg.data
    tokenizer = d.tokenizer if d.tokenizer == "train" else str(repo_path(d.tokenizer))
    if check_model:
        check_checkpoint(cfg, tokenizer)
    return d.model_copy(
        update={
            "inputs": data_inputs(d.inputs),
            "out_dir": str(repo_path(d.out_dir)),
            "tokenizer": tokenizer,
            "shard_multiple": shard_multiple(cfg),
        }
    )


def check_checkpoint(cfg: PipelineConfig, tokenizer: str) -> None:
    """model.hf_path against the set this stage is about to build (`tokenizer`: data.tokenizer resolved), before
    hours of tokenizing: what smoke and train would refuse on the finished set, refused now in their own line —
    the tokenizer not the checkpoint's own (tasks.model.hf_io.tokenizer_problem; `train`, a new BPE, never is), then
    the checkpoint's config.json against the pipeline (tasks.model.resolve.from_pipeline: an unsupported
    architecture or setting, data.seq_len over its max_position_embeddings, a tokenizer larger than its
    embedding), then its weight files as smoke and train find them (tasks.model.model_dir: the index and every file
    it names, each file's header, no tensor config.json does not describe). config.json, the tokenizer files and the
    safetensors headers are read, never the weights."""
    if not cfg.model.hf_path:
        return
    from data_prep.errors import DataPrepError
    from data_prep.tokenizer import tokenizer_file
    from tasks.model.hf_io import tokenizer_problem
    from tasks.model.resolve import from_pipeline

    hf_dir = repo_path(cfg.model.hf_path)
    if tokenizer == "train":
        own = (hf_dir / "tokenizer.json").is_file()
        raise ConfigError(
            "model.hf_path: data.tokenizer is train (a new BPE on the corpus), but the checkpoint's embedding rows "
            "are its own tokenizer's ids; "
            + (
                f"shard with data.tokenizer={cfg.model.hf_path} (the checkpoint's own)"
                if own
                else f"{hf_dir} holds no tokenizer.json: shard with data.tokenizer=<the tokenizer.json it was "
                "trained with, or a directory holding it>"
            )
        )
    try:
        path = tokenizer_file(tokenizer)
    except DataPrepError as e:
        raise StageError(f"shard: {e}") from None
    with tempfile.TemporaryDirectory(prefix="tokenizer-") as tmp:
        home = path.parent
        if path.name != "tokenizer.json":  # tokenizer_problem compares a directory's tokenizer.json
            home = Path(tmp)
            shutil.copyfile(path, home / "tokenizer.json")
        problem = tokenizer_problem(hf_dir, home)
        if problem:
            raise ConfigError(problem)
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(home / "tokenizer.json")).get_vocab_size()  # as smoke counts the set's
    from_pipeline(cfg, vocab_size=vocab)
    from tasks.model.hf_config import read_hf_config
    from tasks.model.model_dir import check_tensor_names, safetensors_files
    from tasks.model.safetensors_io import read_header

    for f in safetensors_files(hf_dir):  # a missing or cut weight file, named before hours of tokenizing
        read_header(f)
    check_tensor_names(hf_dir, read_hf_config(hf_dir))


def add_cli_args(parser) -> None:
    from tasks.runner import add_shard_dir_arg

    add_shard_dir_arg(
        parser,
        "to adopt as it is, instead of sharding (a published set, e.g. an asset event's)",
        "build one from data.inputs",
    )
    parser.add_argument(
        "--manifest-digest",
        default=None,
        metavar="SHA256",
        help="with --shard-dir: the manifest.json sha256 the set must have (a set with another is refused; "
        "without --shard-dir, the flag is)",
    )
    parser.add_argument(
        "--reduce",
        action="store_true",
        help="publish what the DAG's mapped shard tasks built (each step must be done; a missing or bad one is "
        "named); not with --shard-dir",
    )
    parser.add_argument(
        "--publish-only",
        action="store_true",
        help="build and publish the set for any consumer (the llm_data DAG): without the checks a pipeline run makes "
        "on its set (evaluate.tasks loaded as evaluate will: demo-continuation cut from its val split, the others' "
        "YAML, offline dataset and metric); not with --shard-dir",
    )


def check_args(args) -> None:
    """Flags that cannot apply to what this run does, refused in one line each rather than ignored: --manifest-digest
    checks an adopted set only; --reduce and --publish-only build (the DAG's shard task passes reduce only when its
    fan-out ran: tasks.pipeline.stage_args)."""

    adopting = bool(getattr(args, "shard_dir", None))
    want = getattr(args, "manifest_digest", None)
    if want is not None and not adopting:
        raise ConfigError(
            "--manifest-digest checks a set adopted with --shard-dir, and none is given (this run builds a set "
            "from data.inputs); add --shard-dir DIR, or leave --manifest-digest out"
        )
    if want is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", want):
        raise ConfigError(
            f"--manifest-digest {want!r} is not a sha256 (64 hex digits); give the set's whole "
            "manifest.json sha256 (its shard.json's manifest_digest, or sha256sum DIR/manifest.json)"
        )
    if not adopting:
        return
    flags = (("--reduce", "reduce"), ("--publish-only", "publish_only"))
    given = {flag for flag, name in flags if getattr(args, name, False)}
    what = {
        "--reduce": "publishes what the fan-out's shard tasks built",
        "--publish-only": "builds and publishes a set without a pipeline run's checks",
    }
    for flag in what:
        if flag in given:
            raise ConfigError(
                f"{flag} {what[flag]}, and --shard-dir adopts a set as it is (nothing is built); leave {flag} out "
                "to adopt DIR, or --shard-dir out to build"
            )


def _log_dataset(shard_dir, tags: dict | None = None) -> None:
    """The shard set as an MLflow dataset input: name = version, digest = manifest sha256 (MLflow keeps 36 chars)."""
    if not tracking.is_rank0() or tracking.active_run_id() is None:
        return
    import mlflow

    dataset, sha = tracking.shard_set_dataset(shard_dir)
    mlflow.log_input(dataset, context="training", tags={"manifest_sha256": sha, **(tags or {})})


def adopt(cfg: PipelineConfig, ctx) -> dict:
    """Use a published shard set as it is: its manifest digest must equal the one given, and every data.* value set
    explicitly that decides a set's contents must be the set's (check_adopted_config); nothing is rewritten."""
    from data_prep.errors import DataPrepError
    from data_prep.layout import ended_line
    from data_prep.manifest import check_files, digest, load_manifest

    from tasks.runner import flag_path

    shard_dir = flag_path(ctx.args.shard_dir)
    want = getattr(ctx.args, "manifest_digest", None)
    try:
        m = load_manifest(shard_dir)
        sha = digest(shard_dir)
        for split in m["splits"]:
            check_files(shard_dir, m, split)
    except (DataPrepError, OSError) as e:
        raise StageError(f"shard: published shard set {shard_dir} is unusable ({e}); re-run llm_data") from None
    if want and sha != want.lower():
        raise StageError(
            f"shard: published shard set {shard_dir} changed since it was published (manifest "
            f"sha256 {sha[:12]}…, the asset event or --manifest-digest says {want[:12]}…); re-run llm_data to "
            "publish it again"
        )
    check_adopted_config(cfg, shard_dir, m)
    splits = m["splits"]
    tracking.log_params({"shard.version": m["version"], "shard.manifest_sha256": sha, "shard.published": True})
    tracking.log_artifact(shard_dir / "manifest.json", "shards")
    _log_dataset(shard_dir, {"published": "true"})
    check_evaluation_data(cfg, ctx, shard_dir)
    n_shards = sum(len(v["shards"]) for v in splits.values())
    return {
        "status": "ok",
        "warnings": m.get("warnings", []),
        "summary": f"published set {m['version']} (sha256 {sha[:12]}…): {splits['train']['samples']} train + "
        f"{splits['val']['samples']} val sequences of {m['seq_len']}, not re-sharded"
        + (f"; {ended_line(m['source']['ended'])}" if m.get("source", {}).get("ended") else ""),
        "shard_dir": str(shard_dir),
        "manifest": str(shard_dir / "manifest.json"),
        "manifest_digest": sha,
        "asset_uri": shard_dir.as_uri(),
        "version": m["version"],
        "cache_hit": True,
        "published": True,
        "seq_len": m["seq_len"],
        "vocab_size": m["vocab_size"],
        "tokenizer": str(shard_dir / "tokenizer.json"),
        "tokenizer_identity": m["tokenizer"]["identity"],
        "shards": n_shards,
        "train_samples": splits["train"]["samples"],
        "val_samples": splits["val"]["samples"],
    }


def check_adopted_config(cfg: PipelineConfig, shard_dir: Path, manifest: dict) -> None:
    """Every data.* key set explicitly (cfg.explicit: --set, Params, a run directory's remembered values) that decides
    a set's contents must agree with the adopted set's manifest: a different one would otherwise be ignored here and
    refused later (smoke: data.seq_len) or never. A key that only steers a build is refused too; one line each."""

    problems = []
    for dotted in sorted(k for k in cfg.explicit if k.startswith("data.")):
        key = dotted.partition(".")[2]
        if key in BUILD_ONLY:
            problems.append(
                f"{dotted}: steers a build, and --shard-dir adopts {shard_dir} as it is; leave it unset, or build "
                "a new set without --shard-dir"
            )
            continue
        shown = differing_value(cfg, key, manifest)
        if shown:
            problems.append(
                f"{dotted}: {shown[0]} differs from the adopted shard set's {shown[1]} ({shard_dir}); leave it unset "
                "to use the set's, or build a new set with it without --shard-dir"
            )
    if problems:
        raise ConfigError(problems)


def check_evaluation_data(cfg: PipelineConfig, ctx, shard_dir) -> None:
    """evaluate.tasks, checked now rather than after training: demo-continuation is cut from this set's val split (the
    evaluate stage reuses it) and every other entry loaded as evaluate will load it (tasks/quant/gate.check_suite), so
    a split too small for it, a task name lm-eval does not know or a dataset not on disk stops the run here, in
    evaluate's own one line and fix."""
    from tasks.quant.gate import check_suite

    if not getattr(ctx.args, "publish_only", False):
        check_suite(cfg, ctx.run_dir, shard_dir)


def progress():
    """build_shard_set's `report`: a progress line per step (tokenize: partitions, write: shard ranges) at its
    first and last item, every tenth of it, and every 30 s."""
    from tasks.logs import Progress

    bars: dict[str, Progress] = {}

    def report(step: str, done: int, total: int) -> None:
        unit = "partition" if step == "tokenize" else "range"
        bars.setdefault(step, Progress(f"shard {step}", total, unit, every=max(1, total // 10))).update(done)

    return report


def _unused_vocab_size(cfg: PipelineConfig, vocab: int) -> list[str]:
    """data.vocab_size sizes only a BPE trained on the corpus: set explicitly (--set, the DAG's Param) beside a given
    tokenizer it would be ignored without a word."""
    if cfg.data.tokenizer == "train" or "data.vocab_size" not in cfg.explicit:
        return []
    return [
        f"data.vocab_size {cfg.data.vocab_size} is not used: the given tokenizer (data.tokenizer) keeps its own "
        f"vocabulary of {vocab} tokens; unset data.vocab_size (it sizes only a BPE trained on the corpus)"
    ]


def run(cfg: PipelineConfig, ctx) -> dict:
    from data_prep.build import build_shard_set
    from data_prep.errors import DataPrepError
    from data_prep.layout import ended_line

    check_args(ctx.args)
    if getattr(ctx.args, "shard_dir", None):
        return adopt(cfg, ctx)
    scfg = shard_config(cfg, check_model=not getattr(ctx.args, "publish_only", False))
    try:
        result = build_shard_set(scfg, reduce_only=getattr(ctx.args, "reduce", False), report=progress())
    except DataPrepError as e:
        raise StageError(f"shard: {e}") from None
    m, stats = result.manifest, result.manifest["stats"]
    splits = m["splits"]
    n_shards = sum(len(s["shards"]) for s in splits.values())
    n_bytes = sum(e["bytes"] for s in splits.values() for e in s["shards"])
    tracking.log_params(
        {
            "shard.version": m["version"],
            "shard.manifest_sha256": result.digest,
            "shard.dtype": m["dtype"],
            "shard.vocab_size": m["vocab_size"],
            "shard.shard_multiple": m["shard_multiple"],
            "shard.inputs": ",".join(scfg.inputs),
            "shard.tokenizer_identity": m["tokenizer"]["identity"],
        }
    )
    metrics = {
        **{f"shard.{k}": v for k, v in stats.items()},
        "shard.tokens": result.tokens,
        "shard.shards": n_shards,
        "shard.bytes": n_bytes,
        "shard.cache_hit": int(result.cache_hit),
        "shard.seconds": result.seconds,
        **{f"shard.{s}_samples": v["samples"] for s, v in splits.items()},
    }
    if not result.cache_hit:
        metrics.update(
            {
                "shard.tokens_per_s": result.tokens_per_s,
                "shard.tokenizer_seconds": result.tokenizer_seconds,
                "shard.partitions": result.partitions,
            }
        )
    tracking.log_metrics(metrics)
    tracking.log_artifact(result.shard_dir / "manifest.json", "shards")
    tracking.log_artifact(result.shard_dir / "tokenizer.json", "shards")
    _log_dataset(result.shard_dir)
    check_evaluation_data(cfg, ctx, result.shard_dir)
    how = "cache hit" if result.cache_hit else f"{result.tokens_per_s:,.0f} tokens/s"
    summary = (
        f"{splits['train']['samples']} train + {splits['val']['samples']} val sequences of {m['seq_len']} "
        f"in {n_shards} shards, {result.tokens / 1e6:.2f}M tokens, vocab {m['vocab_size']} ({how})"
    )
    if ended := m["source"].get("ended"):
        summary += f"; {ended_line(ended)}"
    unused = _unused_vocab_size(cfg, m["vocab_size"])
    for w in unused:  # the build logged its own warnings as it went; this one is the stage's
        print(f"warning: {w}", file=sys.stderr, flush=True)
    warnings = m["warnings"] + unused
    return {
        "status": "warn" if warnings else "ok",
        "summary": summary,
        "warnings": warnings,
        "shard_dir": str(result.shard_dir),
        "manifest": str(result.shard_dir / "manifest.json"),
        "manifest_digest": result.digest,
        "asset_uri": result.shard_dir.as_uri(),
        "version": m["version"],
        "cache_hit": result.cache_hit,
        "seq_len": m["seq_len"],
        "vocab_size": m["vocab_size"],
        "tokenizer": str(result.shard_dir / "tokenizer.json"),
        "tokens": result.tokens,
        "shards": n_shards,
        "partitions": result.partitions,
        "tokenizer_identity": m["tokenizer"]["identity"],
        "train_samples": splits["train"]["samples"],
        "val_samples": splits["val"]["samples"],
    }
