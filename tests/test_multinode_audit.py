"""The multi-node audit's findings: torchrun's rendezvous puts global rank 0 on hardware.node_rank 0 (the static
rendezvous; c10d ignores --node-rank), a loopback rendezvous endpoint with several nodes is warned about, a torchrun
failure names the log file the train stage wrote, explicit --set parallel.dp/tp/pp survive a what-if plan, a bare
postgresql:// metadata DB is one line naming the driver, and node N's CLI result line and pending config are its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.ports import free_port
from tests.helpers.train_fixture import shards  # noqa: F401


def _cfg(*sets: str):
    from tasks.config import load_config

    return load_config("ci-tiny", sets=["hardware.bind_cpus=false", *sets])


# ---- 4. node_rank 0 holds global rank 0 ---------------------------------------------------------------------------


def test_multinode_argv_is_torchruns_static_rendezvous_with_the_node_rank():
    """Parsed by torchrun's own parser and turned into its launch config: the static backend, whose rendezvous rank
    is --node-rank (c10d ignores it)."""
    from torch.distributed.run import config_from_args, parse_args

    from tasks.launch import torchrun

    cfg = _cfg("hardware.nnodes=2", "hardware.node_rank=1", "hardware.rdzv_endpoint=10.0.0.1:29411")
    for backend, launcher in (("npu", ["-m", "torch.distributed.run"]), ("cpu", ["-u", "-m", torchrun.AGENT])):
        # device ranks: torch.distributed.run; CPU ranks: the forking agent, which takes the same arguments
        argv = torchrun.argv(cfg, 1, [Path("launch.json")], rdzv_id="r1", backend=backend)
        assert argv[1 : 1 + len(launcher)] == launcher
        args = parse_args(argv[1 + len(launcher) :])
        got = (args.rdzv_backend, args.node_rank, args.nnodes, args.rdzv_endpoint)
        assert got == ("static", 1, "2", "10.0.0.1:29411")
        config, _, _ = config_from_args(args)
        assert config.rdzv_backend == "static" and config.rdzv_configs["rank"] == 1
        assert (config.min_nodes, config.max_nodes, config.max_restarts) == (2, 2, 0)
        assert "--standalone" in torchrun.argv(_cfg(), 1, [], rdzv_id="r1", backend=backend)  # one node: unchanged


PROBE = """
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
node = int(os.environ["LLM_TEST_NODE"])
out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "group_rank": int(os.environ["GROUP_RANK"]),
       "sum": t.item(), "mlflow_run_id": os.environ.get("MLFLOW_RUN_ID")}
