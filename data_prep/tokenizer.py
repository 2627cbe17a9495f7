"""Tokenizer: train a byte-level BPE on the corpus, or load a tokenizer.json / model directory; encode in threads.

Encoding runs in `threads` threads of this process (the Rust encoder releases the GIL; each call is single-threaded,
so the threads are the parallelism), each fed bounded batches (at most 4 in flight per thread), so memory stays
flat however large the corpus, and results come back in submission order, so the token stream (and the shards) do
not depend on the number of threads. Threads, not processes: no interpreter to start, no text to pickle across.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from data_prep.errors import DataPrepError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# How a document's text is encoded: as ordinary text, a special token's string in it ("<|endoftext|>", "</s>",
# "<|im_start|>" …) included; the EOS after it is appended by id. Part of the build key and of the version name
# (data_prep.job.build_key, data_prep.layout.version_name): sets built before it encoded such a string as the special
# token (an EOS in the middle of a document), and are not reused.
TEXT_ENCODING = "special-tokens-as-text"


def train_bpe(texts: Iterable[str], vocab_size: int, eos_token: str = "<|endoftext|>") -> Tokenizer:
    """Byte-level BPE (GPT-2 style): every byte is representable, so no text is ever <unk>. The trainer reads a
    special token's string in the text as ordinary text (its merges are learned like any other), as encoding does."""
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


def _json_object(path: Path) -> dict:
    """A companion file's JSON object; anything else one line naming the file and the way out."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        why = f"{e.msg} at line {e.lineno} column {e.colno}"
    except UnicodeDecodeError as e:
        why = f"not UTF-8: {e.reason} at byte {e.start}"
    else:
        if isinstance(value, dict):
            return value
        kinds = {list: "an array", str: "a string", bool: "true/false", type(None): "null"}
        why = f"it holds {kinds.get(type(value), 'a number')}"
    raise DataPrepError(f"{path}: not a JSON object ({why}); fix it or set data.eos_token")


def find_eos(tok: Tokenizer, spec: str, eos_token: str = "") -> tuple[str, int]:
    """EOS: the configured token, else the eos_token of the tokenizer_config.json companion (beside a tokenizer.json:
    the same file tokenizer_identity hashes, so the cache key follows it), else a usual name."""
    names = [eos_token] if eos_token else []
    if not eos_token and spec != "train":
        cfg_path = tokenizer_file(spec).parent / "tokenizer_config.json"
        if cfg_path in tokenizer_companions(spec):
            value = _json_object(cfg_path).get("eos_token")
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and tok.token_to_id(value) is None:  # never another token in its place
                raise DataPrepError(
                    f"{cfg_path}: eos_token {value!r} is not in the tokenizer's vocabulary; fix the file or set "
                    "data.eos_token to the token that ends a document"
                )
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


def file_sha256s(directory: str | Path) -> dict[str, str]:
    """sha256 of tokenizer.json and of each companion file present in `directory` (a shard set, a model dir)."""
    directory = Path(directory)
    names = ["tokenizer.json", *(n for n in COMPANION_FILES if (directory / n).is_file())]
    return {n: hashlib.sha256((directory / n).read_bytes()).hexdigest() for n in names if (directory / n).is_file()}


def identity(sha256s: dict[str, str]) -> str:
    """A tokenizer's identity: one sha256 over its files' names and sha256s (tokenizer.json first, then companions in
    COMPANION_FILES order). The manifest records it as `tokenizer.identity`; `dir_identity` recomputes it for any
    directory holding those files (a checkpoint's, an HF export's) so two of them can be compared."""
    order = ["tokenizer.json", *COMPANION_FILES]
    names = sorted(sha256s, key=lambda n: order.index(n) if n in order else len(order))
    return hashlib.sha256("".join(f"{n}\0{sha256s[n]}\n" for n in names).encode()).hexdigest()


def dir_identity(directory: str | Path) -> str:
    return identity(file_sha256s(directory))


# --- encoding --------------------------------------------------------------------------------------------------


def text_encoder(tok: Tokenizer, eos_id: int) -> Tokenizer:
    """A copy of `tok` that encodes a special token's string in the text as ordinary text (`encode_special_tokens`;
    `add_special_tokens=False` only leaves out the post-processor's BOS/EOS), the EOS too even where the tokenizer
    does not mark it special: the only EOS in the stream is the one appended after each document. A copy, so the
    tokenizer given (saved into the shard set, or the caller's) is left as it is; the setting is not serialised by
    tokenizers 0.23 either, so tokenizer.json would not carry it. Other added tokens not marked special are matched
    in the text as the tokenizer defines them."""
    enc = Tokenizer.from_str(tok.to_str())
    added = enc.get_added_tokens_decoder().get(eos_id)
    if added is not None and not added.special:
        enc.add_special_tokens([AddedToken(added.content, special=True, normalized=False)])
    enc.encode_special_tokens = True
    return enc


def encode_docs(tok: Tokenizer, texts: list[str], eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the documents, each followed by EOS, as one flat array; and each document's length (with EOS).
    `tok`: a `text_encoder`. `encode_batch_fast`: the same ids as `encode_batch`, without computing character
    offsets."""
    parts, eos = [], np.array([eos_id], dtype=dtype)
    lengths = np.empty(len(texts), dtype=np.int64)
    for i, enc in enumerate(tok.encode_batch_fast(texts, add_special_tokens=False)):
        ids = enc.ids  # a new list each call
        parts += (np.array(ids, dtype=dtype), eos)
        lengths[i] = len(ids) + 1
    return (np.concatenate(parts) if parts else np.empty(0, dtype=dtype)), lengths


def encode_stream(
    tok: Tokenizer, eos_id: int, dtype: np.dtype, batches: Iterable[tuple[object, list[str]]], threads: int
) -> Iterator[tuple[object, np.ndarray, np.ndarray]]:
    """(key, texts) batches → (key, ids, lengths) in the same order, encoded in `threads` threads. tokenizers' own
    thread pool is off while it runs (TOKENIZERS_PARALLELISM, read at every call: the threads are the parallelism)
    and the variable is restored afterwards, so later encodes in the same process use every core again. The text is
    encoded as ordinary text (`text_encoder`)."""
    tok = text_encoder(tok, eos_id)
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize") if threads > 1 else None
    try:
        if pool is None:
            for key, texts in batches:
                yield key, *encode_docs(tok, texts, eos_id, dtype)
            return
        pending: collections.deque = collections.deque()
        for key, texts in batches:
            pending.append((key, pool.submit(encode_docs, tok, texts, eos_id, dtype)))
            if len(pending) >= 4 * threads:  # back-pressure, with room to pass a batch holding a huge document
                key, done = pending.popleft()
                yield key, *done.result()
        while pending:
            key, done = pending.popleft()
            yield key, *done.result()
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
