"""The data section of the pipeline configuration, and the pydantic base every configuration section shares.

`DataConfig` is the one data model: `python -m data_prep`, the shard stage (`cfg.data`) and the loader settings read
it (`ShardConfig` is the same class under the name the builder grew up with). It lives here because tasks imports
data_prep and never the reverse; tasks.config builds the other sections on `Section` and reports with `problems()`.

`Section`: unknown keys are refused naming the nearest valid one; text values (YAML, `--set`, JSON) are read as the
field's type first (`"64"` → 64, `"0,1"` → [0, 1]), then pydantic checks types strictly, ranges (`Field(ge/le)`),
enumerations (`Literal`) and cross-field rules (model validators raising `rule_error`). `problems()` turns a
ValidationError into one line per problem: `seq_len: 4 must be in [8, 1048576]`.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from data_prep.errors import DataPrepError


class _Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where `1e-4` (no dot) is a string; YAML 1.2 and every user read it as a float."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def _yaml_or_text(text: str):
    try:
        return yaml_load(text) if text.strip() else text
    except yaml.YAMLError:
        return text


def _kinds(annotation) -> set:
    """The Python types a scalar annotation admits: {int} for int and Literal[0, 1], {str} for Literal["a"]."""
    if typing.get_origin(annotation) is Literal:
        return {type(a) for a in typing.get_args(annotation)}
    return {annotation}


def from_text(value: Any, annotation) -> Any:
    """Read a YAML/JSON/CLI value as `annotation` before pydantic's strict check: a string for a non-string field
    is a YAML scalar (`--set train.steps=5`), a string for a list is YAML (`[1, 2.5]`) or comma-separated items
    (`0,1`), each item read as the item type; a number for a string field is its text; 2.0 for an int is 2."""
    if typing.get_origin(annotation) is list:
        if isinstance(value, str):
            parsed = _yaml_or_text(value)
            value = parsed if isinstance(parsed, list) else [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            return [from_text(v, typing.get_args(annotation)[0]) for v in value]
        return value
    kinds = _kinds(annotation)
    if kinds == {str}:
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if isinstance(value, str):
        value = _yaml_or_text(value)
    if int in kinds and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def rule_error(lines: list[str]) -> PydanticCustomError:
    """A model validator's cross-field problems, one line each, named relative to the model that raises them."""
    return PydanticCustomError("config_rule", "{lines}", {"lines": lines})


