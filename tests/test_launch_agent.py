"""The forking agent for CPU ranks (tasks/launch/agent.py): what a forked rank holds and restores, every failed rank
in torchrun's report, and a forked rank's RSS counting the libraries' pages its parent had mapped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

RANK_STATE = """
import json, os, signal, sys, tempfile
import tasks.launch.agent as agent  # already imported by the agent: no new import in the rank
import torch._inductor.config as inductor
state = {
    "preloaded": [m for m in agent.BASE + agent.LAZY if m in sys.modules],
    "forked": os.environ.get("LLM_PIPELINE_FORKED_RANK"),
    "preloaded_rss": int(os.environ.get("LLM_PIPELINE_PRELOADED_RSS", "0")),
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "compile_threads": inductor.compile_threads,
    "tempdir": tempfile.gettempdir(),
    "rank": int(os.environ["RANK"]),
    "rss_file": next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("RssFile:")),
    "master_addr": os.environ.get("MASTER_ADDR"),
    "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
}
open(os.path.join(sys.argv[1], f"rank{state['rank']}.json"), "w").write(json.dumps(state))
"""

# rank 1 is killed (no Python exception, no error file); rank 0 raises what a survivor of a lost peer raises; both
# are gone before the agent's next look (--monitor-interval 1), where torch.multiprocessing names the first in rank
# order only
KILLED_AND_SURVIVOR = """
import os, signal
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
"""


def _agent(
    script: Path,
    *args: str,
    nproc: int = 2,
    log_dir: Path | None = None,
    tmpdir: Path | None = None,
    timeout: int = 180,
):
    argv = [sys.executable, "-u", "-m", "tasks.launch.agent", "--standalone", "--nproc-per-node", str(nproc)]
    argv += ["--max-restarts", "0", "--monitor-interval", "1"]
    argv += ["--log-dir", str(log_dir)] if log_dir else []
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.update({"TMPDIR": str(tmpdir)} if tmpdir else {})
    argv += [str(script), *args]
    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_a_forked_rank_holds_the_imports_and_a_fresh_interpreters_handlers(tmp_path):
    script = tmp_path / "state.py"
    script.write_text(RANK_STATE)
    (tmp_path / "tmp").mkdir()
    out = _agent(script, str(tmp_path), log_dir=tmp_path / "elastic", tmpdir=tmp_path / "tmp")
    assert out.returncode == 0, out.stderr[-3000:]
    import tasks.launch.agent as agent

    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["preloaded"] == list(agent.BASE + agent.LAZY) and got["forked"] == "1", got
        assert 20e6 < got["preloaded_rss"] < 300e6, got  # FSDP2, DTensor, DCP, dynamo: ~77 MB here
        # the agent's SIGTERM handler raises SignalException: a rank torchrun stops must die of the signal
        assert got["sigterm_default"] and got["sigint_default"], got
        assert got["compile_threads"] is None, got  # decided from the rank's own cores, not the agent's
        assert got["tempdir"] == str(tmp_path / "tmp"), got  # $TMPDIR's, not the agent's (the log dir)
        assert got["rss_file"] > 40e6, got  # libtorch's pages the agent had mapped (~80 MB; 7 MB unpopulated)
        # no name lookup in a one-node rank: a fork can inherit glibc's resolver lock held (rank 3 of 4 hung in
        # getaddrinfo("localhost") in a `make test` run); the store by address, gloo on the loopback interface
        assert got["master_addr"] == "127.0.0.1" and got["gloo_ifname"] == "lo", got


@pytest.mark.parametrize("end", ["os._exit(0)", "sys.exit()"])
def test_a_rank_that_ends_with_exit_0_is_a_success_not_a_hang(tmp_path, end):
    """os._exit(0): how the workers end exec'd (tasks/train/worker.py, the probe workers); sys.exit() (None): exit
    status 0 exec'd, which elastic's @record does not return on (only on 0). Forked, the agent would wait for their
    return values forever (elastic's MultiprocessContext._poll)."""
    script = tmp_path / "exit0.py"
    script.write_text(f"import os, sys\nopen(os.path.join(sys.argv[1], os.environ['RANK']), 'w').close()\n{end}\n")
    out = _agent(script, str(tmp_path), timeout=60)
    assert out.returncode == 0 and sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".py") == ["0", "1"]


def test_every_failed_rank_is_in_the_report_with_the_killed_one_by_its_signal(tmp_path):
    from tasks.parallel import rank_errors

    script = tmp_path / "fail.py"
    script.write_text(KILLED_AND_SURVIVOR)
    (tmp_path / "tmp").mkdir()
    out = _agent(script, log_dir=tmp_path / "elastic", tmpdir=tmp_path / "tmp")
    assert out.returncode != 0
    # the survivor's traceback file (torch.multiprocessing's) in the launch's log dir, nothing left in $TMPDIR
    assert list((tmp_path / "elastic").glob("pytorch-errorfile-*"))
    assert not list((tmp_path / "tmp").glob("pytorch-errorfile-*"))
    report = dict(rank_errors.torchrun_failures(out.stderr))
    assert report.get(1) == -signal.SIGKILL and 0 in report, out.stderr[-3000:]  # 0: its exception, or SIGTERM
    failures = rank_errors.collect(out.stderr, tmp_path, 0, 2)
    assert rank_errors.root_cause(failures).rank == 1  # the killed rank, not the survivor's collective error


