"""Hugging Face interop: load a local Llama/Qwen2 directory into `Transformer`, export one that `transformers` loads.

Our RoPE uses HF's half-split (rotate_half) layout, so q/k weights map one to one, with no permutation.
Nothing here touches the hub: paths are local directories.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tasks.errors import StageError
from tasks.fsutil import recover_dir, swap_dir
from tasks.model.hf_config import (  # noqa: F401 (re-exported: the HF-facing API of the model package)
    ARCHITECTURES,
    config_from_hf,
    expert_hf_name,
    hf_expert,
    hf_to_ours,
    is_expert_stack,
    ours_to_hf,
    read_hf_config,
    to_hf_config,
)
from tasks.model.init import HFWeights
from tasks.model.model_dir import verify, write_manifest
from tasks.model.transformer import Transformer, build_model, materialize

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
MAX_SHARD_BYTES = 5 * 1024**3


def hf_tensors(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Our parameter → [(HF name, tensor)]: one, or one per expert for a stacked expert weight."""
    if is_expert_stack(name):
        return [(expert_hf_name(name, j), t[j]) for j in range(t.shape[0])]
    return [(ours_to_hf(name), t)]


def load_hf(
    path: str | os.PathLike, device="cpu", dtype: torch.dtype = torch.float32, finite: bool = True
) -> Transformer:
    """A local HF Llama/Qwen2 directory (single or sharded safetensors) → Transformer on `device` in `dtype`.

    One process, whole model: for a sharded model, `materialize(model, device, source=HFWeights(path))` after
    parallelising reads only each rank's slices (tasks.model.init). A weight holding NaN or inf is one StageError
    line naming it (nonfinite_problem: no gate or score can judge such a model); `finite` False skips the check
    (smoke, whose forward hooks name the first layer whose output is not finite)."""
    verify(path)  # sizes + sha256 from our export's manifest, every safetensors header against its file
    source = HFWeights(path)
    model = build_model(source.tcfg, device="meta").to(dtype)
    model = materialize(model, device, source=source)
    bad = nonfinite_weights(model) if finite else []
    if bad:
        raise StageError(nonfinite_problem(path, bad))
    return model


def nonfinite_weights(model: Transformer) -> list[str]:
    """The checkpoint names of the weights holding a NaN or an infinity (tensor by tensor: one bool mask at a time)."""
    bad = []
    for name, t in model.named_parameters():
        if not bool(torch.isfinite(t).all()):
            bad += [hf for hf, piece in hf_tensors(name, t.detach()) if not bool(torch.isfinite(piece).all())]
    return bad


def nonfinite_problem(path: str | os.PathLike, bad: list[str]) -> str:
    """One line for a checkpoint with NaN/inf weights: every gate and score of it is meaningless (NaN logits score
    every model alike: a drop of 0 passes), and fine-tuning it (QAT) only reports a NaN loss."""
    names = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    return (
        f"the model {path} holds NaN or infinite weights ({names}): its logits and perplexity are not finite, so no "
        "gate or score can judge it; the checkpoint is corrupt or its training diverged: re-export it, or use "
        "another (an earlier) checkpoint"
    )


