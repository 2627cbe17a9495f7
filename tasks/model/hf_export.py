"""DCP checkpoint → HF directory (sharded safetensors + index + config.json + tokenizer), streamed tensor by tensor.

Runs inside the training job: every rank of the world writes some of the output files (round-robin), reading each
tensor alone from the DCP checkpoint (`dcp.load(..., no_dist=True)` of one key; the checkpoint's metadata read once)
and appending its bytes to a safetensors file whose header was written up front from the checkpoint's metadata. A
process therefore holds at most one full tensor at a time, never the model. Rank 0 writes config.json, the index and
the tokenizer and `llm-pipeline.json` (every file's size and sha256, hashed as written, the tokenizer identity:
tasks.model.model_dir, and the checkpoint exported: its name and meta.json's sha256), then swaps the finished
directory in (tasks.fsutil.swap_dir: a crash leaves the old export or a `.tmp` directory, never neither; the next
export cleans up).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from pathlib import Path

import torch

from tasks.model.config import TransformerConfig
from tasks.model.safetensors_io import NAMES as _ST_DTYPES

FILE_BYTES = 2 * 1024**3  # per output file (transformers' own default shard size is 5 GB; smaller spreads ranks)


def checkpoint_tensors(ckpt: Path, tcfg: TransformerConfig) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """[(our name, shape, dtype)] of the model's tensors in a DCP checkpoint, in model order (tied output skipped)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tasks.model.transformer import build_model

    md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    out = []
    for name in build_model(tcfg, "meta").state_dict():
        if name == "output.weight" and tcfg.tie_embeddings:
            continue  # HF re-ties lm_head to embed_tokens
        entry = md.get(f"model.{name}")
        if not isinstance(entry, TensorStorageMetadata):
            raise FileNotFoundError(f"{ckpt}: no model tensor {name!r} in the checkpoint")
        out.append((name, tuple(entry.size), entry.properties.dtype))
    return out


def plan_files(tensors, dtype: torch.dtype | None, file_bytes: int = FILE_BYTES) -> list[list[tuple]]:
    """Tensors grouped into output files of at most `file_bytes` written in `dtype` (None: as saved); a larger
    tensor gets a file of its own."""
    files, current, size = [], [], 0
    for name, shape, dt in tensors:
        nbytes = _numel(shape) * (dtype or dt).itemsize
        if current and size + nbytes > file_bytes:
            files.append(current)
            current, size = [], 0
        current.append((name, shape, dt))
        size += nbytes
    if current:
        files.append(current)
    return files


def file_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def expand_experts(tensors):
    """Stacked expert weights [E, ...] → E entries keyed (our name, j) of shape [...] (HF stores one tensor per
    expert); every other entry unchanged."""
    from tasks.model.hf_io import is_expert_stack

    out = []
    for name, shape, dt in tensors:
        if is_expert_stack(name):
            out.extend(((name, j), tuple(shape[1:]), dt) for j in range(shape[0]))
        else:
            out.append((name, shape, dt))
    return out


def _hf_name(key) -> str:
    from tasks.model.hf_io import expert_hf_name, ours_to_hf

    return expert_hf_name(*key) if isinstance(key, tuple) else ours_to_hf(key)


class _Reader:
    """Reads entries from the checkpoint; an expert stack is read once and kept while its experts are written
    (at most that one full tensor held)."""

    def __init__(self, ckpt: Path, shapes: dict):
        self.ckpt, self.shapes, self.held = ckpt, shapes, (None, None)
        self.storage = storage_reader(ckpt)

    def __call__(self, key, shape, dtype) -> torch.Tensor:
        if not isinstance(key, tuple):
            self.held = (None, None)
            return _read_tensor(self.storage, key, shape, dtype)
        name, j = key
        if self.held[0] != name:
            self.held = (None, None)
            self.held = (name, _read_tensor(self.storage, name, self.shapes[name], dtype))
        return self.held[1][j]


def storage_reader(ckpt: Path):
    """A FileSystemReader that reads the checkpoint's metadata once. `dcp.load` reads `.metadata` on every call, and
    it lists every shard of every model and optimizer tensor: per tensor that was most of the export's time
    (Qwen2-0.5B on 4 ranks: 0.4 s a tensor, 290 tensors; 0.03 s each with it read once)."""
    from torch.distributed.checkpoint import FileSystemReader

    class _OnceReader(FileSystemReader):
        _metadata = None

        def read_metadata(self):
            if self._metadata is None:
                self._metadata = super().read_metadata()
            return self._metadata

    return _OnceReader(str(ckpt))


def _read_tensor(storage, name: str, shape, dtype) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    t = torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": {name: t}}, storage_reader=storage, no_dist=True)
    return t


