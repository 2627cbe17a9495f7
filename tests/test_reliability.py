"""Reliability classes of issue 13, each with real processes: the real cause of a rank failure (torchrun error
files), checkpoint verification and fallback, and the other fault classes (see tests/test_bad_inputs.py for the
broad list of bad inputs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.errors import StageError
from tests.helpers.train_fixture import configure, context, shards  # noqa: F401
from tests.helpers.ports import free_port

DP2 = {"parallel.dp": 2, "parallel.tp": 1, "parallel.pp": 1, "hardware.nproc_per_node": 2}
# One rank where the claim does not depend on the rank count (a rank's own exception read from its error file — which
# of several ranks' causes wins is test_rank_cause_from_log_and_retry_policy's; the launcher picks the resume point
# before any rank starts; MLflow is rank 0's alone): one rank (~5 CPU s) less per launch.
DP1 = {"parallel.dp": 1, "parallel.tp": 1, "parallel.pp": 1, "hardware.nproc_per_node": 1}


def _shrunk_vocab(shards, tmp_path, vocab: int = 64):
    """A copy of the shard set whose manifest claims a smaller vocabulary than its token ids use."""
    bad = tmp_path / "shards-small-vocab"
    shutil.copytree(shards, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["vocab_size"] = vocab
    (bad / "manifest.json").write_text(json.dumps(manifest))
    return bad


@pytest.mark.slow
def test_rank_python_exception_is_named_and_not_retried(cfg, tmp_path, shards, monkeypatch):
    """Token ids ≥ the vocabulary: every rank raises IndexError in the embedding; the stage names it, no retry. The
    failed rank's loader worker ends through its own exit: nothing of it left in $TMPDIR."""
    from tasks.stages import train

    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    c = configure(cfg, **DP1, **{"train.steps": 2, "data.loader_workers": 1})
    with pytest.raises(StageError) as err:
        train.run(c, context(tmp_path / "run", _shrunk_vocab(shards, tmp_path)))
    msg = str(err.value)
    assert not err.value.retryable, msg
    assert "\n" not in msg
    assert msg.startswith("rank ") and " failed at step 1: IndexError: " in msg, msg
    assert "not retried" in msg and "error file of rank" in msg, msg
    assert list((tmp_path / "run" / "logs").glob("torchelastic-node0/*/attempt_0/*/error.json"))
    assert not list((tmp_path / "tmp").glob("pymp-*"))


