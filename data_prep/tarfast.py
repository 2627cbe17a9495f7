"""TarSamples: WebDataset tar shards of one-member samples, byte for byte what webdataset's TarWriter writes.

webdataset builds each member with tarfile (a TarInfo, a header, padding): ~50 µs a sample, Python-bound. Every
sample of a shard set has the same member size and a key of the same width, so the header is made once by tarfile
itself and only the name and its checksum change per sample (the checksum is the sum of the header's bytes, the
checksum field counted as spaces: POSIX ustar). tests/test_shard.py checks that the bytes equal TarWriter's.
"""

from __future__ import annotations

import hashlib
import tarfile
import zlib

BLOCK, RECORD = tarfile.BLOCKSIZE, tarfile.RECORDSIZE
_CHKSUM = slice(148, 156)


class TarSamples:
    """Write samples `<key>.<ext>` (keys all `key_width` characters, payloads all `size` bytes) to a binary file.

    `sha256` is the file's hash and `crc32` the samples' (key, then payload, sample after sample) as written."""

    def __init__(self, f, ext: str, size: int, key_width: int, mtime: int = 0, mode: int = 0o444, owner: str = "llm"):
        info = tarfile.TarInfo("0" * key_width + "." + ext)
        info.size, info.mtime, info.mode, info.uname, info.gname = size, mtime, mode, owner, owner
        header = bytearray(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))  # TarWriter's format
        if len(header) != BLOCK:
            raise ValueError(f"member name {info.name!r} does not fit one ustar header")
        header[_CHKSUM] = b" " * 8
        self._base = sum(header) - ord("0") * key_width  # checksum without the key's characters
        self._header, self._width = header, key_width
        self._pad = b"\0" * (-size % BLOCK)
        self.f, self.size, self.offset, self.samples = f, size, 0, 0
        self.sha256, self.crc32 = hashlib.sha256(), 0
        self._chunks: list[bytes] = []
        self._buffered = 0

    def write(self, key: str, payload: bytes) -> None:
        name = key.encode("ascii")
        if len(name) != self._width or len(payload) != self.size:
            raise ValueError(f"sample {key!r}: key width or payload size differs from the shard's")
        header = self._header
        header[: self._width] = name
        header[_CHKSUM] = b"%06o\0 " % (self._base + sum(name))
        self.crc32 = zlib.crc32(payload, zlib.crc32(name, self.crc32))
        self.samples += 1
        self._chunks += (bytes(header), payload, self._pad)
        self._buffered += BLOCK + self.size + len(self._pad)
        if self._buffered >= 1 << 20:
            self.flush()

    def flush(self) -> None:
        data = b"".join(self._chunks)
        self.sha256.update(data)
        self.f.write(data)
        self.offset += len(data)
        self._chunks, self._buffered = [], 0

    def close(self) -> None:
        """The end-of-archive blocks, padded to a whole record (as tarfile does)."""
        self.flush()
        end = 2 * BLOCK
        end += -(self.offset + end) % RECORD
        self._chunks = [b"\0" * end]
        self.flush()


def sample_crc32(samples) -> int:
    """The crc32 a shard's samples must have: (key, payload) pairs in tar order (what the loader recomputes)."""
    crc = 0
    for key, payload in samples:
        crc = zlib.crc32(payload, zlib.crc32(key.encode("ascii"), crc))
    return crc