class Section(BaseModel):
    """A configuration model: strict types after `from_text`, unknown keys refused, numbers finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _read_text(cls, data):
        if isinstance(data, dict):
            data = {k: from_text(v, cls.model_fields[k].annotation) if k in cls.model_fields else v
                    for k, v in data.items()}
        return data


_TYPE_WORDS = {int: "an integer", float: "a finite number", bool: "true/false", str: "a string", list: "a list"}
_TYPE_ERRORS = {"int_type": int, "int_parsing": int, "int_from_float": int, "float_type": float,
                "float_parsing": float, "finite_number": float, "bool_type": bool, "bool_parsing": bool,
                "string_type": str, "list_type": list}


def _model(annotation):
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _bounds(field) -> dict:
    return {k: getattr(m, k) for m in field.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}


def _range_text(b: dict) -> str:
    lo, hi = b.get("ge", b.get("gt")), b.get("le", b.get("lt"))
    if "ge" in b and "le" in b:
        return f"in [{lo}, {hi}]"
    return " and ".join(f"{op} {b[k]}" for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if k in b)


def problems(err: ValidationError, model: type[BaseModel], data: dict, terse_ranges: bool = False) -> list[str]:
    """One line per problem of `err` (from validating `data` against `model`), named by dotted path.

    Ranges read `x: 0 must be >= 1` / `must be in [lo, hi]` (`terse_ranges`: `is out of range`, data_prep's CLI),
    enumerations `'x' is not one of a, b`, lists of choices as a whole, unknown keys with the nearest valid one."""
    lines: list[str] = []
    for e in err.errors():
        loc, kind, value = e["loc"], e["type"], e.get("input")
        # Walk the models along the path: `owner` holds the field, `field` its FieldInfo, `raw` the data there.
        owner, field, raw, names, index = model, None, data, [], None
        for part in loc:
            if isinstance(part, int):
                index = part
                continue
            if field is not None:
                owner = _model(field.annotation) or owner
            field = owner.model_fields.get(part)
            raw = raw.get(part) if isinstance(raw, dict) else None
            names.append(part)
        path = ".".join(map(str, names))
        where = path + (f"[{index}]" if index is not None else "")
        if kind == "extra_forbidden":
            parent, known = ".".join(names[:-1]), list(owner.model_fields)
            close = difflib.get_close_matches(names[-1], known, n=1, cutoff=0.6)
            hint = f"; did you mean {(parent + '.') if parent else ''}{close[0]}?" if close else ""
            if not parent and any(_model(f.annotation) for f in owner.model_fields.values()):
                sections = [k for k, f in owner.model_fields.items() if _model(f.annotation)]
                for key in (value if isinstance(value, dict) and value else {"": None}):
                    lines.append(f"{path}{'.' + key if key else ''}: unknown section {names[-1]!r}{hint} "
                                 f"(known: {', '.join(sections)})")
            else:
                lines.append(f"{path}: unknown key{hint} (known{' in ' + parent if parent else ''}: "
                             f"{', '.join(known)})")
            continue
        if kind == "config_rule":
            lines += [f"{path}.{line}" if path else line for line in e["ctx"]["lines"]]
            continue
        item_type = typing.get_args(field.annotation)[0] if field is not None and \
            typing.get_origin(field.annotation) is list else None
        choices = typing.get_args(item_type) if typing.get_origin(item_type) is Literal else None
        if choices is not None and (kind == "too_short" or kind == "literal_error"
                                    and isinstance(value, tuple(_kinds(item_type)))):
            whole = from_text(raw, field.annotation)
            lines.append(f"{path}: {whole!r} must be a non-empty list of {', '.join(map(str, choices))}")
            continue
        if kind == "literal_error":
            allowed = typing.get_args(item_type if index is not None else field.annotation)
            expected = {type(a) for a in allowed}
            if isinstance(value, tuple(expected)) and not isinstance(value, bool):
                lines.append(f"{where}: {value!r} is not one of {', '.join(map(str, allowed))}")
                continue
            kind = "int_type" if expected == {int} else "string_type"
        if kind in _TYPE_ERRORS:
            lines.append(f"{where}: expected {_TYPE_WORDS[_TYPE_ERRORS[kind]]}, got {value!r}")
        elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
            lines.append(f"{where}: {value!r} is out of range" if terse_ranges else
                         f"{where}: {value} must be {_range_text(_bounds(field))}")
        elif kind == "too_short":
            lines.append(f"{where}: must not be empty")
        elif kind in ("model_type", "dict_type", "model_attributes_type"):
            lines.append(f"{where}: expected a mapping of keys, got {value!r}")
        else:
            lines.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
    return list(dict.fromkeys(lines))  # items of one list share their line


# Fields that do not change the bytes written, so they stay out of the cache key: where things are, how fast they
# are built, and the loader's own settings.
_NOT_IN_KEY = {"inputs", "out_dir", "tokenizer", "tokenize_processes", "progress", "loader_workers",
               "prefetch_factor", "verify_sha256"}


class DataConfig(Section):
    """Corpus → shards → loader. Where the pipeline's and data_prep's old models disagreed, the stricter bound won:
    seq_len ≥ 8 (a shorter window teaches nothing; ≥ 2 only kept the arithmetic valid), val_fraction ≤ 0.5 (more
    held out than trained on is always a mistake; < 1 only kept one training sample), shard_size_mb ≥ 0.01.
    shard_multiple 0 = automatic: ranks × loader workers in the pipeline (tasks.shard), 1 for data_prep alone."""

    # files, directories, globs; "stdlib" = the Python standard library's own sources (the offline demo corpus)
    inputs: list[str] = Field(default_factory=lambda: ["stdlib"], min_length=1)
    text_field: str = "text"              # .jsonl key / .parquet column holding the text
    out_dir: str = "var/data"             # shard sets are versioned directories below it
    max_documents: int = Field(0, ge=0)   # 0 = all (counted after cleaning and de-duplication)
    min_chars: int = Field(16, ge=0)
    max_chars: int = Field(1_000_000, ge=1)  # longer documents are skipped (counted), never loaded whole
    on_decode_error: Literal["replace", "skip"] = "replace"
    tokenizer: str = "train"              # "train" (byte-level BPE on the corpus) or a tokenizer.json / model dir
    seq_len: int = Field(256, ge=8, le=1 << 20)
    vocab_size: int = Field(4096, ge=256, le=1 << 22)  # for "train"
    val_fraction: float = Field(0.05, ge=0.0, le=0.5)
    shard_size_mb: float = Field(16.0, ge=0.01, le=100_000)
    tokenize_processes: int = Field(2, ge=1, le=256)
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"  # auto: uint16 when the vocabulary fits
    # "" = tokenizer_config.json's eos_token or a usual name (<|endoftext|>, </s>…)
    eos_token: str = ""
    shard_multiple: int = Field(0, ge=0, le=1 << 16)  # shard count is a multiple of this (0: see above)
    loader_workers: int = Field(1, ge=-1, le=64)  # loader processes per rank; -1 = from the rank's cores (max 4)
    prefetch_factor: int = Field(2, ge=1, le=64)  # batches each loader worker keeps ready (DataLoader's)
    verify_sha256: bool = False           # loader checks every shard's sha256 against the manifest before reading
    progress: bool = True                 # a tqdm bar while tokenising

    @model_validator(mode="after")
    def _chars(self):
        if self.min_chars > self.max_chars:
            raise rule_error([f"min_chars: {self.min_chars} exceeds max_chars {self.max_chars}"])
        return self

    def validate(self) -> "DataConfig":  # noqa: D102 (data_prep's check: its own one-line error)
        self.from_dict(self.model_dump())
        return self

    def key_fields(self) -> dict:
        return self.model_dump(exclude=_NOT_IN_KEY)

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.key_fields(), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "DataConfig":
        """Read a YAML file: either a pipeline preset (its `data:` section is used) or flat data keys."""
        try:
            data = yaml_load(Path(path).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as e:
            raise DataPrepError(f"config {path}: cannot read ({e})") from None
        if not isinstance(data, dict):
            raise DataPrepError(f"config {path}: expected a mapping")
        return cls.from_dict({**data.get("data", data), **overrides})

    @classmethod
    def from_dict(cls, values: dict) -> "DataConfig":
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise DataPrepError("; ".join(problems(e, cls, values, terse_ranges=True))) from None


ShardConfig = DataConfig  # the builder's name for it (data_prep.build, tests, benchmarks)