def write_streaming(path: Path, entries: list[tuple], read) -> int:
    """One safetensors file: the header from (hf name, shape, dtype) entries, then each tensor from `read(i)`
    appended in order, hashed on the way out (its size and sha256 go to `.<name>.sha256`, which the export's
    manifest collects). Returns the tensor bytes written."""
    from tasks.model.model_dir import HashingWriter

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for hf_name, shape, dtype in entries:
        nbytes = _numel(shape) * dtype.itemsize
        header[hf_name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with HashingWriter(path) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i, (_, shape, dtype) in enumerate(entries):
            t = read(i).to(dtype).contiguous()
            assert tuple(t.shape) == tuple(shape)
            if t.numel():
                f.write(t.view(-1).view(torch.uint8).numpy().data)
            del t
    (path.parent / f".{path.name}.sha256").write_text(json.dumps(f.entry()))
    return offset


def start_dtype(hf_path: str | os.PathLike | None) -> torch.dtype | None:
    """The dtype the export keeps: bfloat16 when the checkpoint the training started from (model.hf_path) stores
    every floating-point weight in bfloat16, as published checkpoints do (transformers' save_pretrained writes a
    model in the dtype it holds, and training here holds fp32 master weights: an fp32 export of it is twice the size,
    labelled float32). Else None: the checkpoint's own dtype (fp32), as for a run from scratch; a float16 checkpoint
    too, as fp32 weights trained past float16's range would become inf. Read from the safetensors headers (what the
    files hold, not what config.json says); no hf_path, or no weights there any more: None."""
    from tasks.model.safetensors_io import read_header

    if not hf_path:
        return None
    home = Path(hf_path)
    index = home / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({home / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (home / "model.safetensors").is_file():
        files = [home / "model.safetensors"]
    else:
        return None
    floats = {e.dtype for f in files for e in read_header(f).values() if e.dtype.is_floating_point}
    return torch.bfloat16 if floats == {torch.bfloat16} else None


def export_from_checkpoint(
    ckpt: str | os.PathLike,
    tcfg: TransformerConfig,
    out: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    rank: int = 0,
    world: int = 1,
    barrier=None,
    dtype: torch.dtype | None = None,
    file_bytes: int | None = None,
    stats: dict | None = None,
    hf_path: str | os.PathLike | None = None,
) -> Path:
    """Write the HF directory `out` from the DCP checkpoint `ckpt`; with world > 1 every rank calls it (with a
    `barrier` callable) and writes its share of the files (`file_bytes` None: about 1/world of the model per file,
    at most FILE_BYTES, so every rank takes part). `stats` receives this rank's written_bytes and
    largest_tensor_bytes. `hf_path`: the checkpoint the training started from (model.hf_path), whose special token
    ids and generation_config.json the export carries (else those of the tokenizer's source checkpoint), and whose
    weights' dtype it keeps when that is bfloat16 (start_dtype; `dtype` None: else the checkpoint's own, fp32)."""
    from tasks.fsutil import recover_dir, swap_dir
    from tasks.model.hf_io import _copy_tokenizer, write_config
    from tasks.model.model_dir import write_manifest

    ckpt, out = Path(ckpt), Path(out)
    tmp = out.parent / f".{out.name}.tmp"
    barrier = barrier or (lambda: None)
    if rank == 0:
        recover_dir(out)  # a crash between swap_dir's renames restored; stale temp directories removed
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    tensors = checkpoint_tensors(ckpt, tcfg)
    if dtype is None:
        dtype = start_dtype(hf_path)  # a bf16 checkpoint fine-tuned here comes back in bf16, as it came
    if file_bytes is None:
        total = sum(_numel(shape) * (dtype or dt).itemsize for _, shape, dt in tensors)
        file_bytes = min(FILE_BYTES, -(-total // world))
    reader = _Reader(ckpt, {n: shape for n, shape, _ in tensors})
    files = plan_files(expand_experts(tensors), dtype, file_bytes)
    names = file_names(len(files))
    written, largest = 0, 0
    for i in range(rank, len(files), world):
        src = files[i]
        entries = [(_hf_name(n), shape, dtype or dt) for n, shape, dt in src]
        written += write_streaming(tmp / names[i], entries, lambda k, src=src: reader(*src[k]))
        reader.held = (None, None)
        # an expert stack is read whole (the largest tensor held), its experts written one by one
        largest = max(
            [largest]
            + [_numel(reader.shapes[n[0]] if isinstance(n, tuple) else shape) * dt.itemsize for n, shape, dt in src]
        )
    if stats is not None:
        stats.update(written_bytes=written, largest_tensor_bytes=largest)
    barrier()
    if rank == 0:
        out_dtype = dtype or (files[0][0][2] if files else torch.float32)
        write_config(tmp, tcfg, out_dtype, tokenizer_dir, hf_path)
        if len(files) > 1:
            weight_map = {_hf_name(n): names[i] for i, f in enumerate(files) for n, _, _ in f}
            total = sum(_numel(s) * (dtype or d).itemsize for f in files for _, s, d in f)
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
            )
        if tokenizer_dir is not None:
            _copy_tokenizer(Path(tokenizer_dir), tmp)
        hashed = {}  # every rank's files, hashed as they were written
        for side in tmp.glob(".*.sha256"):
            hashed[side.name[1 : -len(".sha256")]] = json.loads(side.read_text())
            side.unlink()
        manifest = write_manifest(tmp, hashed, tokenizer_dir)  # sizes, sha256 and the tokenizer the weights belong to
        if (ckpt / "meta.json").is_file():  # the checkpoint exported (a finished run's rerun hands back only its own)
            from tasks.fsutil import atomic_write_json, sha256_file

            body = json.loads(manifest.read_text(encoding="utf-8"))
            body["checkpoint"] = {"name": ckpt.name, "meta_sha256": sha256_file(ckpt / "meta.json")}
            atomic_write_json(manifest, body)
        from tasks.model.moe import note_capacity

        note_capacity(manifest, tcfg)  # trained with a capacity factor: said, and recorded (HF Qwen2-MoE has none)
        swap_dir(tmp, out)  # the old export stays until the new one is complete
    barrier()
    return out
