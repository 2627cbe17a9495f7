"""Device stages as Kubernetes Jobs on the Ascend nodes (hardware.launcher: kubernetes): render, then read the result.

`render()` turns deploy/k8s/train-job.yaml into the manifests of one stage of one DAG run: for the multi-node stages
(env probe, train, profile) a headless Service and an Indexed Job with one pod per node, `python -m tasks <stage>` in
each with its node rank and torchrun's c10d rendezvous at pod 0; for smoke, quantize and evaluate one pod. With
hardware.k8s_scheduler=volcano the pods are gang-scheduled: a Volcano PodGroup with minMember = pods, schedulerName
volcano and the group annotation. The Job's activeDeadlineSeconds is the stage's bound (tasks/bounds.py) plus
timeouts.k8s_pending_s. The Airflow side (dags/k8s_launch.py) submits them with the cncf provider and waits; the
pods write `<stage>.json` into the run directory on the shared volume, where `collect_result()` reads it. Nothing
here talks to a cluster or imports Airflow, so the rendering is tested on CPU.
"""

from __future__ import annotations

import copy
import hashlib
import re
import shlex
import time
from pathlib import Path

import yaml

from tasks.config import REPO_ROOT, PipelineConfig, get
from tasks.errors import ConfigError, StageError
from tasks.fsutil import atomic_write_text, read_json
from tasks.launcher import MULTI_NODE_STAGES

TEMPLATE = REPO_ROOT / "deploy" / "k8s" / "train-job.yaml"
NPU_RESOURCE = "huawei.com/Ascend910"
RDZV_PORT = 29400
DEFAULT_NPUS_PER_NODE = 8  # Atlas 800T A2 / A3 training servers


VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"  # Volcano's KubeGroupNameAnnotationKey
PODGROUP_API = ("scheduling.volcano.sh", "v1beta1", "podgroups")


def job_name(dag_id: str, run_id: str, try_number: int = 1, stage: str = "train") -> str:
    """A DNS-1123 label, unique per DAG run, stage and try, short enough for the `<job>-<index>` pod hostnames."""
    key = f"{dag_id}/{run_id}/{try_number}" + ("" if stage == "train" else f"/{stage}")
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    stem = re.sub(r"[^a-z0-9-]+", "-", dag_id.lower()).strip("-")[:30].strip("-") or "llm"
    return f"{stem}-{digest}"


def pods(stage: str, cfg: PipelineConfig) -> int:
    return cfg.hardware.nnodes if stage in MULTI_NODE_STAGES else 1


def pod_command(cfg: PipelineConfig, run_dir: Path, config_file: Path, name: str, stage: str = "train") -> str:
    hw = cfg.hardware
    n = pods(stage, cfg)
    nproc = (hw.nproc_per_node or DEFAULT_NPUS_PER_NODE) if n > 1 or stage in MULTI_NODE_STAGES else 1
    sets = {"hardware.nnodes": n, "hardware.nproc_per_node": nproc, "hardware.launcher": "local"}
    if n > 1:
        sets["hardware.rdzv_endpoint"] = f"{name}-0.{name}:{RDZV_PORT}"
    # The pods read the whole config as a file (a preset): what the caller set explicitly stays explicit there,
    # so a data.seq_len that differs from the shard set's fails in the pod as it would here.
    from tasks.runner import FROM_SHARD_SET

    sets.update({k: get(cfg, k) for k in FROM_SHARD_SET if k in cfg.explicit})
    args = ["python", "-m", "tasks", stage, "--config", str(config_file), "--run-dir", str(run_dir)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    if n == 1:
        return "exec " + shlex.join(args + ["--set", "hardware.node_rank=0"])
    # The node rank is the pod's completion index, known only inside the pod: left for bash to expand.
    return "exec " + shlex.join(args) + ' --set "hardware.node_rank=$JOB_COMPLETION_INDEX"'


def deadline_s(stage: str, cfg: PipelineConfig, run_dir) -> int:
    """The Job's activeDeadlineSeconds: the stage's bound plus the time its pods may wait to be scheduled."""
    from tasks.bounds import stage_timeout_s

    return stage_timeout_s(stage, cfg, run_dir) + cfg.timeouts.k8s_pending_s


def podgroup(name: str, namespace: str, labels: dict, min_member: int) -> dict:
    """A Volcano PodGroup: none of the stage's pods starts until all `min_member` can (gang scheduling)."""
    group, version, _ = PODGROUP_API
    return {
        "apiVersion": f"{group}/{version}",
        "kind": "PodGroup",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"minMember": min_member},
    }


