"""Stage `shard`: corpus → byte-level BPE (or a given tokenizer) → packed windows → WebDataset shard set.

The work is data_prep.build_shard_set (also `python -m data_prep shard`); this module maps PipelineConfig.data
onto it, logs to MLflow (counters, the manifest and tokenizer as artifacts, the shard set as a dataset input with
the manifest digest) and returns the shard set's path and `asset_uri`, which the DAG emits as an Airflow Asset.
"""
from __future__ import annotations

import warnings

from tasks import tracking
from tasks.config import PipelineConfig, repo_path
from tasks.errors import StageError


def _inputs(paths: list[str]) -> list[str]:
    return [p if p == "stdlib" else str(repo_path(p)) for p in paths]


def shard_multiple(cfg: PipelineConfig) -> int:
    """Readers per epoch = ranks × loader workers: the shard count is planned as a multiple of it."""
    if cfg.data.shard_multiple:
        return cfg.data.shard_multiple
    nproc = cfg.hardware.nproc_per_node
    if not nproc:
        from tasks.device import detect

        nproc = detect(cfg.hardware.device).device_count
    workers = cfg.data.loader_workers if cfg.data.loader_workers >= 0 else 4  # -1: sized per rank, at most 4
    return max(1, nproc * cfg.hardware.nnodes) * max(1, workers)


def shard_config(cfg: PipelineConfig):
    from data_prep.config import ShardConfig

    d = cfg.data
    tokenizer = d.tokenizer if d.tokenizer == "train" else str(repo_path(d.tokenizer))
    return ShardConfig(inputs=_inputs(d.inputs), out_dir=str(repo_path(d.out_dir)), text_field=d.text_field,
                       max_documents=d.max_documents, min_chars=d.min_chars, max_chars=d.max_chars,
                       on_decode_error=d.on_decode_error, tokenizer=tokenizer, vocab_size=d.vocab_size,
                       eos_token=d.eos_token, token_dtype=d.token_dtype, seq_len=d.seq_len,
                       val_fraction=d.val_fraction, shard_size_mb=d.shard_size_mb, shard_multiple=shard_multiple(cfg),
                       tokenize_processes=d.tokenize_processes)


def _log_dataset(result) -> None:
    """The shard set as an MLflow dataset input: name = version, digest = manifest sha256 (MLflow keeps 36 chars)."""
    if not tracking.is_rank0() or tracking.active_run_id() is None:
        return
    import mlflow
    import numpy as np
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types.schema import Schema, TensorSpec

    m = result.manifest
    with warnings.catch_warnings():  # the local artifact source is registered twice ("file" and ""): same class
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(result.shard_dir.as_uri())
    schema = Schema([TensorSpec(np.dtype(m["dtype"]), (-1, m["sample_tokens"]), "tokens")])
    dataset = MetaDataset(source=source, name=m["version"], digest=result.digest[:32], schema=schema)
    mlflow.log_input(dataset, context="training", tags={"manifest_sha256": result.digest})


def run(cfg: PipelineConfig, ctx) -> dict:
    from data_prep.build import build_shard_set
    from data_prep.errors import DataPrepError

    scfg = shard_config(cfg)
    try:
        result = build_shard_set(scfg)
    except DataPrepError as e:
        raise StageError(f"shard: {e}") from None
    m, stats = result.manifest, result.manifest["stats"]
    splits = m["splits"]
    n_shards = sum(len(s["shards"]) for s in splits.values())
    n_bytes = sum(e["bytes"] for s in splits.values() for e in s["shards"])
    tracking.log_params({"shard.version": m["version"], "shard.manifest_sha256": result.digest,
                         "shard.dtype": m["dtype"], "shard.vocab_size": m["vocab_size"],
                         "shard.shard_multiple": m["shard_multiple"], "shard.inputs": ",".join(scfg.inputs)})
    metrics = {**{f"shard.{k}": v for k, v in stats.items()}, "shard.tokens": result.tokens,
               "shard.shards": n_shards, "shard.bytes": n_bytes, "shard.cache_hit": int(result.cache_hit),
               "shard.seconds": result.seconds, **{f"shard.{s}_samples": v["samples"] for s, v in splits.items()}}
    if not result.cache_hit:
        metrics.update({"shard.tokens_per_s": result.tokens_per_s, "shard.tokenizer_seconds": result.tokenizer_seconds})
    tracking.log_metrics(metrics)
    tracking.log_artifact(result.shard_dir / "manifest.json", "shards")
    tracking.log_artifact(result.shard_dir / "tokenizer.json", "shards")
    _log_dataset(result)
    how = "cache hit" if result.cache_hit else f"{result.tokens_per_s:,.0f} tokens/s"
    summary = (f"{splits['train']['samples']} train + {splits['val']['samples']} val sequences of {m['seq_len']} "
               f"in {n_shards} shards, {result.tokens / 1e6:.2f}M tokens, vocab {m['vocab_size']} ({how})")
    return {"status": "warn" if m["warnings"] else "ok", "summary": summary, "warnings": m["warnings"],
            "shard_dir": str(result.shard_dir), "manifest": str(result.shard_dir / "manifest.json"),
            "manifest_digest": result.digest, "asset_uri": result.shard_dir.as_uri(), "version": m["version"],
            "cache_hit": result.cache_hit, "seq_len": m["seq_len"], "vocab_size": m["vocab_size"],
            "tokenizer": str(result.shard_dir / "tokenizer.json"), "tokens": result.tokens, "shards": n_shards,
            "train_samples": splits["train"]["samples"], "val_samples": splits["val"]["samples"]}
