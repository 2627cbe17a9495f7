"""A model directory (HF format) checked before anything reads it, and the tokenizer identity it carries.

Our exports (tasks/model/hf_export.py from a training checkpoint, hf_io.save_hf) end with `llm-pipeline.json`: every
file's size and sha256, recorded while it was written, and the identity of the tokenizer its embedding rows belong
to (the shard set's, `data_prep.tokenizer.tokenizer_identity`: tokenizer.json and its companion files). `verify()`
holds the directory to it — a shard cut in half, a swapped tokenizer.json or a missing file is one line — and
checks every safetensors header against its file (tasks.model.safetensors_io). A directory saved by transformers
(no manifest) gets the structural checks only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tasks.errors import StageError
from tasks.fsutil import atomic_write_json, sha256_file

MANIFEST = "llm-pipeline.json"
FORMAT = "llm-pipeline-hf/1"
_verified: dict[tuple, None] = {}  # (dir, its files' names, sizes, mtimes) verified by this process


def file_entry(path: str | os.PathLike) -> dict:
    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}


def shard_tokenizer(shard_dir: str | os.PathLike) -> str | None:
    """The tokenizer identity of a directory holding tokenizer.json (a shard set, a tokenizer directory)."""
    from data_prep.tokenizer import tokenizer_identity

    return tokenizer_identity(str(shard_dir)) if (Path(shard_dir) / "tokenizer.json").is_file() else None


def write_manifest(out: str | os.PathLike, files: dict[str, dict], tokenizer_dir: str | os.PathLike | None) -> Path:
    """`files`: name → {bytes, sha256} of the safetensors written (hashed as they were written); every other file
    in `out` (config.json, index, tokenizer files) is hashed here."""
    out = Path(out)
    table = dict(files)
    for p in sorted(out.iterdir()):
        if p.is_file() and p.name != MANIFEST and p.name not in table and not p.name.startswith("."):
            table[p.name] = file_entry(p)
    body = {"format": FORMAT, "files": dict(sorted(table.items()))}
    # The tokenizer the weights were trained with (the shard set's), and the identity of the copy in `out` (with a
    # tokenizer_config.json added for a bare tokenizer.json): a shard set made from either matches.
    source = accepted_tokenizers(tokenizer_dir) if tokenizer_dir is not None else []
    body["tokenizer"] = list(dict.fromkeys([*source, *filter(None, [shard_tokenizer(out)])])) if source else []
    return atomic_write_json(out / MANIFEST, body)


def read_manifest(path: str | os.PathLike) -> dict | None:
    f = Path(path) / MANIFEST
    if not f.is_file():
        return None
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StageError(f"{f} is unreadable ({e}); re-export the model") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("files"), dict):
        raise StageError(f"{f}: not an {FORMAT} manifest; re-export the model")
    return m


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a model directory, its index checked (one StageError line for what is wrong). A directory
    holding both model.safetensors and an index is refused: transformers loads model.safetensors, a reader of the
    index loads the shards, and a save over an earlier one leaves the other stale (save_pretrained, sharded then
    single, keeps the old index; single then sharded keeps the old model.safetensors) — which is current only its
    writer knows."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file() and (path / "model.safetensors").is_file():
        raise StageError(
            f"{path}: holds both model.safetensors and model.safetensors.index.json (a save over an earlier one left "
            "one of them stale; transformers would load model.safetensors, the index names other files); delete "
            "the stale one (or save the model again into an empty directory)"
        )
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StageError(f"{index} is unreadable ({type(e).__name__}: {e}); re-export the model") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise StageError(f"{index}: weight_map is not an object of tensor name → file name; re-export the model")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise StageError(f"{path}: missing shard {missing[0]} listed in model.safetensors.index.json")
        return [path / n for n in names]
    single = path / "model.safetensors"
    if not single.is_file():
        raise StageError(no_weights(path))
    return [single]


def no_weights(path: Path) -> str:
    """The one line for a model directory without safetensors weights (only pytorch_model.bin, say)."""
    bins = sorted(p.name for p in Path(path).glob("*.bin"))
    found = (
        f" (it holds {', '.join(bins[:2])}{', …' if len(bins) > 2 else ''}: pickled weights, never loaded)"
        if bins
        else ""
    )
    return (
        f"{path}: no model.safetensors or model.safetensors.index.json{found}; save the model with transformers' "
        "save_pretrained (safetensors is its default) and point at that directory"
    )


def verify(path: str | os.PathLike) -> None:
    """Raise StageError (one line) unless the model directory is whole: every file our manifest lists has its
    recorded size and sha256, and every safetensors header agrees with its file. Once per process per state."""
    from tasks.model.safetensors_io import read_header

    from tasks.model.hf_config import read_hf_config

    path = Path(path)
    tcfg = read_hf_config(path)  # config.json first: an unsupported architecture is named before any weight is read
    state = (str(path.resolve()), *sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()))
    if state in _verified:
        return
    manifest = read_manifest(path)
    if manifest is not None:
        for name, want in manifest["files"].items():
            f = path / name
            if not f.is_file():
                raise StageError(f"{f} is missing (listed in {MANIFEST}); re-export the model")
            if f.stat().st_size != want["bytes"]:
                raise StageError(
                    f"{f} is truncated or altered ({f.stat().st_size} bytes, {want['bytes']} recorded in "
                    f"{MANIFEST}); re-export the model"
                )
        for name, want in manifest["files"].items():  # sizes first: a cut file is named without hashing the rest
            if sha256_file(path / name) != want["sha256"]:
                what = f"sha256 differs from the one recorded in {MANIFEST}"
                raise StageError(f"{path / name} is corrupt ({what}); re-export the model")
    for f in safetensors_files(path):
        read_header(f)
    check_tensor_names(path, tcfg)
    _verified[state] = None


def check_tensor_names(path: str | os.PathLike, tcfg) -> None:
    """StageError (one line) when the checkpoint holds a tensor a model of its config.json would not read (index
    names, or the single file's header): its weights would be dropped in silence (transformers loads such a file
    too, listing the keys UNEXPECTED in its load report)."""
    from tasks.model.hf_config import unused_tensors
    from tasks.model.safetensors_io import read_header

    path = Path(path)
    files = safetensors_files(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    else:
        names = read_header(files[0])
    if tcfg.tie_embeddings and {"lm_head.weight", "model.embed_tokens.weight"} <= set(names):
        _check_tied(path, tcfg, {n: path / names[n] if index.is_file() else files[0] for n in names})
    unused = unused_tensors(tcfg, names)
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise StageError(
            f"{path}: tensor {unused[0]!r}{more} is not part of the model its config.json describes (family "
            f"{tcfg.family}, {tcfg.n_layers} layers, q/k/v bias {tcfg.qkv_bias}, {tcfg.n_experts} experts), so its "
            "weights would be dropped; fix config.json to describe the weights (architectures, num_hidden_layers, "
            "the bias settings) or use the checkpoint they belong to"
        )


def _check_tied(path: Path, tcfg, where: dict) -> None:
    """config.json ties the embeddings and the file stores an lm_head.weight too: the same tensor is fine (some
    exporters write both); another one is one line. transformers then keeps lm_head.weight untied ("both are present
    in the checkpoints with different values, so we will NOT tie them"); this model would compute its output with
    the embedding, another model, in silence, and its export would drop lm_head.weight."""
    import torch
    from safetensors import safe_open

    def tensor(name):
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name)

    if not torch.equal(tensor("lm_head.weight"), tensor("model.embed_tokens.weight")):
        raise StageError(
            f"{path}: config.json ties the embeddings (tie_word_embeddings true) but lm_head.weight differs from "
            "model.embed_tokens.weight (transformers then keeps lm_head.weight untied; this model would use the "
            "embedding); set tie_word_embeddings to false in config.json, or use the checkpoint whose weights it "
            "describes"
        )


def accepted_tokenizers(path: str | os.PathLike) -> list[str]:
    """The tokenizer identities a model directory (or a shard set) belongs to: an export's recorded ones, else the
    identity of the tokenizer files it holds ([] when it holds none)."""
    manifest = read_manifest(path) if (Path(path) / MANIFEST).is_file() else None
    if manifest is not None:
        t = manifest.get("tokenizer") or []
        return [t] if isinstance(t, str) else list(t)
    return list(filter(None, [shard_tokenizer(path)]))


def tokenizer_problem(model_dir: str | os.PathLike, shard_dir: str | os.PathLike, what: str) -> str | None:
    """One line when the model in `model_dir` (an export with our manifest: its recorded tokenizer identity) was
    trained on another tokenizer than the shard set's; None when they agree or the export recorded none."""
    manifest = read_manifest(model_dir)
    return identity_problem((manifest or {}).get("tokenizer"), shard_dir, f"{what} {model_dir}")


FIX = "use a shard set built with the model's tokenizer (data.tokenizer=<its export directory>)"


def identity_problem(recorded, shard_dir: str | os.PathLike, what: str, fix: str = FIX) -> str | None:
    """`what` (a checkpoint, an export, a quantized model) recorded tokenizer identity `recorded` (one, or a list of
    equivalent ones); the shard set's must be one of them: the same vocabulary size with other merges maps the same
    ids to other tokens, silently. None when nothing was recorded (older outputs)."""
    recorded = [recorded] if isinstance(recorded, str) else list(recorded or [])
    if not recorded:
        return None
    now = shard_tokenizer(shard_dir)
    if now is None or now in recorded:
        return None
    return (
        f"{what} was trained with tokenizer {recorded[0]}, but the shard set {shard_dir} was made by tokenizer {now}: "
        f"its token ids mean other tokens; {fix}"
    )


class HashingWriter:
    """A binary file opened for writing that hashes what goes through it (an export's sha256 without re-reading)."""

    def __init__(self, path: Path):
        self.f, self.h, self.n = open(path, "wb"), hashlib.sha256(), 0

    def write(self, data) -> None:
        self.f.write(data)
        self.h.update(data)
        self.n += len(memoryview(data).cast("B"))

    def entry(self) -> dict:
        return {"bytes": self.n, "sha256": self.h.hexdigest()}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
