"""Training as a Kubernetes Job on Ascend nodes (hardware.launcher: kubernetes): render, then read the result.

`render()` turns deploy/k8s/train-job.yaml into the manifests of one DAG run (a headless Service and an Indexed
Job: one pod per node, `python -m tasks train` in each with its node rank, torchrun's c10d rendezvous at pod 0).
The Airflow side (dags/k8s_launch.py) submits them with the cncf provider and waits; the pods write the train
stage's result into the run directory on the shared volume, where `collect_result()` reads it. Nothing here talks
to a cluster or imports Airflow, so the rendering is tested on CPU.
"""
from __future__ import annotations

import copy
import hashlib
import re
import shlex
from pathlib import Path

import yaml

from tasks.config import REPO_ROOT, PipelineConfig, get
from tasks.errors import ConfigError, StageError
from tasks.fsutil import atomic_write_text, read_json

TEMPLATE = REPO_ROOT / "deploy" / "k8s" / "train-job.yaml"
NPU_RESOURCE = "huawei.com/Ascend910"
RDZV_PORT = 29400
DEFAULT_NPUS_PER_NODE = 8  # Atlas 800T A2 / A3 training servers


def job_name(dag_id: str, run_id: str, try_number: int = 1) -> str:
    """A DNS-1123 label, unique per DAG run and try, short enough for the `<job>-<index>` pod hostnames."""
    digest = hashlib.sha256(f"{dag_id}/{run_id}/{try_number}".encode()).hexdigest()[:10]
    stem = re.sub(r"[^a-z0-9-]+", "-", dag_id.lower()).strip("-")[:30].strip("-") or "llm"
    return f"{stem}-{digest}"


def pod_command(cfg: PipelineConfig, run_dir: Path, config_file: Path, name: str) -> str:
    hw = cfg.hardware
    nproc = hw.nproc_per_node or DEFAULT_NPUS_PER_NODE
    sets = {"hardware.nnodes": hw.nnodes, "hardware.nproc_per_node": nproc,
            "hardware.rdzv_endpoint": f"{name}-0.{name}:{RDZV_PORT}"}
    # The pods read the whole config as a file (a preset): what the caller set explicitly stays explicit there,
    # so a data.seq_len that differs from the shard set's fails in the pod as it would here.
    from tasks.runner import FROM_SHARD_SET

    sets.update({k: get(cfg, k) for k in FROM_SHARD_SET if k in cfg.explicit})
    args = ["python", "-m", "tasks", "train", "--config", str(config_file), "--run-dir", str(run_dir)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    # The node rank is the pod's completion index, known only inside the pod: left for bash to expand.
    return "exec " + shlex.join(args) + ' --set "hardware.node_rank=$JOB_COMPLETION_INDEX"'


def render(cfg: PipelineConfig, run_dir: str | Path, name: str) -> list[dict]:
    """The Service and Job for one training run; also writes the config the pods read into the run directory."""
    hw = cfg.hardware
    if not hw.k8s_image:
        raise ConfigError("hardware.k8s_image: required with hardware.launcher=kubernetes (the image built from "
                          "docker/Dockerfile.ascend, in a registry the cluster can pull from)")
    run_dir = Path(run_dir)
    config_file = run_dir / "k8s" / f"{name}.yaml"
    pod_cfg = copy.deepcopy(cfg)
    pod_cfg.tracking.uri = ""  # the pods take MLFLOW_TRACKING_URI (and credentials) from the llm-mlflow secret
    atomic_write_text(config_file, yaml.safe_dump(pod_cfg.to_dict(), sort_keys=False))

    service, job = copy.deepcopy(list(yaml.safe_load_all(TEMPLATE.read_text(encoding="utf-8"))))
    labels = {"app.kubernetes.io/part-of": "llm-pipeline", "llm-pipeline/run": name}
    for obj in (service, job):
        obj["metadata"].update(name=name, namespace=hw.k8s_namespace, labels=labels)
    service["spec"]["selector"] = {"job-name": name}
    spec = job["spec"]
    spec["completions"] = spec["parallelism"] = hw.nnodes
    pod = spec["template"]["spec"]
    spec["template"]["metadata"]["labels"] = labels
    pod["subdomain"] = name
    pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"] = {
        "matchLabels": {"job-name": name}}
    container = pod["containers"][0]
    container["image"] = hw.k8s_image
    container["args"] = [pod_command(cfg, run_dir, config_file, name)]
    npus = hw.nproc_per_node or DEFAULT_NPUS_PER_NODE
    container["resources"]["limits"][NPU_RESOURCE] = npus
    container["resources"]["requests"][NPU_RESOURCE] = npus
    env = {e["name"]: e for e in container["env"]}
    env["HCCL_CONNECT_TIMEOUT"]["value"] = str(hw.hccl_connect_timeout)
    env["HCCL_EXEC_TIMEOUT"] = {"name": "HCCL_EXEC_TIMEOUT", "value": str(hw.hccl_exec_timeout)}
    container["env"] = list(env.values())
    return [service, job]


def failure_cause(run_dir: str | Path, name: str, reason: str) -> str:
    """Node 0's own one-line cause (its train.json on the shared volume) when it wrote one."""
    path = Path(run_dir) / "train.json"
    error = read_json(path).get("error") if path.is_file() else None
    return f"training job {name} failed ({reason}): {error}" if error else \
        f"training job {name} failed ({reason}); see `kubectl logs -l job-name={name}`"


def collect_result(run_dir: str | Path, name: str, parent_run_id: str | None = None,
                   tracking_uri: str | None = None) -> dict:
    """Node 0's train result; its MLflow run is attached to the DAG run's parent run."""
    path = Path(run_dir) / "train.json"
    if not path.is_file():
        raise StageError(f"training job {name} completed but wrote no {path} (is the shared volume mounted at the "
                         "same path in the pods and on the Airflow workers?)")
    result = read_json(path)
    if result.get("status") == "failed":
        raise StageError(failure_cause(run_dir, name, "stage failed"), retryable=True)
    if parent_run_id and result.get("mlflow_run_id"):
        import mlflow

        mlflow.MlflowClient(tracking_uri).set_tag(result["mlflow_run_id"], "mlflow.parentRunId", parent_run_id)
    result.update(launcher="kubernetes", k8s_job=name)
    return result