def test_rank_cause_from_log_and_retry_policy(tmp_path):
    """Without an error file the rank log's exception line (of this launch only) is the cause; a peer's
    "connection closed" and torchrun's SIGTERM of the survivors never hide a rank's own exception or SIGKILL."""
    from tasks.parallel import rank_errors
    from tasks.parallel.diagnosis import explain

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-1.log").write_text(
        "Traceback (most recent call last):\n  File \"x\", line 1\nKeyError: 'stale, from an earlier launch'\n"
    )
    offsets = rank_errors.log_offsets(logs)
    with open(logs / "rank-1.log", "a") as f:
        f.write(
            'Traceback (most recent call last):\n  File "w.py", line 9, in setup\n    raise X\n'
            "data_prep.errors.DataPrepError: 3 train shards cannot be split over 4 loader streams\n"
        )
    (logs / "rank-0.log").write_text(
        'Traceback (most recent call last):\n  File "y"\n'
        "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234\n"
    )
    report = (
        "Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 5)\n"
        "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 6)\n"
    )
    failures = rank_errors.collect(report, logs, 0, 2, offsets)
    assert [(f.rank, f.exc_type) for f in failures] == [(1, "data_prep.errors.DataPrepError"), (0, "RuntimeError")]
    assert failures[1].collective and not failures[1].python_exception
    e = explain(tmp_path / "train", 1, report, [], {}, "checkpoint step-2", failures=failures)
    assert not e.retryable and "rank 1 failed at step ?: data_prep.errors.DataPrepError: 3 train shards" in str(e)

    # A SIGKILLed rank (OOM killer, preemption) with a peer that lost its connection: retryable, names the kill.
    killed = [
        rank_errors.RankFailure(0, 1, "RuntimeError", "Connection closed by peer", "log"),
        rank_errors.RankFailure(1, -9),
    ]
    e = explain(tmp_path / "train", 1, "", [], {}, "checkpoint step-2", failures=killed)
    assert e.retryable and str(e).startswith("rank 1 died (killed by SIGKILL)")
    # Only collective errors (a network fault): retryable.
    e = explain(tmp_path / "train", 1, "", [], {}, "step 0", failures=killed[:1])
    assert e.retryable and "Connection closed by peer" in str(e)

    # torch elastic's agent crashed reading a survivor's half-written error file (ProcessFailure.__post_init__ logs
    # "Failed to parse reply file: %s" and re-raises): no end-of-run report; one line says so, not a traceback tail.
    crashed = (
        "E1201 19:02:11.123000 4242 torch/distributed/elastic/multiprocessing/errors/__init__.py:132] Failed to parse "
        "reply file: /r/logs/torchelastic-node0/none_x/attempt_0/0/error.json\nTraceback (most recent call last):\n"
        '  File "/v/bin/torchrun", line 8, in <module>\njson.decoder.JSONDecodeError: Expecting value: line 1 column 1'
    )
    e = explain(tmp_path / "train", 1, crashed, [], {}, "step 0", failures=[])
    assert e.retryable and "crashed reading local rank 0's error file" in str(e) and "JSONDecodeError" not in str(e)


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back_to_newest_verified(cfg, tmp_path, shards, capsys):
    """A truncated shard of the newest checkpoint: the resume skips it (saying so), continues from the one before,
    and the curve equals an uninterrupted run; changed training-shaping config is warned about on resume."""
    from tasks.stages import train
    from tasks.parallel import checkpoint as ckpt
    from tests.helpers.train_fixture import assert_same_curve, losses, reference_losses

    c = configure(cfg, **DP1, **{"train.steps": 4, "train.checkpoint_every": 2, "train.keep_checkpoints": 3})
    run = tmp_path / "run"
    train.run(c, context(run, shards))
    step4 = run / "checkpoints" / "step-4"
    assert ckpt.verify(step4) is None and "files" in ckpt.read_meta(step4)
    victim = sorted(step4.glob("*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert "truncated" in ckpt.verify(step4) and ckpt.latest_verified(run / "checkpoints")[0][0] == 2

    c6 = configure(cfg, **DP1, **{"train.steps": 6, "train.checkpoint_every": 2, "train.keep_checkpoints": 3})
    result = train.run(c6, context(run, shards))
    err = capsys.readouterr().err
    assert f"warning: checkpoint step-4: {victim.name} is truncated or altered" in err, err
    assert "resuming from step-2" in err
    assert result["warnings"] and result["steps"] == 6
    assert_same_curve(losses(run), reference_losses(c6, shards, 6), "step-4 corrupt, resumed from 2", steps=range(1, 7))
    assert ckpt.verify(run / "checkpoints" / "step-4") is None  # rewritten by the resumed run

    # The same run directory with another learning rate: the resume warns and names the change.
    spec = train.prepare(configure(cfg, **DP1, **{"train.steps": 8, "train.lr": 1e-3}), context(run, shards))
    assert any("train.lr: 0.003 → 0.001" in w for w in spec["warnings"]), spec["warnings"]
    assert spec["resume_from"].endswith("step-6")


def test_checkpoint_file_table_split_over_ranks_is_the_whole_table(tmp_path):
    """save() has every rank hash a share of the files: the shares are disjoint and together the whole table."""
    from tasks.parallel.checkpoint import file_table

    for i, size in enumerate([5, 300, 40, 300, 0, 7]):
        (tmp_path / ("sub" if i == 2 else "")).mkdir(exist_ok=True)
        (tmp_path / ("sub" if i == 2 else "") / f"f{i}").write_bytes(bytes([i]) * size)
    (tmp_path / "meta.json").write_text("{}")
    whole = file_table(tmp_path)
    assert sorted(whole) == ["f0", "f1", "f3", "f4", "f5", "sub/f2"]
    shares = [file_table(tmp_path, r, 4) for r in range(4)]
    assert sum(len(s) for s in shares) == len(whole) and {k: v for s in shares for k, v in s.items()} == whole
    assert "f1" in shares[0] and "f3" in shares[1]  # the two largest files go to different ranks


def test_pruning_never_deletes_the_checkpoint_just_saved(tmp_path):
    """Resumed from step-2 below a corrupt step-4 with keep 1: saving step-3 must not prune step-3."""
    from tasks.parallel.checkpoint import CheckpointManager, complete_checkpoints

    for step in (2, 3, 4):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "meta.json").write_text("{}")
    CheckpointManager(tmp_path, 1, 0, {"dp": 0, "tp": 0, "pp": 0}, 1, 1)._prune(3)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [3, 4]


# ---- class 4: environment faults are one line at the top (real CLI processes) --------------------------------------


def cli(*argv, env=None, timeout=180):
    """`python -m tasks …` as a real process; returns (exit status, stderr lines)."""
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    out = subprocess.run(
        [sys.executable, "-m", "tasks", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    return out.returncode, out.stderr.strip().splitlines()


@pytest.fixture
def tiny_fs(tmp_path):
    """mount(opts) → a fresh tmpfs directory (root only; skipped where mounting is not allowed)."""
    import subprocess

    mounted = []

    def mount(opts: str):
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]})")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", str(d)], capture_output=True)