def render(cfg: PipelineConfig, run_dir: str | Path, name: str, stage: str = "train") -> list[dict]:
    """The manifests of one stage's Job ([Service,] [PodGroup,] Job); also writes the config the pods read into the
    run directory. Multi-node stages get the rendezvous Service; volcano adds the PodGroup."""
    from tasks.launcher import DEVICE_STAGES

    hw = cfg.hardware
    if stage not in DEVICE_STAGES:
        raise ConfigError(f"stage {stage!r} runs on the Airflow worker, not as a Kubernetes Job")
    if not hw.k8s_image:
        raise ConfigError(
            "hardware.k8s_image: required with hardware.launcher=kubernetes (the image built from "
            "docker/Dockerfile.ascend, in a registry the cluster can pull from)"
        )
    run_dir = Path(run_dir)
    config_file = run_dir / "k8s" / f"{name}.yaml"
    pod_cfg = copy.deepcopy(cfg)
    pod_cfg.tracking.uri = ""  # the pods take MLFLOW_TRACKING_URI (and credentials) from the llm-mlflow secret
    atomic_write_text(config_file, yaml.safe_dump(pod_cfg.to_dict(), sort_keys=False))

    service, job = copy.deepcopy(list(yaml.safe_load_all(TEMPLATE.read_text(encoding="utf-8"))))
    n = pods(stage, cfg)
    labels = {"app.kubernetes.io/part-of": "llm-pipeline", "llm-pipeline/run": name, "llm-pipeline/stage": stage}
    for obj in (service, job):
        obj["metadata"].update(name=name, namespace=hw.k8s_namespace, labels=labels)
    service["spec"]["selector"] = {"job-name": name}
    spec = job["spec"]
    spec["completions"] = spec["parallelism"] = n
    spec["activeDeadlineSeconds"] = deadline_s(stage, cfg, run_dir)
    pod = spec["template"]["spec"]
    spec["template"]["metadata"]["labels"] = labels
    container = pod["containers"][0]
    container["name"] = stage
    container["image"] = hw.k8s_image
    container["args"] = [pod_command(cfg, run_dir, config_file, name, stage)]
    npus = (hw.nproc_per_node or DEFAULT_NPUS_PER_NODE) if stage in MULTI_NODE_STAGES else 1
    container["resources"]["limits"][NPU_RESOURCE] = npus
    container["resources"]["requests"][NPU_RESOURCE] = npus
    env = {e["name"]: e for e in container["env"]}
    env["HCCL_CONNECT_TIMEOUT"]["value"] = str(hw.hccl_connect_timeout)
    env["HCCL_EXEC_TIMEOUT"] = {"name": "HCCL_EXEC_TIMEOUT", "value": str(hw.hccl_exec_timeout)}
    container["env"] = list(env.values())
    out = []
    if n > 1:
        pod["subdomain"] = name
        pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"] = {
            "matchLabels": {"job-name": name}
        }
        out.append(service)
    else:  # one pod: no rendezvous, no peers to spread from
        for key in ("subdomain", "affinity"):
            pod.pop(key, None)
        container.pop("ports", None)
    if hw.k8s_scheduler == "volcano":
        pod["schedulerName"] = "volcano"
        spec["template"]["metadata"]["annotations"] = {VOLCANO_GROUP_ANNOTATION: name}
        out.append(podgroup(name, hw.k8s_namespace, labels, n))
    return [*out, job]


def failure_cause(run_dir: str | Path, name: str, reason: str, stage: str = "train") -> str:
    """Node 0's own one-line cause (its <stage>.json on the shared volume) when it wrote one."""
    path = Path(run_dir) / f"{stage}.json"
    error = read_json(path).get("error") if path.is_file() else None
    return (
        f"{stage} job {name} failed ({reason}): {error}"
        if error
        else f"{stage} job {name} failed ({reason}); see `kubectl logs -l job-name={name}`"
    )


def collect_result(
    run_dir: str | Path,
    name: str,
    parent_run_id: str | None = None,
    tracking_uri: str | None = None,
    stage: str = "train",
) -> dict:
    """Node 0's result of the stage; its MLflow run is attached to the DAG run's parent run."""
    path = Path(run_dir) / f"{stage}.json"
    if not path.is_file():
        raise StageError(
            f"{stage} job {name} completed but wrote no {path} (is the shared volume mounted at the "
            "same path in the pods and on the Airflow workers?)"
        )
    result = read_json(path)
    if result.get("status") == "failed":
        raise StageError(failure_cause(run_dir, name, "stage failed", stage), retryable=stage == "train")
    if parent_run_id and result.get("mlflow_run_id"):
        import mlflow

        mlflow.MlflowClient(tracking_uri).set_tag(result["mlflow_run_id"], "mlflow.parentRunId", parent_run_id)
    result.update(launcher="kubernetes", k8s_job=name)
    return result


def wait_for_job(
    status, name: str, timeout_s: float, poll_s: float = 30.0, describe=None, clock=time.monotonic, sleep=time.sleep
) -> tuple[bool, str]:
    """Poll `status()` → (done, failure reason or "") until done or `timeout_s`; on expiry a StageError names the
    Job, the bound and what its pods were doing (`describe()`, e.g. "pod x-0 Pending: Unschedulable …")."""
    deadline = clock() + timeout_s
    while True:
        done, reason = status()
        if done:
            return True, reason
        if clock() >= deadline:
            state = ""
            if describe is not None:
                try:
                    state = describe()
                except Exception as e:  # the cause of the expiry matters more than a failed description
                    state = f"pods not described: {e}"
            raise StageError(
                f"job {name} did not finish within {timeout_s:g} s (the stage's bound + "
                f"timeouts.k8s_pending_s){': ' + state if state else ''}; it was deleted"
            )
        sleep(min(poll_s, max(0.0, deadline - clock())))
