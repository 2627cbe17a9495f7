"""Sharding and loader figures on Python's own sources (present everywhere), each beside its baseline in this run.

- sharding.tokens_per_s_ratio_vs_tokenizer: the whole shard build (resolve, read, clean, dedupe, tokenise in 2
  threads, pack, write tars with their sha256 and crc32, fsync, publish) in tokens/s, over the raw `tokenizers`
  batch encode of the same documents already in memory, with the API the builder uses (`encode_batch_fast`: the
  same ids as `encode_batch`, without character offsets; Rust, all cores; a special token's string in the text read
  as text, `encode_special_tokens`) — best of two each, interleaved. Goal
  ≥ 0.95. sharding.tokens_per_s_ratio_vs_encode_batch: the same build over `encode_batch` (offsets computed).
- sharding.seconds_by_size / sharding.peak_rss_mb_by_size: three corpus sizes; time should grow linearly, the
  build's peak memory should stay flat. A sampler thread sums VmRSS over this process and any descendants every
  50 ms (peak_rss_mb_by_size), and the proportional set size the same way (peak_pss_mb_by_size) — the build
  tokenises in threads, so that is this one process, and the highest sample can read below the exact peak;
  parent_peak_rss_mb_by_size is the exact high-water mark (VmHWM, reset per build). The peak
  follows the largest single document (the tokenizer needs ~100 bytes a character of the document it encodes,
  data.max_chars bounds it), not the corpus size: sharding.largest_document_kb_by_size says which that was.
- sharding.cpu_ratio_vs_tokenizer: the same comparison in CPU seconds of this process (all its threads) for the
  same tokens, baseline over builder: what the build costs beyond encoding, much less sensitive to a loaded host
  than the wall-clock ratio (1.0 = no overhead; above 1: the builder's batches encode more cheaply than one call).
- sharding.host_load_1m: the 1-minute load average, the highest of before and after the sharding figures (the host
  is shared: a load above its cores makes every ratio here noisy).
- loader.samples_per_s: ShardLoader with 0 and 2 workers, and the ratio of the 0-worker figure to a plain
  `wds.WebDataset(...).decode()` pass over the same shards (the baseline).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

SIZES_MB = (4, 8, 16)
SEQ_LEN, VOCAB, BATCH = 512, 4096, 32


def _vmhwm_mb() -> float:
    """Peak RSS in MB (tasks.units; /proc reports kB = 1024 bytes)."""
    from tasks.units import MB

    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024 / MB


def _reset_peak() -> None:
    """Writing 5 to clear_refs resets VmHWM (Linux ≥ 4.0), so each build's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, from each process's parent in /proc/<pid>/stat (no CONFIG_PROC_CHILDREN
    needed)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4, after "(comm)"
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _field_kb(path: str, name: str) -> int:
    try:
        with open(path) as f:
            return next((int(line.split()[1]) for line in f if line.startswith(name)), 0)
    except OSError:  # the process ended between listing and reading
        return 0