def test_a_forked_process_maps_the_library_pages_its_parent_had():
    """Linux's fork copies no page-table entries of file mappings without anonymous pages (mm/memory.c
    copy_page_range: "Don't copy ptes where a page fault will fill them correctly"), so a forked rank's RSS lacks the
    libraries' pages until it touches them, and those would count as the training's (PhasePeaks); an exec'd rank
    mapped them while importing. populate() maps them at the fork."""
    import torch  # noqa: F401  (libtorch's pages mapped here, as in the agent)

    from tasks.launch import agent

    def rss_file() -> int:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("RssFile:"))

    parent = rss_file()
    runs = agent.resident_file_pages()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: before and after populate(), then gone without the parent's teardown
        before = rss_file()
        agent.populate(runs)
        os.write(w, f"{before} {rss_file()}".encode())
        os._exit(0)
    os.close(w)
    before, after = map(int, os.read(r, 100).split())
    os.waitpid(pid, 0)
    assert before < 0.5 * parent, (before, parent)  # the fork left them out
    assert after > 0.9 * parent, (after, parent)


def test_the_preloaded_modules_count_for_the_first_trainer_only(monkeypatch):
    """Exec'd, a rank imports FSDP2/DTensor/DCP/dynamo while building its first model: that trainer's held figure
    counts them, a later spec's trainer and the export start with them in their baseline. Forked, the agent's RSS for
    them ($LLM_PIPELINE_PRELOADED_RSS) comes off the first baseline only."""
    import torch

    from tasks.parallel.metrics import PRELOADED_RSS, PhasePeaks

    monkeypatch.setenv(PRELOADED_RSS, str(500 << 20))
    first, later = PhasePeaks(torch.device("cpu")), PhasePeaks(torch.device("cpu"))
    assert later.base_bytes - first.base_bytes > 400 << 20  # RSS moves a little between the two; 500 MB came off
    assert PRELOADED_RSS not in os.environ


PRELOAD = """
import gc, json
full = []  # the collector's full (generation 2) passes from here on
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2 and full.append(1))
before = gc.get_threshold()
import tasks.launch.agent as agent
agent.preload()
print(json.dumps({"full": len(full), "frozen": gc.get_freeze_count(), "same": gc.get_threshold() == before}))
"""


def test_the_agent_imports_the_ranks_modules_without_full_collector_passes():
    """agent.preload: torch, FSDP2, DTensor, DCP and dynamo imported with no full collector pass over them (CPython
    ran five, which freed nothing); the one pass is freeze_long_lived's, which then freezes them all; the collector's
    thresholds are CPython's again after it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", PRELOAD], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["full"] == 1, got
    assert got["frozen"] > 200_000 and got["same"], got


@pytest.mark.parametrize(
    "entry, probe",
    [
        (["tasks.parallel.affinity", "--worker", "tasks.train.worker", "--spec", "s.json"], None),
        (["tasks.train.worker", "--spec", "s.json"], None),
        (["", "/tmp/script.py", "arg"], None),
        (["tasks.envcheck.probe_worker", "--kind", "cpu"], "tasks.envcheck.probe_worker"),
        (
            ["tasks.parallel.affinity", "--worker", "tasks.envcheck.crossnode_worker", "--kind", "cpu"],
            "tasks.envcheck.crossnode_worker",
        ),
    ],
)
def test_the_agent_imports_the_trainer_for_every_entry_but_the_env_stages_probes(entry, probe):
    from tasks.launch import agent

    want = (agent.BASE, agent.LAZY) if probe is None else (("torch", "torch.distributed", probe), ())
    assert agent.preloads(entry) == want


PROBE_PRELOAD = """
import json, os, sys
import tasks.launch.agent as agent
agent.preload(*agent.preloads(["tasks.envcheck.probe_worker", "--kind", "cpu"]))
heavy = ["tasks.train.trainer", *agent.LAZY]
print(json.dumps({
    "heavy": [m for m in heavy if m in sys.modules],
    "probe": "tasks.envcheck.probe_worker" in sys.modules,
    "rss": os.environ["LLM_PIPELINE_PRELOADED_RSS"],
}))
"""


def test_a_probes_agent_leaves_the_trainers_modules_out():
    """The env stage's probe ranks run torch.distributed only: their agent imports the probe (and with it torch and
    torch.distributed) and none of the trainer, FSDP2, DTensor, DCP or dynamo (~1 CPU s a launch); no RSS handed on."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE_PRELOAD], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {"heavy": [], "probe": True, "rss": "0"}
