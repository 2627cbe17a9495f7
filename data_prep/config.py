"""ShardConfig: the sharding stage's own settings (tasks/stages/shard.py maps PipelineConfig.data onto it)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from data_prep.errors import DataPrepError

# Fields that do not change the bytes written, so they stay out of the cache key.
_NOT_IN_KEY = {"inputs", "out_dir", "tokenizer", "tokenize_processes", "progress"}


@dataclass
class ShardConfig:
    inputs: list = field(default_factory=lambda: ["stdlib"])  # files, dirs, globs; "stdlib" = Python's own sources
    out_dir: str = "var/data"
    text_field: str = "text"              # .jsonl key / .parquet column holding the text
    max_documents: int = 0                # 0 = all (counted after cleaning and de-duplication)
    min_chars: int = 16
    max_chars: int = 1_000_000            # longer documents are skipped (counted), never loaded whole
    on_decode_error: str = "replace"      # replace | skip
    tokenizer: str = "train"              # "train" or a tokenizer.json / model directory
    vocab_size: int = 4096                # for "train"
    eos_token: str = ""                   # "" = from tokenizer_config.json or the usual names
    token_dtype: str = "auto"             # auto (smallest that fits) | uint16 | uint32
    seq_len: int = 256
    val_fraction: float = 0.05
    shard_size_mb: float = 16.0
    shard_multiple: int = 1               # shard count is planned as a multiple of this (dp ranks × loader workers)
    tokenize_processes: int = 2
    progress: bool = True

    def validate(self) -> "ShardConfig":
        problems = []
        if not self.inputs:
            problems.append("inputs: at least one input path is required")
        if self.on_decode_error not in ("replace", "skip"):
            problems.append(f"on_decode_error: {self.on_decode_error!r} is not one of replace, skip")
        if self.token_dtype not in ("auto", "uint16", "uint32"):
            problems.append(f"token_dtype: {self.token_dtype!r} is not one of auto, uint16, uint32")
        checks = [("seq_len", self.seq_len >= 2), ("vocab_size", self.vocab_size >= 256),
                  ("max_chars", self.max_chars >= 1), ("min_chars", 0 <= self.min_chars <= self.max_chars),
                  ("val_fraction", 0.0 <= self.val_fraction < 1.0), ("shard_size_mb", self.shard_size_mb > 0),
                  ("shard_multiple", self.shard_multiple >= 1), ("tokenize_processes", self.tokenize_processes >= 1),
                  ("max_documents", self.max_documents >= 0)]
        problems += [f"{name}: {getattr(self, name)!r} is out of range" for name, ok in checks if not ok]
        if problems:
            raise DataPrepError("; ".join(problems))
        return self

    def key_fields(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in _NOT_IN_KEY}

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.key_fields(), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "ShardConfig":
        """Read a YAML file: either a pipeline preset (its `data:` section is used) or flat ShardConfig keys."""
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as e:
            raise DataPrepError(f"config {path}: cannot read ({e})") from None
        if not isinstance(data, dict):
            raise DataPrepError(f"config {path}: expected a mapping")
        data = data.get("data", data)
        return cls.from_dict({**data, **overrides})

    @classmethod
    def from_dict(cls, values: dict) -> "ShardConfig":
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        # Pipeline-only data keys (loader settings) are allowed in a preset's data: section and ignored here.
        unknown = [k for k in unknown if k not in ("loader_workers", "verify_sha256")]
        if unknown:
            raise DataPrepError(f"unknown shard config keys: {', '.join(unknown)} (known: {', '.join(known)})")
        cfg = cls(**{k: v for k, v in values.items() if k in known})
        if isinstance(cfg.inputs, str):
            cfg.inputs = [cfg.inputs]
        return cfg.validate()