class TreeMemory:
    """Peak of Σ VmRSS and Σ Pss over this process and its descendants (the build's worker processes), sampled."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.rss_kb, self.pss_kb = interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        pids = [os.getpid()] + _descendants(os.getpid())
        self.rss_kb = max(self.rss_kb, sum(_field_kb(f"/proc/{p}/status", "VmRSS:") for p in pids))
        self.pss_kb = max(self.pss_kb, sum(_field_kb(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _corpus(size_mb: int) -> list[str]:
    """The first stdlib files (sorted) adding up to size_mb."""
    from data_prep.corpus import stdlib_files

    files, total = [], 0
    for p in stdlib_files():
        files.append(str(p))
        total += p.stat().st_size
        if total >= size_mb * 1e6:
            return files
    return files


def _cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _load_1m() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _tokenizer_baseline(
    files: list[str], tokenizer: Path, repeats: int, api: str = "encode_batch_fast", cpu: list | None = None
) -> float:
    """tokens/s of Tokenizer.<api> on the cleaned documents already in memory (best of `repeats`); `cpu` gets the
    CPU seconds per token of each repeat."""
    from tokenizers import Tokenizer

    from data_prep.clean import clean_documents
    from data_prep.config import ShardConfig
    from data_prep.corpus import CorpusStats

    texts = [t for _, t in clean_documents([Path(f) for f in files], ShardConfig(), CorpusStats())]
    tok = Tokenizer.from_file(str(tokenizer))
    tok.encode_special_tokens = True  # as the builder encodes a document (data_prep.tokenizer.text_encoder)
    best = 0.0
    for _ in range(repeats):
        start, cpu0 = time.perf_counter(), _cpu_s()
        tokens = sum(len(e.ids) for e in getattr(tok, api)(texts, add_special_tokens=False)) + len(texts)  # + EOS
        best = max(best, tokens / (time.perf_counter() - start))
        if cpu is not None:
            cpu.append((_cpu_s() - cpu0) / tokens)
    return best


def _loader_figures(shard_dir: Path) -> dict:
    import webdataset as wds
    from torch.utils.data import DataLoader

    from data_prep.loader import ShardLoader
    from data_prep.manifest import load_manifest

    figures = {"loader.samples_per_s": {}}
    for workers in (0, 2):
        loader = ShardLoader(shard_dir, batch_size=BATCH, num_workers=workers, seed=0)
        start = time.perf_counter()
        n = sum(x.shape[0] for x, _ in loader)
        figures["loader.samples_per_s"][f"workers_{workers}"] = round(n / (time.perf_counter() - start))
    urls = [str(shard_dir / e["name"]) for e in load_manifest(shard_dir)["splits"]["train"]["shards"]]
    plain = wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode().to_tuple("tokens.npy")
    start = time.perf_counter()
    n = sum(1 for _ in DataLoader(plain, batch_size=None, num_workers=0))
    baseline = n / (time.perf_counter() - start)
    figures["loader.baseline_plain_webdataset_samples_per_s"] = round(baseline)
    figures["loader.ratio_vs_plain_webdataset"] = round(figures["loader.samples_per_s"]["workers_0"] / baseline, 3)
    return figures


def run() -> dict:
    from data_prep.build import build_shard_set
    from data_prep.clean import clean_documents
    from data_prep.config import ShardConfig
    from data_prep.corpus import CorpusStats
    from data_prep.tokenizer import train_bpe

    figures: dict = {
        "sharding.seconds_by_size": {},
        "sharding.peak_rss_mb_by_size": {},
        "sharding.peak_pss_mb_by_size": {},
        "sharding.parent_peak_rss_mb_by_size": {},
        "sharding.tokens_per_s_by_size": {},
        "sharding.largest_document_kb_by_size": {},
    }
    load = _load_1m()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        tmp = Path(tmp)
        corpora = {size: _corpus(size) for size in SIZES_MB}
        docs = (t for _, t in clean_documents([Path(f) for f in corpora[SIZES_MB[0]]], ShardConfig(), CorpusStats()))
        tok_path = tmp / "tokenizer.json"
        train_bpe(docs, VOCAB).save(str(tok_path))  # one fixed tokenizer: builder and baseline encode alike

        def build(files: list[str], out: str):
            cfg = ShardConfig(
                inputs=files,
                out_dir=str(tmp / out),
                tokenizer=str(tok_path),
                seq_len=SEQ_LEN,
                shard_size_mb=4,
                shard_multiple=2,
                tokenize_processes=2,
                progress=False,
            )
            return build_shard_set(cfg)

        for size, files in corpora.items():
            _reset_peak()
            with TreeMemory() as mem:
                result = build(files, f"out-{size}")
            key = f"{size}mb"
            figures["sharding.seconds_by_size"][key] = round(result.seconds, 2)
            figures["sharding.peak_rss_mb_by_size"][key] = round(mem.rss_kb / 1024, 1)
            figures["sharding.peak_pss_mb_by_size"][key] = round(mem.pss_kb / 1024, 1)
            figures["sharding.parent_peak_rss_mb_by_size"][key] = round(_vmhwm_mb(), 1)
            figures["sharding.tokens_per_s_by_size"][key] = round(result.tokens / result.seconds)
            figures["sharding.largest_document_kb_by_size"][key] = round(max(map(os.path.getsize, files)) / 1e3)
        # The ratio: baseline and builder interleaved on the largest corpus, best of two each (a shared host is noisy).
        largest, cpu_base = corpora[SIZES_MB[-1]], []
        baseline = _tokenizer_baseline(largest, tok_path, repeats=1, cpu=cpu_base)
        cpu0 = _cpu_s()
        again = build(largest, "again")
        cpu_build = (_cpu_s() - cpu0) / again.tokens
        baseline = max(baseline, _tokenizer_baseline(largest, tok_path, repeats=1, cpu=cpu_base))
        offsets = _tokenizer_baseline(largest, tok_path, repeats=2, api="encode_batch")
        builder = max(result.tokens / result.seconds, again.tokens / again.seconds)
        figures["sharding.tokenizer_baseline_tokens_per_s"] = round(baseline)
        figures["sharding.tokenizer_encode_batch_tokens_per_s"] = round(offsets)
        figures["sharding.tokens_per_s"] = round(builder)
        figures["sharding.tokens_per_s_ratio_vs_tokenizer"] = round(builder / baseline, 3)
        figures["sharding.tokens_per_s_ratio_vs_encode_batch"] = round(builder / offsets, 3)
        figures["sharding.cpu_ratio_vs_tokenizer"] = round(min(cpu_base) / cpu_build, 3)
        figures["sharding.host_load_1m"] = max(load, _load_1m())
        figures.update(_loader_figures(result.shard_dir))
    return figures


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