open(os.path.join(sys.argv[1], f"node{node}.json"), "w").write(json.dumps(out))
dist.destroy_process_group()
"""


def test_two_nodes_on_this_host_put_global_rank_0_on_node_rank_0(tmp_path):
    """Two torchrun agents (nnodes 2, one gloo rank each) on 127.0.0.1, node 1 started first: under c10d the
    earlier process took group rank 0 (participants sorted by host and pid), so global rank 0, and its results and
    metrics.jsonl (which node 0's stage process sends to MLflow), ran on node 1. Now rank 0 is node 0's; neither rank
    is handed an MLflow run, not even one the launcher inherited."""
    from tasks.launch import binding, torchrun

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    port, procs = free_port(), {}
    for node in (1, 0):
        cfg = _cfg("hardware.nnodes=2", f"hardware.node_rank={node}", f"hardware.rdzv_endpoint=127.0.0.1:{port}")
        cfg.tracking.enabled = True
        argv = torchrun.argv(cfg, 1, [], rdzv_id="multinode-test", backend="cpu")  # the forking agent
        entry = binding.entry(cfg)
        start = next(i for i in range(len(argv)) if argv[i : i + len(entry)] == entry)
        argv = argv[:start] + [str(script), str(tmp_path)]
        with pytest.MonkeyPatch.context() as mp:  # a run id this process inherited is not the ranks'
            mp.setenv("MLFLOW_RUN_ID", "run-of-the-caller")
            env = {**torchrun.env(cfg, "cpu", 1), "LLM_TEST_NODE": str(node), "OMP_NUM_THREADS": "1"}
        log = open(tmp_path / f"torchrun-node{node}.log", "w")
        procs[node] = (subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log)
        if node == 1:
            time.sleep(1.0)  # node 1's agent (and its lower pid) first
    for node, (p, log) in procs.items():
        try:
            rc = p.wait(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
            log.close()
        assert rc == 0, (tmp_path / f"torchrun-node{node}.log").read_text()[-3000:]
    got = {n: json.loads((tmp_path / f"node{n}.json").read_text()) for n in (0, 1)}
    assert got[0]["sum"] == got[1]["sum"] == 3.0 and got[0]["world"] == 2  # one job of two ranks
    assert (got[0]["rank"], got[0]["group_rank"]) == (0, 0), got
    assert (got[1]["rank"], got[1]["group_rank"]) == (1, 1), got
    assert got[0]["mlflow_run_id"] is None and got[1]["mlflow_run_id"] is None


# ---- 6. a loopback rendezvous with several nodes; the torchrun log a failure names ----------------------------------


@pytest.mark.parametrize(
    "endpoint, node, nnodes, warned",
    [
        ("127.0.0.1:29400", 0, 2, True),
        ("localhost:29400", 0, 2, True),
        ("[::1]:29400", 1, 2, True),
        ("localhost:29400", 1, 4, True),
        ("10.0.0.1:29400", 1, 2, False),
        ("127.0.0.1:29400", 0, 1, False),  # one node: --standalone, the endpoint is not used
    ],
)
def test_a_loopback_rendezvous_with_several_nodes_is_warned_in_one_line(endpoint, node, nnodes, warned):
    """The env stage's network checks (as its hook calls them): rendezvous_check said ok for 127.0.0.1 with
    nnodes 2, and a node on another host then waited 10 minutes at its own loopback."""
    from tasks.stages import env

    cfg = _cfg(
        "tracking.enabled=false",
        f"hardware.nnodes={nnodes}",
        f"hardware.node_rank={node}",
        f"hardware.rdzv_endpoint={endpoint}",
    )
    facts, checks = {}, []
    env._network_checks(cfg, "cpu", facts, checks)
    found = [c for c in checks if c["name"] == "rendezvous-loopback"]
    assert bool(found) == warned, checks
    if warned:
        (c,) = found
        assert c["status"] == "warn" and "\n" not in c["detail"]
        assert c["detail"].startswith(f"hardware.rdzv_endpoint {endpoint} is a loopback address with hardware.nnodes")
        assert "fix: node 0's address" in c["detail"]


def test_a_multinode_torchrun_failure_names_the_log_file_the_stage_wrote(cfg, tmp_path, shards):
    """Node 0 of two cannot listen on the rendezvous port (something else holds it): torchrun fails at once, and the
    one line named logs/torchrun.log, which a multi-node train stage never writes (torchrun-node0.log)."""
    import socket

    from tasks.errors import StageError
    from tasks.stages import train
    from tests.helpers.train_fixture import configure, context

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        c = configure(
            cfg,
            **{
                "parallel.dp": 2,
                "parallel.tp": 1,
                "parallel.pp": 1,
                "hardware.nproc_per_node": 1,
                "hardware.nnodes": 2,
                "hardware.node_rank": 0,
                "hardware.rdzv_endpoint": f"127.0.0.1:{port}",
                "hardware.bind_cpus": False,
                "train.steps": 1,
            },
        )
        with pytest.raises(StageError) as err:
            train.run(c, context(tmp_path / "run", shards))
    line = str(err.value)
    logs = tmp_path / "run" / "logs"
    assert "see logs/torchrun-node0.log" in line and "\n" not in line, line
    assert (logs / "torchrun-node0.log").is_file() and not (logs / "torchrun.log").exists()


# ---- 7. explicit --set parallel.dp/tp/pp survive a what-if plan ---------------------------------------------------


def _plan(tmp_path, preset: str, sets: list[str], *flags: str):
    import argparse

    from tasks.config import load_config
    from tasks.fsutil import read_json
    from tasks.runner import run_stage
    from tasks.stages.plan import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    cfg = load_config(preset, sets=sets)
    cfg.tracking.enabled = False
    result = run_stage("plan", cfg, tmp_path, args=parser.parse_args(list(flags)))
    return result["parallel"], read_json(result["plan_json"])["plans"]


def test_set_degrees_are_kept_by_a_what_if_plan(tmp_path):
    """`--set parallel.tp=1 parallel.pp=1 --nodes 2`: the what-if once searched tp and pp freely (chose tp 2 × pp 2)
    while training, keeping the --set values, ran tp 1 × pp 1: the plan sized another layout."""
    what_if = ("--cluster", "910b", "--nodes", "2", "--global-batch", "64")
    chosen, plans = _plan(tmp_path / "a", "ci-tiny", ["parallel.tp=1", "parallel.pp=1"], *what_if)
    assert (chosen["dp"], chosen["tp"], chosen["pp"]) == (16, 1, 1)
    assert plans and {(p["tp"], p["pp"]) for p in plans} == {(1, 1)}
    chosen, plans = _plan(tmp_path / "b", "ci-tiny", ["parallel.tp=1"], *what_if, "--tp", "2")  # a flag wins
    assert chosen["tp"] == 2 and {p["tp"] for p in plans} == {2}
    # a mixture of experts: an explicit expert-parallel degree as well
    chosen, plans = _plan(tmp_path / "c", "qwen2-57b-a14b-910b", ["parallel.ep=4"], "--nodes", "8")
    assert chosen["ep"] == 4 and plans and {p["ep"] for p in plans} == {4}


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["parallel.dp=3"], "--set parallel.dp=3: dp 3 does not divide the what-if cluster's 16 devices (2×8); "),
        (
            ["parallel.dp=2", "parallel.tp=2", "parallel.pp=1"],
            "--set parallel.dp=2 parallel.tp=2 parallel.pp=1: dp 2 × tp 2 × pp 1 = 4 is not the what-if cluster's 16",
        ),
        (  # more than the cluster has: "exceeds", not "does not divide"
            ["parallel.dp=16", "parallel.tp=2"],
            "--set parallel.dp=16 parallel.tp=2: dp 16 × tp 2 = 32 exceeds the what-if cluster's 16 devices (2×8); ",
        ),
    ],
)
def test_set_degrees_a_what_if_cluster_cannot_run_are_refused_in_one_line(tmp_path, sets, needle):
    from tasks.errors import StageError

    with pytest.raises(StageError) as err:
        _plan(tmp_path, "ci-tiny", sets, "--cluster", "910b", "--nodes", "2")
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)
    assert "leave them out of this plan's --set" in str(err.value)


# ---- 8. a bare postgresql:// metadata DB: one line naming the driver ------------------------------------------------


def test_a_bare_postgresql_url_is_one_line_naming_the_driver():
    """scripts/check_services.py imported airflow.configuration, whose package start-up builds the metadata DB's
    engine: `postgresql://` (psycopg 3 to SQLAlchemy 2, not installed) was Airflow's traceback, exit 1, no check."""
    port = free_port()
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_services.py")],
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql://airflow:s3cret@127.0.0.1:{port}/airflow",
            "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:{port}/0",
            "AIRFLOW__CELERY__RESULT_BACKEND": f"db+postgresql://airflow:s3cret@127.0.0.1:{port}/airflow",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 3 and "Traceback" not in out.stderr, out.stderr
    assert lines[0] == (
        f"metadata DB at postgresql://airflow@127.0.0.1:{port}/airflow cannot be used: its driver 'psycopg' (for "
        "postgresql://) is not installed; write postgresql+psycopg2:// (the driver installed here) (in "
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN)"
    )
    assert lines[1].startswith(f"Celery broker unreachable at redis://127.0.0.1:{port}/0: ")
    assert lines[2].startswith("Celery result backend at db+postgresql://airflow@")
    assert "postgresql+psycopg2://" in lines[2]
    assert "s3cret" not in out.stderr


