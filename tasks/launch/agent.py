"""torchrun for CPU ranks, forked: torch.distributed.run's own agent, whose ranks are forks of one interpreter that
has already imported torch, FSDP2, DTensor, DCP, dynamo and the trainer (the env stage's probes: torch,
torch.distributed and the probe; preloads).

An exec'd rank spends 2-3 CPU s importing those before its first step (a training stage's 2-8 ranks, each time the
stage runs). Here the agent imports them once; each rank is a fork of it (`fork` is one of torchrun's own start
methods, `--start-method fork`: LaunchConfig.start_method, the entrypoint a function, elastic's MultiprocessContext)
and runs the same entry module an exec'd rank runs. Everything else is torchrun's: the arguments (its parse_args and
config_from_args), the rendezvous, the agent's monitoring, the @record error files and the end-of-run report.

CPU only (tasks/launch/torchrun.argv): a device runtime must not be initialised before a fork (CANN's and CUDA's
contexts do not survive one), so NPU and CUDA ranks are exec'd by torch.distributed.run as before.

What a forked rank does differently from an exec'd one, and why:
- binds its cores with sched_setaffinity, never numactl (an exec would throw away the fork; tasks/parallel/affinity);
- returns on success where an exec'd rank calls os._exit(0) or sys.exit() (elastic's _wrap sends the return value to
  the agent, which waits for every rank's; _exit_for, _rank);
- restores a fresh interpreter's signal handlers (the agent's SIGTERM handler raises SignalException, which would
  turn a rank torchrun stops into one that raised);
- decides inductor's compile threads again, from its own cores (importing dynamo in the agent fixed them from the
  agent's: torch/_inductor/config.py decide_compile_threads; None is decided lazily, async_compile.py);
- keeps an exec'd rank's memory figures: it maps the library pages the agent had mapped (a fork copies no page-table
  entries of file mappings, mm/memory.c copy_page_range, so they would count as the training's when first touched;
  resident_file_pages, populate), and the RSS FSDP2, DTensor, DCP and dynamo took in the agent
  ($LLM_PIPELINE_PRELOADED_RSS) comes off its first trainer's baseline (tasks/parallel/metrics.PhasePeaks), since an
  exec'd rank imports them while building that trainer's model;
- looks up no name in a one-node job (the store by 127.0.0.1, gloo on the loopback interface): glibc's resolver lock
  is not reset by fork, and a rank forked while an agent thread held it waits for ever (_no_name_lookups).

Every failed rank in the report: torch.multiprocessing reports only the first exited process it finds, in rank
order, so a peer's "Connection closed by peer" could be named and not the rank that was killed. Each rank announces
its pid through a pipe; the agent waits on each pid with waitid(WNOWAIT) (the status read, the process left for
torch.multiprocessing to reap) and adds every rank that failed to the report (tasks/parallel/rank_errors reads it).
"""

from __future__ import annotations

import importlib
import os
import runpy
import signal
import socket
import sys
import tempfile
import threading
import uuid
from pathlib import Path

from tasks.parallel.affinity import FORKED  # set in each forked rank (affinity and the worker read it)
from tasks.parallel.metrics import PRELOADED_RSS

# what an exec'd rank imports before its model exists (its memory baseline, PhasePeaks.base_bytes) …
BASE = (
    "torch",
    "torch.distributed",
    "tasks.device",
    "tasks.train.trainer",
    "tasks.train.worker",
    "tasks.parallel.checkpoint",  # the trainer's, before its memory base (config models, ~0.15 CPU s a rank)
)
# … and while it builds its first model: their RSS is handed to the ranks (PRELOADED_RSS) to stay that trainer's
LAZY = (
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.checkpoint",
    "torch._dynamo",
)
# The env stage's collective probes: their ranks run torch.distributed and none of the trainer, so their agent imports
# torch, torch.distributed and the probe only (the trainer, FSDP2, DTensor, DCP and dynamo cost ~1 CPU s a launch).
PROBES = ("tasks.envcheck.probe_worker", "tasks.envcheck.crossnode_worker")
_announce_fd: int | None = None
_resident: list[tuple[int, int]] = []  # the agent's resident file-backed pages at the fork: (address, length) runs
_ranks_tempdir: str | None = None  # the ranks' tempfile.tempdir: the agent's own, before a --log-dir (keep_error_files)
PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_POPULATE_READ = 22  # linux/mman-common.h (Linux 5.14)


def resident_file_pages() -> list[tuple[int, int]]:
    """(address, length) runs of this process's file-backed pages that are mapped (present in its page tables):
    /proc/self/maps for the file mappings, /proc/self/pagemap bit 63 ("page present", Documentation/admin-guide/mm/
    pagemap.rst) for their pages. Empty where /proc does not say (the ranks then count those pages as they touch
    them: a few MB more held)."""
    try:
        return _resident_file_pages()
    except OSError:
        return []