def save_hf(
    model: Transformer,
    path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write config.json + safetensors (sharded above 5 GB) + tokenizer files; replaces `path` atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    tcfg = model.config
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "output.weight" and tcfg.tie_embeddings:
            continue  # HF re-ties lm_head to embed_tokens; storing it twice would duplicate the storage
        t = t.detach().to("cpu", dtype or t.dtype)
        for hf_name, piece in hf_tensors(name, t):
            tensors[hf_name] = piece.contiguous()
    out_dtype = dtype or next(iter(tensors.values())).dtype
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(path)  # a crash mid-swap or mid-write last time: restore the old export, drop temp directories
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write_config(tmp, tcfg, out_dtype, tokenizer_dir)
        _write_safetensors(tensors, tmp, save_file)
        if tokenizer_dir is not None:
            _copy_tokenizer(Path(tokenizer_dir), tmp)
        write_manifest(tmp, {}, tokenizer_dir)
        swap_dir(tmp, path)  # old aside, new in, old deleted: never a moment without an export
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_safetensors(tensors: dict, out: Path, save_file) -> None:
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > MAX_SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def tokenizer_problem(
    hf_dir: str | os.PathLike, shard_dir: str | os.PathLike, what: str = "model.hf_path"
) -> str | None:
    """One line when the checkpoint `hf_dir` belongs to another tokenizer than the shard set: its embedding rows are
    its own tokenizer's ids, so tokens of another tokenizer would index the wrong rows (silently, when they fit).
    Our exports recorded the identity (tasks.model.model_dir); a transformers-saved directory is compared by its
    tokenizer.json — one without it is not compared, and a warning line says so and how to add one."""
    from tokenizers import Tokenizer

    from tasks.model import model_dir

    if model_dir.read_manifest(hf_dir) is not None:
        return model_dir.tokenizer_problem(hf_dir, shard_dir, what)

    own, theirs = Path(hf_dir) / "tokenizer.json", Path(shard_dir) / "tokenizer.json"
    if not own.is_file():
        from tasks.logs import log

        log.warning(
            f"{what} {hf_dir}: has no tokenizer.json, so whether the shard set {shard_dir} was tokenized with the "
            f"checkpoint's own tokenizer was not checked (another tokenizer's ids index the wrong embedding rows "
            f"silently); copy its tokenizer.json into {hf_dir} (transformers' AutoTokenizer.from_pretrained(<its "
            f"tokenizer files>).save_pretrained('{hf_dir}') writes one)"
        )
        return None
    if not theirs.is_file() or own.read_bytes() == theirs.read_bytes():
        return None
    a, b = Tokenizer.from_file(str(own)), Tokenizer.from_file(str(theirs))
    if a.to_str() == b.to_str():  # the same tokenizer, serialised differently
        return None
    return (
        f"{what}: its tokenizer ({a.get_vocab_size()} tokens, {own}) is not the shard set's "
        f"({b.get_vocab_size()} tokens, {theirs}); shard with data.tokenizer={hf_dir} (the checkpoint's own)"
    )


def check_tokenizers(
    model_dir: str | os.PathLike, shard_dir: str | os.PathLike, stage: str, quant_meta=None, quant_dir=None
) -> None:
    """Where a model (and its quantized artifact) meets a shard set: one StageError line unless they share the
    tokenizer (same-size vocabularies of two tokenizers index the embedding silently) and the model's embedding has
    a row for every id of it (vocab_problem)."""
    from tasks.model import model_dir as exports
    from tasks.model.model_dir import identity_problem

    if exports.read_manifest(model_dir) is None and not (Path(model_dir) / "tokenizer.json").is_file():
        raise StageError(  # evaluate reads text with the model's own tokenizer (tasks/harness/models.py)
            f"{stage}: the model {model_dir} has no tokenizer.json, which evaluate reads its text with; copy its "
            f"tokenizer.json into {model_dir} (transformers' AutoTokenizer.from_pretrained(<its tokenizer files>)"
            f".save_pretrained('{model_dir}') writes one)"
        )
    own = Path(model_dir) / "tokenizer.json"
    problem = vocab_problem(model_dir, own, stage, "its tokenizer")  # before anything runs into an IndexError
    problem = problem or tokenizer_problem(model_dir, shard_dir, f"{stage}: the model")
    if problem is None and quant_meta is not None:
        problem = identity_problem(quant_meta.get("tokenizer"), shard_dir, f"{stage}: the quantized model {quant_dir}")
    if problem is None and not own.is_file():  # an export without its tokenizer.json: the shard set's is its own
        problem = vocab_problem(model_dir, Path(shard_dir) / "tokenizer.json", stage, "the shard set's tokenizer")
    if problem:
        raise StageError(problem)


def tokenizer_ids(path: str | os.PathLike) -> int:
    """How many ids the tokenizer.json at `path` can produce: its highest id + 1, added tokens included."""
    from tokenizers import Tokenizer

    return max(Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True).values(), default=-1) + 1


def vocab_problem(model_dir: str | os.PathLike, tokenizer: Path, stage: str, whose: str) -> str | None:
    """One line when `tokenizer` (the model's own tokenizer.json, else the shard set's) produces ids the model's
    embedding has no row for (config.json's vocab_size below its tokens): the first such id is an IndexError deep in
    a forward pass, after quantize has written its model. A larger vocab_size is normal (an embedding padded to a
    multiple, as Qwen2's); None then, or when there is no tokenizer.json to count."""
    if not tokenizer.is_file():
        return None
    vocab, ids = read_hf_config(model_dir).vocab_size, tokenizer_ids(tokenizer)
    if ids <= vocab:
        return None
    return (
        f"{stage}: the model {model_dir} has vocab_size {vocab} (config.json: its embedding rows) but {whose} "
        f"({tokenizer}) has {ids} tokens: ids {vocab}..{ids - 1} index past the embedding; the checkpoint and the "
        f"tokenizer are not a pair: put the tokenizer it was trained with beside it (and shard with it), or use a "
        f"checkpoint whose vocab_size covers this tokenizer"
    )


SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Training-time settings of model.hf_path's config.json that do not change the function its weights compute (this
# model has no dropout and initializes nothing it loads): carried into the export, so a later fine-tune by transformers
# sees the checkpoint's own values, not transformers' defaults.
CARRIED = ("attention_dropout", "initializer_range")


def carried(hf_path: str | os.PathLike | None) -> dict:
    """The CARRIED keys model.hf_path's config.json sets ({} without hf_path or a config.json)."""
    path = Path(hf_path) / "config.json" if hf_path else None
    if path is None or not path.is_file():
        return {}
    hf = json.loads(path.read_text())
    return {k: hf[k] for k in CARRIED if k in hf}


def write_config(out: Path, tcfg, dtype, tokenizer_dir, hf_path=None) -> None:
    """config.json for `tcfg` with the special token ids (and the CARRIED settings), and the generation_config.json,
    of the checkpoint the training started from (`hf_path`) or else of the HF directory the tokenizer came from
    (transformers defaults a Llama without them to bos 1 / eos 2: generate() would not stop at the tokenizer's EOS)."""
    cfg = to_hf_config(tcfg, dtype)
    ids, generation = special_tokens(Path(tokenizer_dir) if tokenizer_dir is not None else None, hf_path)
    cfg.update(ids)
    cfg.update(carried(hf_path))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if generation is not None:
        shutil.copy2(generation, out / "generation_config.json")


def special_tokens(tokenizer_dir: Path | None, hf_path: str | os.PathLike | None = None) -> tuple[dict, Path | None]:
    """(bos/eos/pad ids, generation_config.json or None) for a model trained with this tokenizer: from the
    checkpoint the training started from (`hf_path`, model.hf_path) when it has a config.json, else from the HF
    directory the tokenizer came from (its own, or a shard set's manifest `tokenizer.source`: a cached shard set
    names whichever checkpoint first built it, not necessarily this one), else the shard set's EOS id."""
    if hf_path and (Path(hf_path) / "config.json").is_file():
        home = Path(hf_path)
        shard = {}
    elif tokenizer_dir is None:
        return {}, None
    else:
        home = tokenizer_dir if (tokenizer_dir / "config.json").is_file() else None
        manifest = tokenizer_dir / "manifest.json"
        shard = json.loads(manifest.read_text()) if home is None and manifest.is_file() else {}
        source = (shard.get("tokenizer") or {}).get("source") if isinstance(shard.get("tokenizer"), dict) else None
        if source and (Path(source).parent / "config.json").is_file():
            home = Path(source).parent
    # An id the source leaves null stays null in the export, and a shard set's tokenizer (ours: EOS only) has no BOS
    # or pad: left out, transformers would load its Config class's own (LlamaConfig: BOS 1, some other token here).
    if home is None:
        eos = shard.get("eos_id")
        return ({"bos_token_id": None, "eos_token_id": eos, "pad_token_id": None} if eos is not None else {}), None
    hf = json.loads((home / "config.json").read_text())
    ids = {k: hf[k] for k in SPECIAL_IDS if k in hf}
    generation = home / "generation_config.json"
    return ids, generation if generation.is_file() else None


def _copy_tokenizer(src: Path, out: Path) -> None:
    if not (src / "tokenizer.json").is_file() and not (src / "tokenizer.model").is_file():
        raise StageError(f"save_hf: {src} holds no tokenizer.json or tokenizer.model")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if not (out / "tokenizer_config.json").exists():
        # A bare `tokenizers` file: tell AutoTokenizer which class wraps it, and (from a shard set) its EOS.
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if (src / "manifest.json").is_file():
            eos = json.loads((src / "manifest.json").read_text()).get("eos_token")
            config.update({"eos_token": eos} if eos else {})
        (out / "tokenizer_config.json").write_text(json.dumps(config) + "\n")
