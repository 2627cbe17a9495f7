"""Atomic file output: a reader never sees a half-written file, and a killed writer leaves only a temp file.

Modes are explicit, whatever the umask: data 0644, secrets 0600 (`mode=SECRET_MODE`), directories 0755 (`make_dirs`;
temp directories made private by mkdtemp are opened up when they are published). `set_umask()` is called once by
run_stage so that everything else a stage and its children create (DCP checkpoints, shards, logs) follows it too.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


FILE_MODE, SECRET_MODE, DIR_MODE = 0o644, 0o600, 0o755
UMASK = 0o022  # → files 0644, directories 0755 for every writer in the process and its children


def set_umask() -> None:
    """A umask of 000 would leave shard sets, checkpoints and run directories world-writable (anyone could swap the
    weights the trainer resumes); 077 would hide them from the Airflow worker's other users. One setting: 022."""
    os.umask(UMASK)


def make_dirs(path: str | os.PathLike, mode: int = DIR_MODE) -> Path:
    """`mkdir -p` whose new directories get `mode` whatever the umask (existing ones are left alone)."""
    path = Path(path)
    new, p = [], path
    while not p.exists() and p != p.parent:
        new.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    for d in reversed(new):
        os.chmod(d, mode)
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = FILE_MODE) -> Path:
    path = Path(path)
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)  # mkstemp's 0600 for data, 0600 kept for secrets: set before a byte is written
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not e.filename:  # a failed write (ENOSPC) names no file: name ours
            e.filename = str(path)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, mode: int = FILE_MODE) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: str | os.PathLike, obj, mode: int = FILE_MODE, **kwargs) -> Path:
    kwargs.setdefault("indent", 2)
    kwargs.setdefault("sort_keys", True)
    return atomic_write_text(path, json.dumps(obj, default=str, **kwargs) + "\n", mode)


def swap_dir(tmp_dir: Path, final_dir: Path) -> Path:
    """Replace `final_dir` by the complete `tmp_dir` with no moment where neither exists on disk: the old one is
    renamed aside (`.<name>.old`), the new one renamed in, then the old one deleted. A crash in between is undone
    by recover_dir() on the next run."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    old = final_dir.with_name(f".{final_dir.name}.old")
    if old.exists():
        shutil.rmtree(old)
    os.chmod(tmp_dir, DIR_MODE)  # a mkdtemp directory is 0700
    if final_dir.exists():
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    shutil.rmtree(old, ignore_errors=True)
    return final_dir


def recover_dir(final_dir: Path) -> None:
    """Before writing `final_dir` again: restore `.<name>.old` if a crash hit swap_dir() between its renames, and
    delete temp directories (`.<name>.*`) that a killed writer left beside it."""
    final_dir = Path(final_dir)
    old = final_dir.with_name(f".{final_dir.name}.old")
    if old.exists() and not final_dir.exists():
        os.rename(old, final_dir)
    if not final_dir.parent.is_dir():
        return
    for p in final_dir.parent.glob(f".{final_dir.name}.*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_json(path: str | os.PathLike):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Records of a JSON-lines file (e.g. metrics.jsonl); [] when it does not exist."""
    if not Path(path).is_file():
        return []
    return [json.loads(ln) for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]


def atomic_save_figure(fig, path: str | os.PathLike, dpi: int = 100, **kwargs) -> Path:
    """A matplotlib figure as a PNG, atomically (a reader never sees half an image); the figure is closed."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, **kwargs)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
