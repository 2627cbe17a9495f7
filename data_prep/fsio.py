"""What data_prep writes, with explicit modes (files 0644, directories 0755, whatever the umask), atomically.

A file is written under a temporary name beside its final one, fsynced, then renamed: a reader (or a rerun) sees
either nothing or the whole file. Locks are flock()s on files in a `locks/` directory: released by the kernel when
their holder dies, so a killed builder never leaves a lock behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

from data_prep.errors import DataPrepError

FILE_MODE, DIR_MODE = 0o644, 0o755


def make_dir(path: Path) -> Path:
    """mkdir -p with mode 0755 for each directory created here (an existing one is left as it is)."""
    path = Path(path)
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        os.chmod(d, DIR_MODE)
    return missing[0] if missing else path


def create(path: Path, buffering: int = -1):
    """A new binary file with mode 0644 (a stale one of the same name is replaced)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "wb", buffering=buffering)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with create(tmp) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: Path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as f, create(dst) as out:
        shutil.copyfileobj(f, out)


def chmod_file(path: Path) -> None:
    os.chmod(path, FILE_MODE)


def ensure_writable(directory: Path) -> None:
    try:
        make_dir(directory)
        probe = Path(directory) / f".write-probe-{os.getpid()}"
        create(probe).close()
        probe.unlink()
    except OSError as e:
        raise DataPrepError(f"output directory {directory} is not writable ({e.strerror or e})") from None


@contextlib.contextmanager
def lock(directory: Path, name: str):
    """An exclusive flock on `<directory>/locks/<name>`: one holder per step; waits for a live holder."""
    locks = Path(directory) / "locks"
    make_dir(locks)
    fd = os.open(locks / name, os.O_RDONLY | os.O_CREAT, FILE_MODE)
    try:
        if os.fstat(fd).st_mode & 0o777 != FILE_MODE:  # created under a umask (the build locks outlive the build)
            with contextlib.suppress(PermissionError):  # another user's: theirs to keep
                os.fchmod(fd, FILE_MODE)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def rename_dir(src: Path, dst: Path) -> bool:
    """Rename a directory into place; False when `dst` already exists (someone else put it there first)."""
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    fsync_path(Path(dst).parent)
    return True
