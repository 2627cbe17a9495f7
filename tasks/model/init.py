"""Weights written straight into this rank's local shards: seeded random init, or a local HF checkpoint.

A parameter may be a plain tensor (one process, or a pipeline stage's copy) or a DTensor (FSDP and/or TP shards).
Either way this rank owns one box of the full tensor: `local_box` gives its shape and global offset, and only that
box is ever allocated or read — no rank holds a full tensor (bar replicated ones), let alone the whole model.

Random init is layout-free by construction: the full tensor is defined row-chunk by row-chunk, each chunk drawn from
a CPU generator seeded by (seed, parameter name, chunk index), with the chunk size fixed by the full shape alone. A
rank draws only the chunks that overlap its rows, one at a time, and keeps only its columns — so every dp/tp/pp/zero
layout (and one process) gets bit-identical weights, with memory bounded by one chunk (≤ 4 MB) plus the local shard.
(DTensor's own RNG cannot do this on CPU: every shard gets the same values.)

The HF source reads each box's rows straight from the safetensors file (header offsets, plain reads in bounded
chunks, no mmap): only those bytes leave the file, and nothing stays mapped. Headers and reads are checked against
the file (tasks.model.safetensors_io): a truncated or lying file is one line, never rows of zeros.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

from tasks.errors import StageError
from tasks.model.hf_config import (
    _FAMILY_ARCH,
    expert_hf_name,
    hf_expert,
    hf_to_ours,
    is_expert_stack,
    ours_to_hf,
    read_hf_config,
)
from tasks.model.safetensors_io import Header, read_exact, read_header

CHUNK_ELEMS = 1 << 20  # elements per generator chunk (fixed by the full shape only: layout-free)
STD = 0.02


def local_box(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's piece of `p`."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(shape), tuple(offset)
    return tuple(p.shape), (0,) * p.dim()


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def canonical(name: str) -> str:
    """The model-level parameter name (wrappers such as activation checkpointing may add prefixes)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


