"""Host binding: topology parsed from npu-smi / nvidia-smi in their printed formats (tests/fixtures/env/topo, sources
in its README), the per-rank plan, torchrun's own --numa-binding where the installed torch has it, the loader sized
from the cores, and a real 2-rank gloo job whose ranks report the CPUs they were bound to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.launch import binding
from tasks.parallel import affinity

FIX = Path(__file__).parent / "fixtures" / "env" / "topo"
REPO = Path(__file__).resolve().parent.parent


def test_npu_smi_topo_cpu_affinity():
    aff = binding.parse_topo((FIX / "npu-smi-topo-910b3.txt").read_text())
    assert sorted(aff) == list(range(8))
    assert aff[0] == aff[1] == list(range(144, 168)) and aff[4] == list(range(0, 24)) and aff[7][0] == 48


def test_nvidia_smi_topo_cpu_affinity():
    aff = binding.parse_topo((FIX / "nvidia-smi-topo-4gpu.txt").read_text())
    assert aff == {0: list(range(0, 24)), 1: list(range(24, 48)), 2: list(range(48, 72)), 3: list(range(72, 96))}
    assert binding.parse_topo("no topology here") == {}


def test_cpulist_round_trip_and_sysfs(tmp_path):
    assert binding.parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert binding.format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    dev = tmp_path / "0000:c1:00.0"
    dev.mkdir()
    (dev / "local_cpulist").write_text("144-167\n")
    assert binding.sysfs_affinity({0: "0000:C1:00.0", 1: "0000:C2:00.0"}, root=str(tmp_path)) == {
        0: list(range(144, 168))
    }


def test_plan_splits_shared_affinity_and_follows_visible_devices():
    aff = binding.parse_topo((FIX / "npu-smi-topo-910b3.txt").read_text())
    allowed = list(range(192))
    p = binding.plan("npu", 8, allowed, aff, "npu-smi info -t topo")
    assert p[0]["cpulist"] == "144-155" and p[1]["cpulist"] == "156-167"  # NPU0/1 share 144-167
    assert p[4]["cpulist"] == "0-11" and p[5]["cpulist"] == "12-23"
    assert all(e["source"] == "npu-smi info -t topo" for e in p)
    assert not set(p[0]["cpus"]) & set(p[1]["cpus"])
    # ASCEND_RT_VISIBLE_DEVICES=4,6: local rank 0 is physical NPU4, local rank 1 is NPU6 (alone on 48-71)
    v = binding.plan("npu", 2, allowed, aff, "npu-smi info -t topo", visible=[4, 6])
    assert (v[0]["device"], v[0]["cpulist"], v[1]["device"], v[1]["cpulist"]) == (4, "0-23", 6, "48-71")


def test_cpu_even_split_and_fewer_cores_than_ranks():
    p = binding.plan("cpu", 2, [0, 1, 2, 3], {}, "even split")
    assert [e["cpulist"] for e in p] == ["0-1", "2-3"] and p[0]["source"] == "even split"
    few = binding.plan("cpu", 3, [0, 1], {}, "even split")
    assert [e["cpus"] for e in few] == [[0], [1], [0]]


def test_torchrun_numa_option_read_from_the_installed_torch():
    import torch.distributed.run as run

    has = "--numa-binding" in Path(run.__file__).read_text()
    assert binding.torchrun_numa_flag() is has
    cfg = load_config("ci-tiny")
    assert binding.launch_args(cfg, "cuda") == (["--numa-binding=exclusive"] if has else [])
    assert binding.launch_args(cfg, "npu") == [] and binding.launch_args(cfg, "cpu") == []
    off = load_config("ci-tiny", sets=["hardware.bind_cpus=false"])
    assert binding.entry(cfg) == ["-m", "tasks.parallel.affinity", "--worker", "tasks.train.worker"]
    assert binding.launch_args(off, "cuda") == [] and binding.entry(off) == ["-m", "tasks.train.worker"]
    env = {binding.ENV: "x"}
    assert binding.prepare(off, "cpu", 2, env) is None and binding.ENV not in env


def test_the_entry_point_needs_its_worker_named():
    with pytest.raises(SystemExit, match="expected --worker MODULE"):
        affinity.main(["--spec", "launch.json"])


def test_loader_workers_from_cores_explicit_wins():
    import torch

    cfg = load_config("ci-tiny", sets=["data.loader_workers=-1", "data.prefetch_factor=3"])
    assert affinity.loader_workers(cfg, 1) == 0 and affinity.loader_workers(cfg, 3) == 2
    assert affinity.loader_workers(cfg, 32) == 4
    explicit = load_config("ci-tiny", sets=["data.loader_workers=2"])
    assert affinity.loader_workers(explicit, 1) == 2
    opts = affinity.loader_options(explicit, torch.device("cpu"))
    assert opts["num_workers"] == 2 and opts["pin_memory"] is False and opts["prefetch_factor"] == 2
    assert affinity.loader_options(cfg, torch.device("cuda", 0))["pin_memory"] is True


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
@pytest.mark.parametrize("backend", ["cpu", "npu"], ids=["forked-cpu-ranks", "execd-device-ranks"])
def test_ranks_run_with_the_cpus_of_their_plan(tmp_path, backend):
    """A real torchrun job through the binding entry point, started as `backend`'s ranks are (tasks/launch/torchrun
    .launcher: CPU ranks forked by the agent, device ranks exec'd); the 'worker' module prints the rank's CPU
    affinity."""
    from tasks.launch.torchrun import launcher

    cfg = load_config("ci-tiny")
    (tmp_path / "affinity_probe.py").write_text(
        # One write(2) per line: both ranks share the pipe, and print() writes the text and its newline separately.
        "import json, os\n"
        "cpus = json.dumps(sorted(os.sched_getaffinity(0)))\n"
        "os.write(1, f\"AFFINITY {os.environ['LOCAL_RANK']} {cpus}\\n\".encode())\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]))
    entries = binding.prepare(cfg, "cpu", 2, env)
    out = subprocess.run(
        [
            sys.executable,
            *launcher(backend),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            binding.ENTRY,  # tasks.parallel.affinity: torchrun's entry point when binding
            "--worker",
            "affinity_probe",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = {
        int(ln.split()[1]): json.loads(ln.split(" ", 2)[2])
        for ln in out.stdout.splitlines()
        if ln.startswith("AFFINITY")
    }
    assert seen == {e["local_rank"]: e["cpus"] for e in entries}
    assert "[binding] local rank 0 → CPUs" in out.stderr
