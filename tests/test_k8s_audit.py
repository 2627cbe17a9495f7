"""The Kubernetes launch path and the health DAG, as an audit found them wanting: an earlier try's result is never
taken for this job's, CPU pods ask for no accelerator and mount no Ascend paths, the rendezvous port is the
configured one (or refused where the operator sets it), k8s_kind trainjob refuses volcano in one line, the health
task goes to the device queue, and the committed Job manifest's own command fits its 16 ranks."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.config import ConfigError, apply_overrides, load_config
from tasks.errors import StageError
from tasks.launch import k8s_job, k8s_submit

from tests.helpers.k8s_api import POD_NAMES, RecordedApi, connected, on_kubernetes
from tests.helpers.k8s_schema import validate

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def k8s_cfg(cfg):
    on_kubernetes(cfg).tracking.enabled = False
    return cfg


@pytest.fixture
def api_server(tmp_path, monkeypatch):
    api = RecordedApi(validate, {"job": ["job-running", "job-complete"]})
    yield connected(api, tmp_path, monkeypatch)
    api.close()


def _run(cfg, run_id: str, try_number: int):
    return k8s_submit.run_stage_job("train", cfg, "llm_pipeline", run_id, try_number, "k8s_loopback", poll_s=0.05)


def test_an_earlier_trys_failure_is_not_this_jobs_cause(k8s_cfg, api_server):
    """Try 1's node 0 wrote its cause; try 2's pods are OOM-killed before node 0 writes anything: try 2's line names
    its own failed pod, not try 1's cause, and try 1's result is kept aside (k8s/train.before-<job>.json)."""
    from tasks.runner import default_run_dir

    run_dir = default_run_dir("llm_pipeline", "manual__1")
    run_dir.mkdir(parents=True)
    old = {"status": "failed", "error": "train: try 1's own cause"}
    (run_dir / "train.json").write_text(json.dumps(old))
    api_server.replies = {"job": ["job-running", "job-failed"]}
    api_server.pods = "podlist-failed"
    with pytest.raises(StageError) as err:
        _run(k8s_cfg, "manual__1", 2)
    name = k8s_job.job_name("llm_pipeline", "manual__1", 2)
    line = str(err.value)
    assert "try 1's own cause" not in line, line
    assert f"{name}-{POD_NAMES['job'][1]} Failed (exit 137 OOMKilled)" in line
    assert json.loads((run_dir / "k8s" / f"train.before-{name}.json").read_text()) == old
    assert not (run_dir / "train.json").exists()


def test_an_earlier_trys_result_is_not_collected_as_this_jobs(k8s_cfg, api_server):
    """Try 1 wrote an ok result (its task failed after); try 2's job completes but its pods wrote nothing: that is
    a failure naming the missing file, not try 1's result passed off as try 2's."""
    from tasks.runner import default_run_dir

    run_dir = default_run_dir("llm_pipeline", "manual__2")
    run_dir.mkdir(parents=True)
    (run_dir / "train.json").write_text(json.dumps({"status": "ok", "summary": "try 1's result"}))
    with pytest.raises(StageError, match=r"completed but wrote no .*train\.json"):
        _run(k8s_cfg, "manual__2", 2)
    # and this try's own result is the one taken
    api_server.on_done = lambda obj: (run_dir / "train.json").write_text(json.dumps({"status": "ok", "summary": "3"}))
    assert _run(k8s_cfg, "manual__2", 3)["summary"] == "3"


def _pod(manifest: dict) -> dict:
    kind = manifest["kind"]
    if kind == "PyTorchJob":
        return manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    if kind == "TrainJob":  # the trainer's container, the patch's volumes and mounts
        rj = manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        patch = rj["template"]["spec"]["template"]["spec"]
        trainer = manifest["spec"]["trainer"]
        container = {"resources": trainer["resourcesPerNode"], "volumeMounts": patch["containers"][0]["volumeMounts"]}
        return {"containers": [container], "volumes": patch["volumes"]}
    return manifest["spec"]["template"]["spec"]


@pytest.mark.parametrize("kind", ["job", "pytorchjob", "trainjob"])
@pytest.mark.parametrize("stage", ["train", "smoke"])
def test_cpu_pods_request_no_accelerator_and_mount_no_ascend_paths(k8s_cfg, tmp_path, kind, stage):
    """device cpu: no device plugin's resource (a CPU pod would wait for NPUs it never uses) and none of the Ascend
    host paths (absent on a CPU node: the pod would not start); npu keeps both, cuda asks for GPUs. The torchrun
    stages still start nproc_per_node processes per pod."""
    k8s_cfg.hardware.k8s_kind = kind

    def rendered(device: str) -> dict:
        k8s_cfg.hardware.device = device
        manifests = k8s_job.render(k8s_cfg, tmp_path / "run", "llm-x", stage)
        for m in manifests:
            validate(m)
        return manifests[-1]

    extended = (k8s_job.NPU_RESOURCE, k8s_job.GPU_RESOURCE)
    manifest = rendered("cpu")
    pod = _pod(manifest)
    resources = pod["containers"][0]["resources"]
    assert not {k for part in ("limits", "requests") for k in resources.get(part, {})} & set(extended), resources
    names = {v["name"] for v in pod["volumes"]} | {m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert not names & set(k8s_job.ASCEND_MOUNTS) and "var" in names
    if manifest["kind"] == "PyTorchJob":
        assert manifest["spec"]["nprocPerNode"] == "8"
    elif manifest["kind"] == "TrainJob":
        assert manifest["spec"]["trainer"]["numProcPerNode"] == 8
    npus = 8 if stage == "train" else 1
    pod = _pod(rendered("npu"))
    assert pod["containers"][0]["resources"]["limits"][k8s_job.NPU_RESOURCE] == npus
    assert set(k8s_job.ASCEND_MOUNTS) <= {v["name"] for v in pod["volumes"]}
    pod = _pod(rendered("cuda"))
    assert pod["containers"][0]["resources"]["limits"] == {k8s_job.GPU_RESOURCE: npus}


def test_the_rendezvous_port_is_the_configured_one(k8s_cfg, tmp_path):
    """hardware.rdzv_endpoint's port (its host is pod 0's under Kubernetes): the Service's port and target, the
    container's port and torchrun's endpoint in the command; a PyTorchJob's master port (the operator's MASTER_PORT
    comes from the container port named pytorchjob-port)."""
    apply_overrides(k8s_cfg, {"hardware.rdzv_endpoint": "10.0.0.1:29555"})
    service, job = k8s_job.render(k8s_cfg, tmp_path / "run", "llm-x", "train")
    validate(service), validate(job)
    assert service["spec"]["ports"] == [{"name": "rendezvous", "port": 29555, "targetPort": 29555}]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"] == [{"name": "rendezvous", "containerPort": 29555}]
    assert "--set hardware.rdzv_endpoint=llm-x-0.llm-x:29555 " in container["args"][0]
    apply_overrides(k8s_cfg, {"hardware.k8s_kind": "pytorchjob"})
    (obj,) = k8s_job.render(k8s_cfg, tmp_path / "run", "llm-x", "train")
    for role in ("Master", "Worker"):
        ports = obj["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]["ports"]
        assert ports == [{"name": "pytorchjob-port", "containerPort": 29555}]
    apply_overrides(k8s_cfg, {"hardware.k8s_kind": "job", "hardware.rdzv_endpoint": "127.0.0.1:29400"})
    service, job = k8s_job.render(k8s_cfg, tmp_path / "run", "llm-x", "train")
    assert service["spec"]["ports"][0]["port"] == 29400 and "llm-x-0.llm-x:29400" in str(job)


def _one_line(err) -> str:
    line = str(err.value)
    assert "\n" not in line.strip(), line
    return line


def test_trainjob_refuses_volcano_and_a_port_it_cannot_apply(k8s_cfg):
    """A TrainJob has no field for Volcano (its gang scheduling is the ClusterTrainingRuntime's) and its runtime sets
    the rendezvous port: each is refused in one line when the config is made, not dropped at render time."""
    base = {"hardware.launcher": "kubernetes", "hardware.k8s_kind": "trainjob"}
    with pytest.raises(ConfigError) as err:
        apply_overrides(k8s_cfg, {**base, "hardware.k8s_scheduler": "volcano"})
    line = _one_line(err)
    assert "hardware.k8s_scheduler: volcano" in line and "trainjob" in line and "pytorchjob" in line
    with pytest.raises(ConfigError) as err:
        apply_overrides(k8s_cfg, {**base, "hardware.rdzv_endpoint": "10.0.0.1:29555"})
    line = _one_line(err)
    assert "hardware.rdzv_endpoint" in line and "PET_MASTER_PORT" in line and "29400" in line
    # what stays allowed: volcano with the other kinds, trainjob with the default scheduler and port, local runs
    for ok in (
        {**base, "hardware.k8s_kind": "pytorchjob", "hardware.k8s_scheduler": "volcano"},
        {**base, "hardware.k8s_kind": "job", "hardware.rdzv_endpoint": "10.0.0.1:29555"},
        {**base, "hardware.k8s_scheduler": "default", "hardware.rdzv_endpoint": "10.0.0.1:29400"},
        {**base, "hardware.launcher": "local", "hardware.k8s_scheduler": "volcano"},
    ):
        apply_overrides(load_config("demo-cpu"), ok)


def test_the_health_task_goes_to_the_device_queue(tmp_path):
    """dags/llm_health.py parsed by Airflow's DagBag: with a site preset naming hardware.device_queue (launcher
    local) the health task is on that queue, as the device stages are; without one, on Airflow's default queue."""
    preset = yaml.safe_load((REPO / "configs" / "ci-tiny.yaml").read_text())
    preset["hardware"]["device_queue"] = "npu-node-1"
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(preset))
    code = (
        "import json, os, sys; from airflow.dag_processing.dagbag import DagBag\n"
        "out = {}\n"
        "for preset in sys.argv[1:]:\n"
        "    os.environ['LLM_PIPELINE_PRESET'] = preset\n"
        f"    bag = DagBag(dag_folder={str(REPO / 'dags' / 'llm_health.py')!r})\n"
        "    assert not bag.import_errors, bag.import_errors\n"
        "    out[preset] = bag.dags['llm_health'].get_task('health').queue\n"
        "print(json.dumps(out))"
    )
    presets = [str(tmp_path / "site.yaml"), "ci-tiny"]
    out = subprocess.run([sys.executable, "-c", code, *presets], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    queues = json.loads(out.stdout.strip().splitlines()[-1])
    assert queues == {presets[0]: "npu-node-1", "ci-tiny": "default"}


def test_the_committed_job_manifests_command_fits_its_ranks():
    """deploy/k8s/train-job.yaml by hand: the config its command names, with its --set values, loads, and a layout it
    pins multiplies to the Job's ranks (completions x the pod's NPUs); the shard set it needs is named in its header."""
    from tasks.layout import known_world

    text = (REPO / "deploy" / "k8s" / "train-job.yaml").read_text()
    _, job = yaml.safe_load_all(text)
    container = job["spec"]["template"]["spec"]["containers"][0]
    words = shlex.split(container["args"][0])
    assert words[:4] == ["exec", "python", "-m", "tasks"]
    sets = dict(w.split("=", 1) for w, flag in zip(words[1:], words) if flag == "--set" and "$" not in w)
    cfg = load_config(words[words.index("--config") + 1])
    apply_overrides(cfg, sets)
    ranks = job["spec"]["completions"] * container["resources"]["limits"][k8s_job.NPU_RESOURCE]
    assert cfg.hardware.nnodes * cfg.hardware.nproc_per_node == ranks == 16
    assert cfg.hardware.launcher == "local" and cfg.hardware.device in ("npu", "auto")
    assert known_world(cfg, None) in (None, ranks), cfg.parallel
    assert "works as-is" not in text
    run_dir = words[words.index("--run-dir") + 1]
    assert re.search(rf"python -m tasks \$s .*\n.*--run-dir {re.escape(run_dir)}", text)  # shard, plan there first