class RandomInit:
    """Seeded per (parameter name, row chunk): normal(0, 0.02) weights, residual projections scaled by
    1/sqrt(2·layers) (GPT-2), zero biases, unit norms."""

    def __init__(self, seed: int, n_layers: int, tie_embeddings: bool):
        self.seed, self.tie = seed, tie_embeddings
        self.out_std = STD / math.sqrt(2 * n_layers)

    def fill(self, name: str, dest: torch.Tensor, full_shape: tuple, offset: tuple) -> None:
        if name.endswith(".bias"):
            dest.zero_()
            return
        if "norm" in name:
            dest.fill_(1.0)
            return
        # A tied output projection (e.g. on a stage without the embedding) takes the embedding's values.
        key = "tok_embeddings.weight" if name == "output.weight" and self.tie else name
        scale = self.out_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else STD
        base = (self.seed * 1_000_003 + zlib.crc32(key.encode())) * 1_000_033
        rows = full_shape[0]
        row_elems = math.prod(full_shape[1:])
        chunk = max(1, CHUNK_ELEMS // max(1, row_elems))
        r0, r1 = offset[0], offset[0] + dest.shape[0]
        rest = tuple(slice(o, o + s) for o, s in zip(offset[1:], dest.shape[1:]))
        for c in range(r0 // chunk, -(-r1 // chunk)):
            lo, hi = c * chunk, min(rows, (c + 1) * chunk)
            g = torch.Generator().manual_seed((base + c) % (1 << 63))
            block = torch.randn((hi - lo, *full_shape[1:]), generator=g)
            a, b = max(r0, lo), min(r1, hi)
            piece = block[(slice(a - lo, b - lo), *rest)]
            dest[a - r0 : b - r0].copy_(piece * scale)


class HFWeights:
    """A local HF Llama/Qwen2 directory (model.safetensors, or shards + model.safetensors.index.json) as a source
    of boxes: `fill` reads exactly this rank's box of one tensor."""

    def __init__(self, path, tcfg=None):
        self.path = Path(path)
        self.tcfg = tcfg or read_hf_config(self.path)
        self._handles: dict[Path, object] = {}
        self.where: dict[str, tuple[Path, str]] = {}  # our name → (file, HF name)
        self.experts: dict[str, dict[int, tuple[Path, str]]] = {}  # stacked expert weight → {j: (file, HF name)}
        arch = _FAMILY_ARCH[self.tcfg.family]
        for file, names in self._files().items():
            for hf_name in names:
                ours = hf_to_ours(hf_name)
                expert = hf_expert(hf_name) if ours is None else None
                if expert is not None:
                    self.experts.setdefault(expert[0], {})[expert[1]] = (file, hf_name)
                    continue
                if ours is None:
                    if "rotary_emb.inv_freq" in hf_name:  # old checkpoints saved the RoPE table: recomputed
                        continue
                    raise StageError(f"{file.name}: unexpected tensor {hf_name!r} for {arch}")
                self.where[ours] = (file, hf_name)
        if self.tcfg.tie_embeddings and "tok_embeddings.weight" in self.where:
            self.where["output.weight"] = self.where["tok_embeddings.weight"]  # HF re-ties lm_head

    def _files(self) -> dict[Path, list[str]]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            by_file: dict[Path, list[str]] = {}
            for name, f in json.loads(index.read_text())["weight_map"].items():
                by_file.setdefault(self.path / f, []).append(name)
            for f in by_file:
                if not f.is_file():
                    raise StageError(f"{self.path}: missing shard {f.name} listed in model.safetensors.index.json")
            return by_file
        single = self.path / "model.safetensors"
        if not single.is_file():
            from tasks.model.model_dir import no_weights

            raise StageError(no_weights(self.path))
        return {single: list(self._header(single))}

    def _header(self, file: Path) -> Header:
        """The file's checked safetensors header (bounded size, offsets inside the file, known dtypes), read once."""
        if file not in self._handles:
            self._handles[file] = read_header(file)
        return self._handles[file]

    def check(self, names) -> None:
        """Every parameter the model needs is in the checkpoint (one line naming the first missing one)."""
        have = set(self.where) | {n for n, by_j in self.experts.items() if len(by_j) == self.tcfg.n_experts}
        missing = sorted(set(names) - have)
        if missing:
            first = missing[0]
            if is_expert_stack(first):
                j = min(set(range(self.tcfg.n_experts)) - set(self.experts.get(first, {})))
                hf = expert_hf_name(first, j)
            else:
                hf = ours_to_hf(first)
            raise StageError(f"{self.path}: checkpoint lacks {len(missing)} tensors, first {hf!r}")

    def fill(self, name: str, dest: torch.Tensor, full_shape: tuple, offset: tuple) -> None:
        """Read this box with plain file reads of its rows (in chunks of ≤ CHUNK_ELEMS elements' bytes), not an
        mmap: only the box (plus one chunk) is ever resident, and no file pages stay mapped afterwards. A stacked
        MoE expert weight reads each of this rank's experts' boxes from that expert's HF tensor."""
        if name in self.experts:
            for e in range(dest.shape[0]):
                self._copy(name, self.experts[name][offset[0] + e], dest[e], full_shape[1:], offset[1:])
            return
        if name not in self.where:
            self.check([name])
        self._copy(name, self.where[name], dest, full_shape, offset)

    def _copy(self, name, where, dest, full_shape, offset) -> None:
        file, hf_name = where
        header = self._header(file)
        if hf_name not in header:
            raise StageError(f"{file}: tensor {hf_name!r} listed in model.safetensors.index.json is not in the file")
        entry = header[hf_name]
        shape = entry.shape
        if shape != tuple(full_shape):
            raise StageError(
                f"{self.path}: tensors do not match config.json (size mismatch for {name}: "
                f"checkpoint {list(shape)}, model {list(full_shape)})"
            )
        dtype, start = entry.dtype, entry.start
        if not shape:
            shape, dest, offset = (1,), dest.view(1), (0,)
        row_elems = math.prod(shape[1:])
        row_bytes = row_elems * dtype.itemsize
        r0, r1 = offset[0], offset[0] + dest.shape[0]
        rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], dest.shape[1:]))
        step = max(1, CHUNK_ELEMS * 4 // max(1, row_elems))
        with open(file, "rb", buffering=0) as f:
            for a in range(r0, r1, step):
                b = min(r1, a + step)
                buf = bytearray((b - a) * row_bytes)
                f.seek(start + a * row_bytes)
                read_exact(f, buf, file, hf_name)  # a file cut since its header was read: named, not zeros
                rows = (
                    torch.frombuffer(buf, dtype=dtype).view(b - a, *shape[1:])
                    if buf
                    else torch.empty((0, *shape[1:]), dtype=dtype)
                )
                dest[a - r0 : b - r0].copy_(rows[(slice(None), *rest)])


@torch.no_grad()
def init_local(model, source) -> None:
    """Write `source`'s values into every parameter's local shard (each tensor once, tied ones included)."""
    names = [canonical(n) for n, _ in model.named_parameters()]
    if hasattr(source, "check"):
        source.check(names)
    for name, p in model.named_parameters():
        dest = local_tensor(p)
        shape, offset = local_box(p)
        if tuple(dest.shape) != shape:
            raise RuntimeError(f"{name}: local tensor {tuple(dest.shape)} is not the expected box {shape}")
        if dest.numel():
            source.fill(canonical(name), dest, tuple(p.shape), offset)
