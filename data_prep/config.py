"""`DataConfig`, the one data model (`python -m data_prep`, the shard stage's `cfg.data`, the loader settings;
`ShardConfig` is the builder's name for it), and `Section`, the pydantic base of every configuration section, with
`problems()`, which turns a ValidationError into one line per problem. Here because tasks imports data_prep, never
the reverse: tasks.config builds its sections on the same base."""

from __future__ import annotations

import copy
import difflib
import functools
import hashlib
import json
import os
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


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping with one key twice: PyYAML keeps the last silently; a preset must say which one it means."""


def _mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:  # the mapping's own keys (a `<<` merge's keys may be overridden, as YAML says)
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
            continue
        key = loader.construct_object(key_node)
        if key in seen:
            lines = f"lines {seen[key] + 1} and {key_node.start_mark.line + 1}"
            raise DuplicateKeyError(None, None, f"key {key!r} appears twice ({lines})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.construct_mapping = _mapping


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


@functools.lru_cache(maxsize=64)
def _parsed(text: str):
    """yaml_load of a file's text, kept per text: one process reads the same presets many times (an Airflow task
    process: every load_config of every DAG file and stage, ~90 in one `airflow dags test`; PyYAML's pure-Python
    parse is ~2 ms of a preset's 2.5 ms load). Keyed by the bytes read, not the path or mtime: an edited file is a
    new text, parsed anew. Callers get a deep copy (yaml_mapping), never this object; a text that fails to parse
    raises each time (exceptions are not cached)."""
    return yaml_load(text)


def yaml_mapping(path: str | Path) -> dict:
    """A YAML file's top-level mapping; ValueError in one line (where the YAML breaks, or what it holds instead)."""
    try:
        data = copy.deepcopy(_parsed(Path(path).read_text(encoding="utf-8"))) or {}
    except DuplicateKeyError as e:
        raise ValueError(f"{path}: {e.problem}; keep one (the last would silently win)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ValueError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def _yaml(text: str):
    try:
        return yaml_load(text) if text.strip() else text
    except yaml.YAMLError:
        return text


def _literal(annotation) -> tuple:
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()


def from_text(value: Any, annotation) -> Any:
    """Read a YAML/JSON/CLI value as `annotation` before pydantic's strict check: text for a non-string field is a
    YAML scalar (`"64"` → 64), for a list YAML (`[1, 2.5]`) or comma-separated items (`0,1`), each read as the item
    type; a number for a string field is its text; 2.0 for an int is 2; true for a number stays text. An optional
    field (`int | None`) reads as its type; `null` is None."""
    args = typing.get_args(annotation)
    if type(None) in args and len(args) == 2:
        annotation = next(a for a in args if a is not type(None))
    if typing.get_origin(annotation) is list:
        if isinstance(value, str):
            parsed = _yaml(value)
            if not isinstance(parsed, list):  # comma form: a text item keeps its spaces ("def ,import ")
                text = typing.get_args(annotation)[0] is str
                parsed = [v if text else v.strip() for v in value.split(",") if v.strip()]
            value = parsed
        return [from_text(v, typing.get_args(annotation)[0]) for v in value] if isinstance(value, list) else value
    kinds = {type(a) for a in _literal(annotation)} or {annotation}
    if kinds == {str}:
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if isinstance(value, str):
        parsed = _yaml(value)
        if isinstance(parsed, bool) and bool not in kinds:  # `yes`, `on` as typed: the error echoed 'true'
            return value
        value = parsed
    if isinstance(value, bool) and bool not in kinds:  # True == 1: Literal[0, 1] would take it
        return str(value).lower()
    return int(value) if int in kinds and isinstance(value, float) and value.is_integer() else value


def rule_error(lines: list[str]) -> PydanticCustomError:
    """A model validator's cross-field problems, one line each, named relative to the model that raises them."""
    return PydanticCustomError("config_rule", "{lines}", {"lines": lines})


class Section(BaseModel):
    """A configuration model: values read by `from_text`, then strict types, unknown keys refused, finite numbers."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _read_text(cls, data):
        if not isinstance(data, dict):
            return data
        return {
            k: from_text(v, cls.model_fields[k].annotation) if k in cls.model_fields else v for k, v in data.items()
        }


def _model(annotation):
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


_EXPECTED = {"int": "an integer", "float": "a finite number", "finite": "a finite number", "bool": "true/false"}
_EXPECTED.update(string="a string", list="a list", model="a mapping of keys", dict="a mapping of keys")


def _unknown(owner, names: list[str], value) -> list[str]:
    """An unknown key (or section), with the nearest valid name and the known ones."""
    known, parent = list(owner.model_fields), ".".join(names[:-1])
    close = difflib.get_close_matches(names[-1], known, n=1)
    hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
    sections = [k for k, f in owner.model_fields.items() if _model(f.annotation)]
    if parent or not sections:
        return [f"{'.'.join(names)}: unknown key{hint} (known{' in ' + parent if parent else ''}: {', '.join(known)})"]
    keys = [f".{k}" for k in value] if isinstance(value, dict) and value else [""]
    return [f"{names[0]}{k}: unknown section {names[0]!r}{hint} (known: {', '.join(sections)})" for k in keys]


def _nearest(value, choices) -> str:
    """`; did you mean kubernetes?` for a misspelled string choice ('' when none is close, or not a string)."""
    names = {c.lower(): c for c in choices if isinstance(c, str)}  # BF16 → bf16 too
    close = difflib.get_close_matches(value.lower(), list(names), n=1) if isinstance(value, str) and names else []
    return f"; did you mean {names[close[0]]}?" if close else ""


def _bounds(metadata) -> dict:
    return {k: getattr(m, k) for m in metadata for k in ("ge", "gt", "le", "lt") if getattr(m, k, None) is not None}


def _range(field, item, err: dict) -> str:
    """`in [lo, hi]`, `in (lo, hi]`, `>= lo`, `< hi`…: the field's (or, for a list, its items') bounds."""
    b = _bounds(field.metadata)
    if item is not None and typing.get_origin(item) is typing.Annotated:  # list[Annotated[float, Field(gt=0)]]
        b = _bounds(m for info in typing.get_args(item)[1:] for m in getattr(info, "metadata", [info]))
    b = b or dict(err.get("ctx") or {})
    lo = ("[", b["ge"]) if "ge" in b else ("(", b["gt"]) if "gt" in b else None
    hi = (b["le"], "]") if "le" in b else (b["lt"], ")") if "lt" in b else None
    if lo and hi:
        return f"in {lo[0]}{lo[1]}, {hi[0]}{hi[1]}"
    return f"{'>=' if lo[0] == '[' else '>'} {lo[1]}" if lo else f"{'<=' if hi[1] == ']' else '<'} {hi[0]}"


def problems(err: ValidationError, model: type[BaseModel], data: dict, terse_ranges: bool = False) -> list[str]:
    """One line per problem of `err` (from validating `data` against `model`), named by dotted path: `x: 0 must be
    >= 1` / `in [lo, hi]` (`terse_ranges`: `is out of range`, data_prep's CLI), `'x' is not one of a, b`, a list of
    choices as a whole, `expected an integer, got 'x'`, unknown keys with the nearest valid one."""
    lines = []
    for e in err.errors():
        kind, value = e["type"], e.get("input")
        names = [p for p in e["loc"] if isinstance(p, str)]
        where = ".".join(names) + "".join(f"[{p}]" for p in e["loc"] if isinstance(p, int))
        owner, raw = model, data
        for i, name in enumerate(names[:-1]):
            sub = _model(owner.model_fields[name].annotation) if name in owner.model_fields else None
            if sub is None:  # a mapping field (evaluate.num_fewshot): the rest of the path are its keys
                names = names[: i + 1]
                break
            owner, raw = sub, raw.get(name, {}) if isinstance(raw, dict) else {}
        field = owner.model_fields.get(names[-1]) if names else None
        ann = field.annotation if field else None
        item = typing.get_args(ann)[0] if typing.get_origin(ann) is list else None
        choices = _literal(ann if item is None else item)
        if kind == "config_rule":
            lines += [f"{where}.{line}" if where else line for line in e["ctx"]["lines"]]
        elif kind == "extra_forbidden":
            lines += _unknown(owner, names, value)
        elif choices and (kind == "too_short" or kind == "literal_error" and type(value) is type(choices[0])):
            lines.append(
                f"{'.'.join(names)}: {from_text(raw.get(names[-1]), ann)!r} must be a non-empty list of "
                f"{', '.join(map(str, choices))}"
                if item is not None
                else f"{where}: {value!r} is not one of {', '.join(map(str, choices))}{_nearest(value, choices)}"
            )
        elif kind.startswith(("greater_than", "less_than")):
            shown = f"{value:.6g}" if isinstance(value, int) and abs(value) >= 10**15 else value  # 1e24, not 9999…784
            lines.append(
                f"{where}: {shown!r} is out of range"
                if terse_ranges
                else f"{where}: {shown} must be {_range(field, item, e)}"
            )
        elif kind == "too_short":
            lines.append(f"{where}: must not be empty")
        else:
            expect = ("int" if type(choices[0]) is int else "string") if kind == "literal_error" else kind.split("_")[0]
            lines.append(
                f"{where}: expected {_EXPECTED[expect]}, got {value!r}"
                if expect in _EXPECTED
                else f"{where}: {e['msg'].removeprefix('Value error, ')}"
            )
    return list(dict.fromkeys(lines))  # items of one list share their line


REPO_ROOT = Path(__file__).resolve().parent.parent

# A pipeline config's sections (tasks.config.SECTIONS; data_prep never imports tasks, a test keeps the two equal).
# `python -m data_prep shard --config` reads `data:` and leaves the others to the pipeline.
PIPELINE_SECTIONS = "hardware data model parallel train smoke plan profile quantize evaluate tracking timeouts".split()


def var_dir() -> Path:
    """Where runs, stores and caches live: <repo>/var, or $LLM_PIPELINE_VAR_DIR (tests, shared disks): an absolute
    path (a relative one is refused: read from each process's working directory, it would put runs in two places)."""
    given = os.environ.get("LLM_PIPELINE_VAR_DIR")
    if not given:
        return REPO_ROOT / "var"
    path = Path(given).expanduser()
    if not path.is_absolute():
        raise DataPrepError(
            f"LLM_PIPELINE_VAR_DIR={given} is a relative path (each process would read it from its own working "
            f"directory); give an absolute one, e.g. LLM_PIPELINE_VAR_DIR=$PWD/{given}"
        )
    return path


def repo_path(p: str | os.PathLike) -> Path:
    """A path from a config file: relative ones are relative to the repository root, whatever the working
    directory ("var/…" follows var_dir())."""
    p = Path(p).expanduser()
    if p.is_absolute():
        return p
    if p.parts and p.parts[0] == "var":
        return var_dir().joinpath(*p.parts[1:])
    return REPO_ROOT / p


def default_out_dir() -> Path:
    """Where `python -m data_prep shard` writes without --out/out_dir: the pipeline's `var/data`
    (repo_path(data.out_dir)), i.e. $LLM_PIPELINE_VAR_DIR/data, else <repo>/var/data; never ./var under the working
    directory."""
    return var_dir() / "data"


def repo_input(p: str) -> str:
    """One entry of a config file's `inputs`, read as the pipeline reads it (repo_path; "stdlib" as it is). A relative
    one missing there but present in the working directory (where a user typed it) raises DataPrepError naming
    both, not "does not exist" later."""
    if p == "stdlib":
        return p
    path, here = repo_path(p), Path(p).expanduser()
    if here.is_absolute():
        return str(path)
    if not any(c in p for c in "*?[") or os.path.lexists(path) or os.path.lexists(here):  # `data[1].txt` named
        if not path.exists() and here.exists():
            raise DataPrepError(
                f"{p} is read from the repository root ({path}, which does not exist), not the working directory; "
                f"give the absolute path {here.resolve()}"
            )
        if path.exists() and here.exists() and path.resolve() != here.resolve():  # the user may mean either
            raise DataPrepError(
                f"{p} is read from the repository root ({path}), and the working directory has its own "
                f"({here.resolve()}); give the absolute path of the one you mean"
            )
    elif _matches(here) and Path.cwd().resolve() != REPO_ROOT.resolve():  # a glob: the same, for what it matches
        there = _matches(path)
        which = "matches files there too" if there else "matches nothing"
        raise DataPrepError(
            f"{p} is read from the repository root ({path}, which {which}), not the working directory; give the "
            f"absolute pattern {Path.cwd() / here}" + (f" or {path}" if there else "")
        )
    return str(path)


def _matches(pattern: Path) -> bool:
    """The glob matches something (pathlib's: `**` does not follow symlinked directories)."""
    parts = pattern.parts
    fixed = next(i for i, part in enumerate(parts + ("*",)) if any(c in part for c in "*?["))
    root = Path(*parts[:fixed]) if fixed else Path(".")
    try:
        return root.is_dir() and next(root.glob("/".join(parts[fixed:])), None) is not None
    except (OSError, ValueError):  # an unreadable directory, a pattern pathlib refuses: the reader names it
        return False


def config_paths(values: dict, source: str) -> dict:
    """The paths a config file gives (`inputs`, `out_dir`, `tokenizer`) read as the pipeline reads that file:
    relative to the repository (repo_path), so that one preset names the same corpus in `python -m data_prep shard
    --config` and in `python -m tasks shard`."""
    out = dict(values)
    if isinstance(out.get("inputs"), list):
        try:  # a wrong type or a blank entry is left for the model to name
            out["inputs"] = [repo_input(p) if isinstance(p, str) and p.strip() else p for p in out["inputs"]]
        except DataPrepError as e:
            raise DataPrepError(f"{source}: inputs: {e} (or pass it with --input)") from None
    for key in ("out_dir", "tokenizer"):
        v = out.get(key)
        if isinstance(v, str) and v.strip() and not (key == "tokenizer" and v == "train"):
            out[key] = str(repo_path(v))
    return out


# Fields that do not change the bytes written, so they stay out of the cache key: where things are, how fast they
# are built, and the loader's own settings.
# `partitions` too: the shard set is the same bytes however many partitions (and workers) built it.
_NOT_IN_KEY = set(
    "inputs out_dir tokenizer tokenize_processes partitions progress loader_workers prefetch_factor "
    "verify_sha256".split()
)

# The smallest BPE data_prep.tokenizer.train_bpe honours: it starts from every byte (tokenizers'
# pre_tokenizers.ByteLevel.alphabet()) and its special tokens (the end-of-document token), before any merge, and a
# smaller vocab_size still gets them all (256 trained 257 tokens). tests/test_silent_config_leftovers.py holds the two
# to the trainer.
BPE_BYTE_ALPHABET = 256
BPE_SPECIAL_TOKENS = 1
MIN_BPE_VOCAB = BPE_BYTE_ALPHABET + BPE_SPECIAL_TOKENS


class DataConfig(Section):
    """Corpus → shards → loader. Where the pipeline's and data_prep's old models disagreed, the stricter bound won:
    seq_len ≥ 8 (a shorter window teaches nothing; ≥ 2 only kept the arithmetic valid), val_fraction ≤ 0.5 (more
    held out than trained on is always a mistake; < 1 only kept one training sample), shard_size_mb ≥ 0.01.
    shard_multiple 0 = automatic: ranks × loader workers in the pipeline (tasks.shard), 1 for data_prep alone."""

    # files, directories, globs; "stdlib" = the Python standard library's own sources (the offline demo corpus)
    inputs: list[str] = Field(default_factory=lambda: ["stdlib"], min_length=1)
    text_field: str = "text"  # .jsonl key / .parquet column holding the text
    out_dir: str = "var/data"  # shard sets are versioned directories below it
    max_documents: int = Field(0, ge=0, le=10**12)  # 0 = all (counted after cleaning and de-duplication)
    min_chars: int = Field(16, ge=0, le=10**9)
    max_chars: int = Field(1_000_000, ge=1, le=10**10)  # longer documents are skipped (counted), never loaded whole
    on_decode_error: Literal["replace", "skip"] = "replace"
    tokenizer: str = "train"  # "train" (byte-level BPE on the corpus) or a tokenizer.json / model dir
    seq_len: int = Field(256, ge=8, le=1 << 20)
    vocab_size: int = Field(4096, ge=MIN_BPE_VOCAB, le=1 << 22)  # for "train" (fewer merges in the corpus: warned)
    val_fraction: float = Field(0.05, ge=0.0, le=0.5)
    shard_size_mb: float = Field(16.0, ge=0.01, le=100_000)
    tokenize_processes: int = Field(2, ge=1, le=256)  # tokenizer threads of a builder (one per core)
    # Units of work of one build (files, size-balanced): the data DAG maps one task per partition. 0 = one per
    # 128 MB of input (at most one per file). Never changes the bytes written.
    partitions: int = Field(0, ge=0, le=4096)
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"  # auto: uint16 when the vocabulary fits
    # "" = tokenizer_config.json's eos_token or a usual name (<|endoftext|>, </s>…)
    eos_token: str = ""
    shard_multiple: int = Field(0, ge=0, le=1 << 16)  # shard count is a multiple of this (0: see above)
    loader_workers: int = Field(1, ge=-1, le=64)  # loader processes per rank; -1 = from the rank's cores (max 4)
    prefetch_factor: int = Field(2, ge=1, le=64)  # batches each loader worker keeps ready (DataLoader's)
    verify_sha256: bool = False  # loader checks every shard's sha256 against the manifest before reading
    progress: bool = True  # a tqdm bar while tokenising

    @model_validator(mode="after")
    def _chars(self):
        lines = []
        if self.min_chars > self.max_chars:
            lines.append(f"min_chars: {self.min_chars} exceeds max_chars {self.max_chars}")
        # A blank path is the working directory (or, in the pipeline, the repository root): a walk of whatever is
        # there, shard sets written into it. Refused, never read as a place.
        if any(not str(i).strip() for i in self.inputs):
            lines.append(f"inputs: {self.inputs!r} has a blank entry; give files, directories, globs or 'stdlib'")
        for key in ("out_dir", "tokenizer"):
            if not getattr(self, key).strip():
                what = "a directory" if key == "out_dir" else "'train' or a tokenizer.json / model directory"
                lines.append(f"{key}: blank; give {what}")
        if lines:
            raise rule_error(lines)
        return self

    def validate(self) -> "DataConfig":  # noqa: D102 (data_prep's check: its own one-line error)
        self.from_dict(self.model_dump())
        return self

    def key_fields(self) -> dict:
        """The settings that shape a set's bytes (what job.json and the manifest record). vocab_size sizes only a BPE
        trained on the corpus: beside a given tokenizer it changes no byte, so it is left out (a build's later steps
        read their config from these fields: kept, it changed the layout's seed and the version)."""
        exclude = _NOT_IN_KEY | ({"vocab_size"} if self.tokenizer != "train" else set())
        return self.model_dump(exclude=exclude)

    def config_hash(self) -> str:
        """The build key's and the version's config part (and the layout's seed)."""
        return hashlib.sha256(json.dumps(self.key_fields(), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def yaml_values(cls, path: str | Path) -> dict:
        """A YAML file's data keys: a pipeline config's `data:` section (the file has one of PIPELINE_SECTIONS; the
        other sections are the pipeline's, not read here) or, with none, flat data keys. In a pipeline config a key
        that is no section (a data key beside `data:`, a misspelt section) is refused: it would be ignored."""
        try:
            data = yaml_mapping(path)
        except OSError as e:
            raise DataPrepError(f"config {path}: cannot read ({e.strerror})") from None
        except ValueError as e:
            raise DataPrepError(f"config {e}") from None
        sections = [k for k in data if k in PIPELINE_SECTIONS]
        if not sections:
            return data  # flat keys: the model refuses unknown ones
        lines = []
        for key in (k for k in data if k not in PIPELINE_SECTIONS):
            if key in cls.model_fields:
                beside = "the data: section" if "data" in data else f"the sections {', '.join(sections)}"
                lines.append(f"{key}: a data key beside {beside}; move it under data:")
            else:
                close = difflib.get_close_matches(str(key), PIPELINE_SECTIONS, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                lines.append(
                    f"{key}: unknown section{hint} (a pipeline config's sections: {', '.join(PIPELINE_SECTIONS)}; "
                    "data_prep reads data:)"
                )
        if lines:
            raise DataPrepError(f"config {path}: {'; '.join(lines)}")
        section = data.get("data", {})
        if not isinstance(section, dict):
            raise DataPrepError(f"config {path}: data: expected a mapping of keys, got {section!r}")
        return section

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "DataConfig":
        """Read a YAML file (see yaml_values: a pipeline config's `data:` section or flat data keys)."""
        return cls.from_dict({**cls.yaml_values(path), **overrides})

    @classmethod
    def from_dict(cls, values: dict) -> "DataConfig":
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise DataPrepError("; ".join(problems(e, cls, values, terse_ranges=True))) from None


ShardConfig = DataConfig  # the builder's name for it (data_prep.build, tests, benchmarks)
