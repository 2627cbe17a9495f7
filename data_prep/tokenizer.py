"""Tokenizer: train a byte-level BPE on the corpus, or load a tokenizer.json / model directory; encode in parallel.

Encoding runs in `processes` spawned workers, each fed bounded batches (at most 2 in flight per worker), so memory
stays flat however large the corpus, and results come back in submission order, so the token stream (and the shards)
do not depend on the number of processes.
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data_prep.errors import DataPrepError
from data_prep.workers import die_with_parent, spawn_without_main

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def train_bpe(texts: Iterable[str], vocab_size: int, eos_token: str = "<|endoftext|>") -> Tokenizer:
    """Byte-level BPE (GPT-2 style): every byte is representable, so no text is ever <unk>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_file(spec: str) -> Path:
    """A tokenizer.json, or a model directory holding one (e.g. a local Qwen/Llama checkpoint)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataPrepError(
            f"tokenizer {spec}: no tokenizer.json found (give a tokenizer.json, a model directory "
            f"holding one, or 'train')"
        )
    return path


def load_tokenizer(spec: str) -> Tokenizer:
    path = tokenizer_file(spec)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise DataPrepError(f"tokenizer {path}: cannot be loaded ({str(e).splitlines()[0]})") from None


# Files a model directory keeps beside tokenizer.json (EOS/BOS, special tokens, chat template): the shard set keeps
# them with it, so an HF export of a model trained on the shard set carries the tokenizer as it was given.
COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


def tokenizer_companions(spec: str) -> list[Path]:
    """The companion files beside a given tokenizer.json (none for "train" or a tokenizer file named otherwise)."""
    if spec == "train":
        return []
    path = tokenizer_file(spec)
    if path.name != "tokenizer.json":
        return []
    return [path.parent / name for name in COMPANION_FILES if (path.parent / name).is_file()]


def tokenizer_identity(spec: str) -> str:
    """What the cache key uses: "train" (the result is a function of corpus + config) or the sha256 of the file
    (and of its companion files: tokenizer_config.json's eos_token shapes the token stream)."""
    if spec == "train":
        return "train"
    h = hashlib.sha256(tokenizer_file(spec).read_bytes())
    for f in tokenizer_companions(spec):
        h.update(f"\0{f.name}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def find_eos(tok: Tokenizer, spec: str, eos_token: str = "") -> tuple[str, int]:
    """EOS: the configured token, else tokenizer_config.json's eos_token beside the tokenizer, else a usual name."""
    names = [eos_token] if eos_token else []
    if not eos_token and spec != "train":
        cfg_path = tokenizer_file(spec).parent / "tokenizer_config.json"
        if cfg_path.is_file():
            value = json.loads(cfg_path.read_text(encoding="utf-8")).get("eos_token")
            value = value.get("content") if isinstance(value, dict) else value
            names += [value] if isinstance(value, str) else []
    names += [] if eos_token else list(EOS_CANDIDATES)
    for name in names:
        if (tid := tok.token_to_id(name)) is not None:
            return name, tid
    raise DataPrepError(f"tokenizer has no end-of-document token (tried {', '.join(names)}); set data.eos_token")


def token_dtype(vocab_size: int, requested: str = "auto") -> np.dtype:
    """The smallest unsigned type holding every id; a configured dtype that is too small is an error."""
    fits16 = vocab_size <= 1 << 16
    if requested == "auto":
        return np.dtype(np.uint16 if fits16 else np.uint32)
    if requested == "uint16" and not fits16:
        raise DataPrepError(
            f"tokenizer vocabulary {vocab_size} does not fit token_dtype uint16 (max 65536 ids); "
            f"use token_dtype auto or uint32"
        )
    return np.dtype(DTYPES[requested])


# --- encoding --------------------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(parent_pid: int, tokenizer_json: str, eos_id: int, dtype: str) -> None:
    die_with_parent(parent_pid)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the processes are the parallelism
    _WORKER.update(tok=Tokenizer.from_str(tokenizer_json), eos=eos_id, dtype=np.dtype(dtype))


def encode_docs(tok: Tokenizer, texts: list[str], eos_id: int, dtype: np.dtype) -> np.ndarray:
    """Token ids of the documents, each followed by EOS, as one flat array."""
    ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]  # .ids builds a new list each call
    out = np.empty(sum(map(len, ids)) + len(ids), dtype=dtype)
    pos = 0
    for doc in ids:
        out[pos : pos + len(doc)] = doc
        out[pos + len(doc)] = eos_id
        pos += len(doc) + 1
    return out


def _encode_in_worker(key, texts: list[str]):
    return key, encode_docs(_WORKER["tok"], texts, _WORKER["eos"], _WORKER["dtype"])


def encode_stream(
    tok: Tokenizer, eos_id: int, dtype: np.dtype, batches: Iterable[tuple[object, list[str]]], processes: int
) -> Iterator[tuple[object, np.ndarray]]:
    """(key, texts) batches → (key, ids) in the same order; `processes` > 1 uses spawned workers."""
    if processes <= 1:
        for key, texts in batches:
            yield key, encode_docs(tok, texts, eos_id, dtype)
        return
    # spawn, not fork: the parent may hold threads (MLflow, rayon, Airflow). An executor, not mp.Pool: a worker that
    # dies (OOM killer) raises BrokenProcessPool here instead of hanging the stage forever.
    pool = ProcessPoolExecutor(
        processes,
        mp_context=mp.get_context("spawn"),
        initializer=_init_worker,
        initargs=(os.getpid(), tok.to_str(), eos_id, dtype.name),
    )
    with spawn_without_main():
        try:
            pending: collections.deque = collections.deque()
            for key, texts in batches:
                pending.append(pool.submit(_encode_in_worker, key, texts))
                if len(pending) >= 2 * processes:  # back-pressure: never read far ahead of the workers
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            raise DataPrepError(
                "a tokenizer worker process died (out of memory?); lower data.tokenize_processes"
            ) from None
        finally:
            pool.shutdown(cancel_futures=True)
