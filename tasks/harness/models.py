"""What the harness evaluates: a model's own tokenizer (read from its directory, never the hub) and the models of a
run — the trained export in FP32 or BF16 and the INT8 artifact as they are, and the registered champion."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import StageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class TextTokenizer:
    """A `tokenizers` tokenizer with the special tokens transformers would read from tokenizer_config.json."""

    tok: object
    eos_id: int
    bos_id: int | None
    bos_token: str | None
    name: str

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _special(configs: list[dict], key: str) -> str | None:
    for c in configs:
        v = c.get(key)
        if isinstance(v, dict):  # {"content": "<|endoftext|>", ...} (AddedToken as transformers writes it)
            v = v.get("content")
        if isinstance(v, str) and v:
            return v
    return None


def load_tokenizer(folder: str | Path, eos: str | None = None) -> TextTokenizer:
    """tokenizer.json + the EOS/BOS named in tokenizer_config.json or special_tokens_map.json of `folder` (`eos`
    when they name none: a shard set's manifest does)."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise StageError(f"evaluate: {folder} has no tokenizer.json; export the model with its tokenizer")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    configs = [json.loads((folder / f).read_text()) for f in TOKENIZER_FILES[1:] if (folder / f).is_file()]
    eos, bos = _special(configs, "eos_token") or eos, _special(configs, "bos_token")
    eos_id = tok.token_to_id(eos) if eos else None
    if eos_id is None:
        raise StageError(
            f"evaluate: the tokenizer in {folder} names no EOS token that it knows ({eos!r}); set eos_token in "
            "its tokenizer_config.json"
        )
    bos_id = tok.token_to_id(bos) if bos else None
    return TextTokenizer(tok, eos_id, bos_id, bos if bos_id is not None else None, folder.name)


def max_seq_len(model_dir: str | Path) -> int:
    """The model's context from its config.json, without loading weights (checks before any model is loaded)."""
    from tasks.model.hf_io import read_hf_config

    return read_hf_config(model_dir).max_seq_len


def full_precision(model_dir: str | Path, dtype: str, device):
    """The trained export in `dtype` ("fp32" | "bf16" | "fp16"), RoPE table in fp32."""
    import torch

    from tasks.model.hf_io import load_hf

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    model = load_hf(model_dir, device=device).to(dtypes[dtype]).eval()
    model.init_rope()
    return model
