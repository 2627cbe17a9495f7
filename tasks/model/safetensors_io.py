"""A checked safetensors reader: the header and every read are held to the file before a byte is trusted.

The rules are the format's own, as the reference implementation enforces them (huggingface/safetensors,
safetensors/src/tensor.rs: `MAX_HEADER_SIZE = 100_000_000`, `SafeTensors::read_metadata` and `Metadata::validate`):
the 8-byte little-endian header length is at most 100 MB and inside the file; the header is a JSON object of
{name: {dtype, shape, data_offsets}} (plus `__metadata__`); each tensor's byte length is shape × dtype size; sorted by
offset the tensors are contiguous from 0 with no gap or overlap; and the last one ends exactly at the end of the
file. A truncated file, a header that lies about offsets, an unknown dtype or an oversized header is one line naming
the file and the tensor (StageError), never a KeyError, a MemoryError or rows of zeros read past the end.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.errors import StageError

MAX_HEADER_SIZE = 100_000_000  # safetensors/src/tensor.rs
# The dtypes this project loads (safetensors names → torch). FP8 and the other low-bit formats are refused: an FP8
# checkpoint keeps its scales in separate tensors, and reading the raw values as weights would be silently wrong.
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}  # torch dtype → safetensors name (the writers' table)


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int


class Header(dict):
    """name → Entry of one file (`__metadata__` kept apart in `.metadata`)."""

    path: Path
    metadata: dict
    data_start: int


def _bad(path: Path, what: str) -> StageError:
    return StageError(f"{path}: {what}; the file is truncated or not a valid safetensors file: re-export or re-copy it")


def read_header(path: str | os.PathLike) -> Header:
    """The checked header of one safetensors file (StageError in one line when anything disagrees with the file)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_SIZE:
            raise _bad(path, f"header length {n} bytes exceeds safetensors' limit of {MAX_HEADER_SIZE}")
        if 8 + n > size:
            raise _bad(path, f"header length {n} bytes runs past the end of the file ({size} bytes)")
        text = f.read(n)
    try:
        data = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(path, f"header is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise _bad(path, f"header is a JSON {type(data).__name__}, not an object")
    header = Header()
    header.path, header.data_start = path, 8 + n
    header.metadata = data.pop("__metadata__", None) or {}
    for name, info in data.items():
        header[name] = _entry(path, name, info, header.data_start)
    end = header.data_start
    for name, e in sorted(header.items(), key=lambda kv: (kv[1].start, kv[1].nbytes)):
        if e.start != end:
            what = "overlaps the tensor before it" if e.start < end else "leaves a gap before it"
            raise _bad(path, f"tensor {name!r}: data_offsets start at {e.start - header.data_start}, which {what}")
        end = e.start + e.nbytes
    if end != size:
        last = max(header, key=lambda k: header[k].start + header[k].nbytes, default=None)
        if end > size:
            raise _bad(path, f"tensor {last!r} ends at byte {end}, past the end of the file ({size} bytes)")
        raise _bad(path, f"{size - end} bytes after the last tensor {last!r} (the header does not cover the file)")
    return header


def _entry(path: Path, name: str, info, data_start: int) -> Entry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise _bad(path, f"tensor {name!r}: header entry lacks dtype, shape or data_offsets")
    dtype = DTYPES.get(info["dtype"])
    if dtype is None:
        raise StageError(
            f"{path}: tensor {name!r} has dtype {info['dtype']!r}, which is not supported "
            f"({', '.join(DTYPES)}); convert the checkpoint to bf16 or fp32"
        )
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _bad(path, f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise _bad(path, f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _bad(
            path,
            f"tensor {name!r}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, shape {shape} "
            f"{info['dtype']} needs {nbytes}",
        )
    return Entry(dtype, tuple(shape), data_start + offsets[0], nbytes)


def read_exact(f, buf: bytearray, path: Path, name: str) -> None:
    """Fill `buf` from `f`'s position or fail naming the file and tensor (a file cut since its header was read)."""
    got = f.readinto(buf)
    if got != len(buf):
        raise StageError(
            f"{path}: tensor {name!r}: read {got} of {len(buf)} bytes (the file is truncated); re-export or re-copy it"
        )


def read_tensor(header: Header, name: str) -> torch.Tensor:
    """One whole tensor, checked (the reader for small files and tests; HFWeights reads boxes)."""
    e = header[name]
    buf = bytearray(e.nbytes)
    with open(header.path, "rb", buffering=0) as f:
        f.seek(e.start)
        read_exact(f, buf, header.path, name)
    return torch.frombuffer(buf, dtype=e.dtype).view(e.shape) if buf else torch.empty(e.shape, dtype=e.dtype)