def _read_only_dir(tmp_path, tiny_fs):
    import os

    if os.geteuid() == 0:  # root ignores permission bits: a read-only mount is the real thing
        return tiny_fs("ro,size=64k")
    d = tmp_path / "ro"
    d.mkdir(mode=0o555)
    return d


def test_os_faults_are_one_line_naming_path_and_errno(tmp_path, tiny_fs):
    ro = _read_only_dir(tmp_path, tiny_fs)
    rc, err = cli("plan", "--no-tracking", env={"LLM_PIPELINE_VAR_DIR": str(ro)})
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: cannot create the run directory: {ro}/runs: ") and (
        "(EROFS)" in err[0] or "(EACCES)" in err[0]
    ), err

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    rc, err = cli("plan", "--no-tracking", "--run-dir", str(a_file))
    assert rc == 2 and err == [f"error: --run-dir {a_file} is a file, not a directory; choose another --run-dir"]
    rc, err = cli("plan", "--no-tracking", "--run-dir", str(a_file / "sub"))
    assert rc == 2 and len(err) == 1 and "Not a directory (ENOTDIR)" in err[0]
    assert a_file.read_text() == "x"


def test_disk_full_names_enospc_even_when_the_failure_record_cannot_be_written(tmp_path, tiny_fs):
    full = tiny_fs("size=64k")
    (full / "run").mkdir()
    try:  # fill the filesystem
        with open(full / "fill", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
    except OSError:
        pass
    rc, err = cli("plan", "--no-tracking", "--run-dir", str(full / "run"))
    assert rc == 2, err
    assert err[-1].startswith(f"error: {full / 'run' / 'plan'}") or f"{full / 'run'}" in err[-1], err
    assert "No space left on device (ENOSPC)" in err[-1], err
    assert all("Traceback" not in line for line in err)
    assert err[0].startswith("warning: could not write the failure record") or len(err) == 1


# ---- class 5: what is reused is verified ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.helpers.quant_fixture import tiny_trained

    return tiny_trained(tmp_path_factory.getbasetemp())


def test_corrupt_int8_model_is_named_and_rebuilt(cfg, tiny_model, tmp_path, capsys):
    import argparse

    from tasks.quant.artifact import load_quantized
    from tasks.runner import run_stage

    args = argparse.Namespace(model_dir=str(tiny_model["model_dir"]), shard_dir=str(tiny_model["shard_dir"]))
    cfg.tracking.enabled = False
    # The artifact's checks are under test, not the gate: judge PTQ on a few examples, no QAT after a miss.
    cfg.quantize.qat_on_fail, cfg.evaluate.limit = False, 8
    first = run_stage("quantize", cfg, tmp_path, args=args)
    weights = tmp_path / "quantize" / "model_int8.pt"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(StageError, match=r"model_int8.pt is truncated or altered .* rerun the quantize stage"):
        load_quantized(tmp_path / "quantize")
    again = run_stage("quantize", cfg, tmp_path, args=args)  # same settings: not reused, rebuilt
    assert not again["reused"] and again["int8_mb"] == first["int8_mb"]
    assert "model_int8.pt is truncated or altered" in capsys.readouterr().err
    weights.write_bytes(bytes([good[0] ^ 1]) + weights.read_bytes()[1:])  # right size, altered byte
    with pytest.raises(StageError, match="is corrupt .sha256 differs"):
        load_quantized(tmp_path / "quantize")
    assert not run_stage("quantize", cfg, tmp_path, args=args)["reused"]
    assert run_stage("quantize", cfg, tmp_path, args=args)["reused"]  # intact now: reused
    assert not list(tmp_path.glob(".quantize.*"))  # no temp directories left


def test_altered_shard_bytes_fail_smoke_and_train_when_verify_is_on(cfg, tmp_path, shards):
    """Same size, one byte flipped: with data.verify_sha256 (the DAG turns it on) smoke and train name the shard."""
    from tasks.stages import train
    from tasks.pipeline import config_for_params
    from tasks.stages.smoke import load_batches

    assert config_for_params({}).data.verify_sha256
    bad = tmp_path / "shards"
    shutil.copytree(shards, bad)
    victim = sorted(bad.glob("train-*.tar"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    load_batches(bad, 2, 2, 0, verify=False)  # without the check the bytes would be trained on
    with pytest.raises(StageError, match=f"smoke: shard {victim} is corrupt: sha256 differs"):
        load_batches(bad, 2, 2, 0, verify=True)
    c = configure(cfg, **DP2, **{"data.verify_sha256": True})
    with pytest.raises(StageError, match=f"shards: shard {victim} is corrupt: sha256 differs"):
        train.run(c, context(tmp_path / "run", bad))


def test_swapped_outputs_survive_a_crash_between_the_renames(tmp_path):
    """fsutil.swap_dir: old aside, new in, old deleted; recover_dir undoes a crash in between, drops temp dirs."""
    from tasks.fsutil import recover_dir, swap_dir

    final = tmp_path / "hf"
    final.mkdir()
    (final / "v").write_text("1")
    new = tmp_path / ".hf.abc"
    new.mkdir()
    (new / "v").write_text("2")
    swap_dir(new, final)
    assert (final / "v").read_text() == "2" and not new.exists() and not (tmp_path / ".hf.old").exists()
    final.rename(tmp_path / ".hf.old")  # a crash after "old aside", before "new in"
    (tmp_path / ".hf.xyz").mkdir()  # and a killed writer's temp directory
    recover_dir(final)
    assert (final / "v").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# ---- class 6: processes and concurrency ------------------------------------------------------------------------------


def _procs_mentioning(text: str) -> list[tuple[int, str]]:
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and int(pid) != os.getpid():
            found.append((int(pid), cmd[:120]))
    return found


def test_second_writer_is_refused_naming_the_holder(tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from tasks.procs import RunDirLock\n"
            f"with RunDirLock({str(run)!r}, 'train'):\n print('held', flush=True); time.sleep(60)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, err = cli("plan", "--no-tracking", "--run-dir", str(run))
        assert rc == 2 and len(err) == 1, err
        assert (
            err[0].startswith(f"error: run directory {run} is in use by pid {holder.pid} on ")
            and "(stage train, since " in err[0]
            and "use another --run-dir" in err[0]
        ), err
        assert not (run / "plan.json").exists()
    finally:
        holder.kill()
        holder.wait()
    rc, err = cli("plan", "--no-tracking", "--run-dir", str(run))  # the kernel dropped the dead holder's lock
    assert rc == 0 and (run / "plan.json").is_file(), err


@pytest.mark.slow
def test_kill_9_of_the_train_stage_leaves_no_orphans(tmp_path, shards):
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import REPO
    from tests.helpers.train_fixture import BASE

    run = tmp_path / "run"
    sets = {**BASE, **DP2, "train.steps": 100000, "train.checkpoint_every": 0}
    argv = [
        sys.executable,
        "-m",
        "tasks",
        "train",
        "--no-tracking",
        "--no-export",
        "--run-dir",
        str(run),
        "--shard-dir",
        str(shards),
    ] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    parent = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (
            (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2
        ):
            time.sleep(0.5)
        assert (run / "metrics.jsonl").is_file(), "training never started"
        assert len(_procs_mentioning(str(run / "train" / "launch.json"))) >= 3  # torchrun + 2 ranks
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.time() + 45
    while time.time() < deadline and _procs_mentioning(str(run / "train" / "launch.json")):
        time.sleep(0.5)
    left = _procs_mentioning(str(run / "train" / "launch.json"))
    for pid, _ in left:  # do not leak them into the rest of the suite
        __import__("os").kill(pid, signal.SIGKILL)
    assert not left, f"orphans after kill -9 of the stage: {left}"
    from tasks.procs import RunDirLock

    with RunDirLock(run, "train"):  # and the run directory is free for the rerun
        pass


# ---- class 3: an MLflow outage never blocks training --------------------------------------------------------------


def _mlflow_server(port: int, store, artifacts, **env):
    import os
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    mlflow_bin = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen(
        [
            str(mlflow_bin),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{store}",
            "--default-artifact-root",
            str(artifacts),
        ],
        stdout=open(Path(store).with_suffix(f".{port}.log"), "a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **env},  # no GenAI job runner (ui.sh)
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return proc
        except OSError:
            assert proc.poll() is None, Path(store).with_suffix(f".{port}.log").read_text()[-2000:]
            time.sleep(0.5)
    raise AssertionError("mlflow server did not answer in 120 s")


def test_a_server_that_refuses_the_uris_host_name_is_named_before_the_stage(tmp_path):
    """A real `mlflow server` that does not allow the name workers use for it (compose's `mlflow:5000` was refused by
    MLflow's default allow-list): /health answers (it is exempt), every logging call got 403. The reachability check
    now names the host and the flag."""
    from tasks.errors import StageError
    from tasks.tracking import check_reachable

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = _mlflow_server(port, tmp_path / "m.db", tmp_path / "art", MLFLOW_SERVER_ALLOWED_HOSTS="mlflow:5000")
    try:
        with pytest.raises(StageError, match=rf"refuses the host name '127.0.0.1:{port}' \(403 Invalid Host header\)"):
            check_reachable(uri)
    finally:
        _kill_group(server)  # a server that allows the name: every test on a real server passes check_reachable


def _kill_group(proc) -> None:
    import os
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.mark.slow
def test_mlflow_killed_mid_training_loses_no_metric(tmp_path, shards):
    """A real `mlflow server` is SIGKILLed while training runs: training finishes in bounded time, every step is in
    metrics.jsonl, and after the server is back the next stage sends the missing steps to the same MLflow run."""
    import json
    import os
    import subprocess
    import sys
    import time

    import mlflow

    from tests.helpers import REPO
    from tests.helpers.train_fixture import BASE

    port, store, art = free_port(), tmp_path / "mlflow.db", tmp_path / "mlartifacts"
    uri = f"http://127.0.0.1:{port}"
    server = _mlflow_server(port, store, art)
    run = tmp_path / "run"
    # The server dies after step 3: the rest without it, then the backfill of every step. A debug step is ~20 ms: 45
    # steps leave the 0.1 s poller a second or more to see step 3 on a busy host before training ends.
    steps = 48
    sets = {
        **BASE,
        **DP1,
        "train.steps": steps,
        "tracking.uri": uri,
        "tracking.experiment": "outage",
        "tracking.artifact_root": str(art),
    }
    argv = [
        sys.executable,
        "-m",
        "tasks",
        "train",
        "--no-export",
        "--run-dir",
        str(run),
        "--shard-dir",
        str(shards),
    ] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    train = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        metrics = run / "metrics.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
            time.sleep(0.1)
        _kill_group(server)
        killed_at = metrics.read_text().count("\n")
        assert killed_at < steps, "training ended before the server was killed: raise steps"
        out, err = train.communicate(timeout=300)
    finally:
        if train.poll() is None:
            train.kill()
        _kill_group(server)
    assert train.returncode == 0, err[-2000:]
    assert "MLflow unreachable at the end of the stage" in err, err[-2000:]
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == list(range(1, steps + 1))
    assert (run / "tracking-pending.json").is_file()

    server = _mlflow_server(port, store, art)  # back, same store
    try:
        plan = subprocess.run(
            [sys.executable, "-m", "tasks", "plan", "--run-dir", str(run)]
            + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert plan.returncode == 0, plan.stderr[-2000:]
        run_id = json.loads((run / "train.json").read_text())["mlflow_run_id"]
        history = mlflow.MlflowClient(uri).get_metric_history(run_id, "train/loss")
        ended = mlflow.MlflowClient(uri).get_run(run_id)
        client = mlflow.MlflowClient(uri)
        names = {a.path for a in client.list_artifacts(run_id)} | {
            a.path for a in client.list_artifacts(run_id, "train")
        }
    finally:
        _kill_group(server)
    want = {json.loads(ln)["step"]: json.loads(ln)["loss"] for ln in metrics.read_text().splitlines()}
    assert sorted(m.step for m in history) == list(range(1, steps + 1)), f"killed at step {killed_at}"
    assert all(m.value == pytest.approx(want[m.step]) for m in history)
    assert not (run / "tracking-pending.json").exists()
    # dead through the end of the stage: its final metrics and its status were kept pending and sent too
    assert ended.info.status == "FINISHED" and ended.info.end_time
    assert ended.data.metrics["train.final_loss"] == pytest.approx(want[steps])
    # and its status tag: a run FINISHED without `pipeline.status` is one the comparison views cannot place
    assert ended.data.tags.get("pipeline.status") == json.loads((run / "train.json").read_text())["status"]
    # and its closing artifacts: the per-step metrics file, the loss plot, the per-rank memory table
    assert {"metrics.jsonl", "train/loss.png", "train/memory.json"} <= names, names


def test_pending_final_metrics_and_status_are_replayed_in_order(tmp_path, mlflow_uri):
    """What a dead MLflow could not take at the end of a stage (final metrics, then the run's status) is sent by
    flush_pending; an entry that still fails keeps the later entries of the same run pending (status last)."""
    import mlflow

    from tasks import tracking

    client = mlflow.MlflowClient(mlflow_uri)
    exp = client.create_experiment("pending-replay")
    done, stuck = client.create_run(exp).info.run_id, client.create_run(exp).info.run_id
    dead = "http://127.0.0.1:9"  # discard port: nothing answers
    tracking.defer(tmp_path, {"uri": mlflow_uri, "run_id": done, "final": {"train.final_loss": 1.5}})
    tracking.defer(tmp_path, {"uri": dead, "run_id": stuck, "final": {"train.final_loss": 2.0}})
    tracking.defer(tmp_path, {"uri": mlflow_uri, "run_id": stuck, "status": "FINISHED", "end_ms": 2000})
    tracking.defer(tmp_path, {"uri": mlflow_uri, "run_id": done, "tags": {"pipeline.error": "rank 1 died"}})
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "loss.png").write_bytes(b"png")
    files = [[str(tmp_path / "train" / "loss.png"), "train"], [str(tmp_path / "gone.jsonl"), None]]
    table = [["train/memory.json", [["phase", ["init"]], ["peak_gb", [1.5]]]]]  # as log_artifacts_or_defer keeps it
    tracking.defer(tmp_path, {"uri": mlflow_uri, "run_id": done, "files": files, "tables": table})
    tracking.defer(tmp_path, {"uri": mlflow_uri, "run_id": done, "status": "FAILED", "end_ms": 1000})
    tracking.flush_pending(tmp_path)
    r = client.get_run(done)
    assert (r.info.status, r.info.end_time, r.data.metrics["train.final_loss"]) == ("FAILED", 1000, 1.5)
    assert r.data.tags["pipeline.error"] == "rank 1 died"  # a failed stage's cause, sent with its status
    # its artifacts too (a file removed since is skipped, not a reason to keep the rest pending)
    assert {a.path for a in client.list_artifacts(done, "train")} == {"train/loss.png", "train/memory.json"}
    got = json.loads(Path(client.download_artifacts(done, "train/memory.json", str(tmp_path))).read_text())
    assert (got["columns"], got["data"]) == (["phase", "peak_gb"], [["init", 1.5]])  # MLflow's table format
    assert client.get_run(stuck).info.status == "RUNNING"
    left = json.loads((tmp_path / tracking.PENDING).read_text())
    assert [e["run_id"] for e in left] == [stuck, stuck] and left[-1]["status"] == "FINISHED"