def _resident_file_pages() -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps, open("/proc/self/pagemap", "rb") as pm:
        for line in maps:
            parts = line.split()
            if len(parts) < 6 or not parts[5].startswith("/") or parts[4] == "0":
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            pm.seek(lo // PAGE * 8)
            raw = pm.read((hi - lo) // PAGE * 8)
            start = None
            for i in range(len(raw) // 8):
                present = raw[i * 8 + 7] & 0x80
                if present and start is None:
                    start = i
                elif not present and start is not None:
                    runs.append((lo + start * PAGE, (i - start) * PAGE))
                    start = None
            if start is not None:
                runs.append((lo + start * PAGE, (len(raw) // 8 - start) * PAGE))
    return runs


def populate(runs: list[tuple[int, int]]) -> None:
    """Map these pages into this process's page tables (MADV_POPULATE_READ; nothing where the kernel lacks it)."""
    import ctypes

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for addr, length in runs:
        if madvise(addr, length, MADV_POPULATE_READ) != 0:
            return


class ExitWatch:
    """Every forked rank's exit status: each rank writes "<local rank> <pid>" to a pipe on start; a thread per pid
    waits for it to exit with waitid(WNOWAIT), which reads the status and leaves the process to its reaper."""

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()
        self.codes: dict[int, tuple[int, int]] = {}  # local rank → (pid, exit code; -N for signal N)
        self._waiters: list[threading.Thread] = []
        threading.Thread(target=self._read, name="exit-watch", daemon=True).start()

    def _read(self) -> None:
        with os.fdopen(self.read_fd, "r", encoding="ascii") as announced:
            for line in announced:
                local, pid = map(int, line.split())
                t = threading.Thread(target=self._wait, args=(local, pid), name=f"exit-watch-{local}", daemon=True)
                self._waiters.append(t)
                t.start()

    def _wait(self, local: int, pid: int) -> None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # already reaped: the agent's own report has it
            return
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        self.codes[local] = (pid, code)

    def failures(self, reported: dict) -> dict:
        """torchrun's failures (global rank → ProcessFailure) with every other rank that exited non-zero added."""
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        for t in list(self._waiters):
            t.join(timeout=10)
        if not reported:
            return reported
        some_rank, some = next(iter(reported.items()))
        offset = some_rank - some.local_rank  # this node's first global rank
        known = {f.local_rank for f in reported.values()}
        out = dict(reported)
        for local, (pid, code) in sorted(self.codes.items()):
            if code != 0 and local not in known:
                error_file = str(Path(some.error_file).parent.parent / str(local) / "error.json")
                out[offset + local] = ProcessFailure(local_rank=local, pid=pid, exitcode=code, error_file=error_file)
        return out


def _rss() -> int:
    import torch

    from tasks.device import memory_stats

    return memory_stats(torch.device("cpu"))["allocated_bytes"]


def _no_name_lookups() -> None:
    """A one-node job's rank looks up no name. glibc's resolver keeps a process-wide lock (resolv/resolv_conf.c
    `lock`) that fork does not reset: a rank forked while another agent thread held it inherits it held, and its
    first lookup waits for ever (seen in a `make test` run: rank 3 of 4 in getaddrinfo("localhost") → get_nss_addresses
    → __resolv_context_get → get_locked_global, the other ranks waiting for it in gloo's rendezvous). The store is
    reached by address (a numeric host takes no lock: getaddrinfo converts it before NSS) and gloo's device is the
    loopback interface (GLOO_SOCKET_IFNAME, read by ProcessGroupGloo: getifaddrs, no lookup of the hostname)."""
    if os.environ.get("MASTER_ADDR") != "localhost":  # another node's address: the user's network, untouched
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    loopback = [name for _, name in socket.if_nameindex() if name in ("lo", "lo0")]
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback[0])


def _rank(flag: str, target: str, *args: str) -> None:
    """A forked rank: announce the pid, restore a fresh interpreter's state, run the entry (`-m MODULE` or a script
    path, as torchrun's) as __main__."""
    os.write(_announce_fd, f"{os.environ.get('LOCAL_RANK', '0')} {os.getpid()}\n".encode("ascii"))
    os.close(_announce_fd)
    populate(_resident)  # the libraries' pages the agent had mapped, mapped here too: RSS as an exec'd rank's
    os.environ[FORKED] = "1"
    _no_name_lookups()
    tempfile.tempdir = _ranks_tempdir  # $TMPDIR's, as an exec'd rank's (the agent's points at the log dir)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch._inductor.config as inductor

    inductor.compile_threads = None  # decided again, from this rank's cores, on first use (after its binding)
    sys.argv = [target, *args]
    real_exit = os._exit
    os._exit = _exit_for(os.getpid(), real_exit)
    try:
        if flag == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except _Exited:
        pass  # os._exit(0): success, returned to elastic
    except SystemExit as e:
        if e.code is not None:  # elastic's @record returns on 0 and re-raises the rest: a failure's code stays
            raise
        # sys.exit() / `raise SystemExit`: exit status 0 exec'd (Python's rule for None); forked, the process would
        # end 0 without a return value and the agent wait for it forever (as os._exit(0) above)
    finally:
        os._exit = real_exit  # multiprocessing ends this process with it once elastic has the return value


class _Exited(BaseException):
    """os._exit(0) in a forked rank's main thread, unwound to _rank (past `except Exception`, like an exit)."""


def _exit_for(rank_pid: int, real_exit):
    """os._exit for a forked rank. Elastic's forked ranks must return: a rank that leaves through os._exit(0) sends
    no return value, and the agent waits for it forever (torch/distributed/elastic/multiprocessing/api.py,
    MultiprocessContext._poll: done only when every rank's return value has arrived). Exec'd, os._exit(0) is how the
    workers end (interpreter teardown after destroy_process_group rarely SIGABRTs); forked, it returns. A failure's
    code, another thread's call and the rank's own children (DataLoader workers) keep the real os._exit."""

    def _exit(code: int) -> None:
        if code == 0 and os.getpid() == rank_pid and threading.current_thread() is threading.main_thread():
            sys.stdout.flush()
            sys.stderr.flush()
            raise _Exited
        real_exit(code)

    return _exit


def keep_error_files(log_dir: str | None) -> None:
    """torch.multiprocessing names each rank's error file in this process (spawn.py, start_processes:
    tempfile.NamedTemporaryFile(prefix="pytorch-errorfile-"), unlinked, its name handed to the rank, which writes its
    traceback there when it fails) and never removes one it read: a failed rank left a pytorch-errorfile-*.pickle in
    $TMPDIR for good. With a --log-dir, the agent's temporary files go there, beside elastic's own; the ranks keep
    $TMPDIR (_rank: inductor's cache and the rest of a rank's temporaries stay where an exec'd rank has them)."""
    global _ranks_tempdir
    _ranks_tempdir = tempfile.tempdir
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        tempfile.tempdir = os.path.abspath(log_dir)


def preloads(entry: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What the agent imports for a launch's entry (`MODULE [args]`, or "" and a script; tasks.parallel.affinity's
    `--worker MODULE` looked through): a probe's module with torch and torch.distributed (PROBES), else the trainer's
    (BASE, LAZY)."""
    module = entry[2] if entry[:2] == ["tasks.parallel.affinity", "--worker"] and len(entry) > 2 else entry[0]
    if module in PROBES:
        return ("torch", "torch.distributed", module), ()
    return BASE, LAZY


def preload(base: tuple[str, ...] = BASE, lazy: tuple[str, ...] = LAZY) -> None:
    """Import what every rank runs (base, lazy: preloads), hand lazy's RSS to the ranks (PRELOADED_RSS), note the
    library pages mapped (resident_file_pages), then collect once and freeze it all (no copy-on-collect in the ranks).
    No full collector pass before that one (tasks.procs.full_collections_paused): the imports leave ~300k objects
    that all stay, and the five passes CPython ran over them on the way freed nothing."""
    global _resident
    from tasks.procs import freeze_long_lived, full_collections_paused

    with full_collections_paused():
        for name in base:
            importlib.import_module(name)
        before = _rss()
        for name in lazy:
            importlib.import_module(name)
        os.environ[PRELOADED_RSS] = str(max(0, _rss() - before)) if lazy else "0"
        _resident = resident_file_pages()
    freeze_long_lived()


def main(argv: list[str] | None = None) -> None:
    """torch.distributed.run's command line (the entry a module or a Python script)."""
    global _announce_fd
    import torch.distributed.run as trun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    args = trun.parse_args(argv)
    if args.no_python or args.run_path:
        raise SystemExit(f"{__name__}: the ranks' entry is Python (-m MODULE or a script): no --no-python, --run-path")
    args.start_method = "fork"
    # torch.distributed.run.run()'s rendezvous rules, unchanged
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if trun.parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _python, cmd_args = trun.config_from_args(args)  # cmd_args: -u [-m] MODULE-or-SCRIPT [args]
    entry = cmd_args[1:] if cmd_args[1] == "-m" else ["", *cmd_args[1:]]

    preload(*preloads(entry))
    keep_error_files(args.log_dir)
    watch = ExitWatch()
    _announce_fd = watch.write_fd
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        elastic_launch(config=config, entrypoint=_rank)(*entry)
    except ChildFailedError as e:
        raise ChildFailedError(e.name, watch.failures(e.failures)) from None


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()  # as torchrun's main: the failure report, the root cause's error file