# ---- 11. node N's CLI: its result file, its own pending config ------------------------------------------------------

TWO_NODES = ("--set", "hardware.nnodes=2", "hardware.nproc_per_node=1")


class Killed(BaseException):
    """What SIGKILL (or a run still in progress) is to the CLI: nothing after it runs."""


def _main(*argv) -> int:
    from tasks.cli import main

    return main([str(a) for a in argv])


@pytest.fixture
def _no_env_preset(monkeypatch):
    monkeypatch.delenv("LLM_PIPELINE_PRESET", raising=False)


def test_node_1s_result_line_names_the_file_it_wrote(tmp_path, capsys, _no_env_preset):
    run = tmp_path / "D"
    argv = ("plan", "--run-dir", run, "--no-tracking", "--config", "ci-tiny", *TWO_NODES)
    assert _main(*argv, "hardware.node_rank=1") == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"(results in {run}/plan-node1.json)"), out
    assert (run / "plan-node1.json").is_file() and not (run / "plan.json").exists()
    assert _main(*argv, "hardware.node_rank=0") == 0
    assert capsys.readouterr().out.rstrip().endswith(f"(results in {run}/plan.json)")


def test_node_0_does_not_take_node_1s_live_pending_config(tmp_path, monkeypatch, capsys, _no_env_preset):
    """Node 1's stage running (its pending values written, its process alive: a Killed run_stage is the same file
    state) while node 0 starts its own in the shared run directory: node 0 once took node 1's cli-config.pending.json
    as a killed run's config, node rank 1 and all. Each node's pending values are its own now, and the directory's
    cli-config.json stays node 0's."""
    import tasks.runner
    from tasks.cli import CLI_CONFIG_FILE, PENDING_CONFIG_FILE, dag_run_config

    run = tmp_path / "D"
    base = ("plan", "--run-dir", run, "--no-tracking")
    assert _main(*base, "--config", "ci-tiny", *TWO_NODES, "hardware.node_rank=0") == 0
    remembered = json.loads((run / CLI_CONFIG_FILE).read_text())
    real = tasks.runner.run_stage

    def killed(*a, **k):
        raise Killed

    monkeypatch.setattr(tasks.runner, "run_stage", killed)
    with pytest.raises(Killed):  # node 1, with a value of its own, still running (or killed)
        _main(*base, *TWO_NODES, "hardware.node_rank=1", "train.steps=400")
    monkeypatch.setattr(tasks.runner, "run_stage", real)
    assert not (run / PENDING_CONFIG_FILE).exists() and (run / "cli-config.pending-node1.json").is_file()
    capsys.readouterr()
    preset, sets = dag_run_config(str(run), None)  # node 0: the directory's config, not node 1's
    assert (preset, sets) == ("ci-tiny", remembered["sets"]) and sets.get("hardware.node_rank") == "0"
    assert "pending" not in capsys.readouterr().err
    preset, sets = dag_run_config(str(run), None, 1)  # node 1's rerun: its own killed run's values
    assert sets["hardware.node_rank"] == "1" and sets["train.steps"] == "400"
    assert _main(*base, "--set", "hardware.node_rank=0") == 0  # node 0's next stage runs as node 0
    assert (run / "plan.json").is_file() and json.loads((run / CLI_CONFIG_FILE).read_text()) == remembered
    assert (run / "cli-config.pending-node1.json").is_file()  # node 1's, left for node 1
    capsys.readouterr()
    assert _main(*base, "--set", "hardware.node_rank=1") == 0  # node 1's rerun takes and then drops its own
    err = capsys.readouterr().err  # chosen by the --set node rank before the config is loaded (tasks.cli.node_of)
    assert "train.steps=400" in err and "cli-config.pending-node1.json: left by a stage run" in err, err
    assert not (run / "cli-config.pending-node1.json").exists()
    assert json.loads((run / CLI_CONFIG_FILE).read_text()) == remembered  # node 1 never rewrites the directory's
