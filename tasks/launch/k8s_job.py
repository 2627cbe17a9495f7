"""Device stages as Kubernetes Jobs on the Ascend nodes (hardware.launcher: kubernetes): render, then read the result.

`render()` turns deploy/k8s/train-job.yaml into the manifests of one stage of one DAG run: for the multi-node stages
(env probe, train, profile) a headless Service and an Indexed Job with one pod per node, `python -m tasks <stage>` in
each with its node rank (the pod index) and torchrun's static rendezvous at pod 0; for smoke, quantize and evaluate one
pod. With hardware.k8s_scheduler=volcano the pods are gang-scheduled: a Volcano PodGroup with minMember = pods,
schedulerName volcano and the group annotation. The Job's activeDeadlineSeconds is the stage's bound (tasks/bounds.py)
plus timeouts.k8s_pending_s. The Airflow side (tasks/launch/k8s_submit.py) submits them with the cncf provider and
waits; the pods write `<stage>.json` into the run directory on the shared volume, where `collect_result()` reads it.
Nothing here talks to a cluster or imports Airflow, so the rendering is tested on CPU.

hardware.k8s_kind chooses what the torchrun stages (env probe, train, profile) are submitted as: `job` (the Indexed
Job above), `pytorchjob` (Kubeflow training-operator v1: a Master and nnodes-1 Workers, the operator's
MASTER_ADDR/PET_NODE_RANK naming the rendezvous and the node rank; gang scheduling through its runPolicy) or
`trainjob` (Kubeflow Trainer v2: numNodes nodes of the `torch-distributed` ClusterTrainingRuntime, PET_MASTER_ADDR/
PET_NODE_RANK; volumes through a runtime patch). The one-pod stages stay Jobs. Field names and the operators'
environment variables are upstream's: training-operator release-1.9 pkg/apis/kubeflow.org/v1/pytorch_types.go and
pkg/controller.v1/pytorch/{envvar,master}.go; trainer pkg/apis/trainer/v1alpha1/trainjob_types.go,
pkg/runtime/framework/plugins/torch/torch.go and pkg/constants/constants.go.
"""

from __future__ import annotations

import copy
import hashlib
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from tasks.config import REPO_ROOT, PipelineConfig, get, split_endpoint
from tasks.errors import ConfigError, StageError, os_error_cause
from tasks.fsutil import atomic_write_text, read_json
from tasks.launch.placement import DEVICE_STAGES, MULTI_NODE_STAGES
from tasks.runner import JOB_ENV, TRY_ENV

TEMPLATE = REPO_ROOT / "deploy" / "k8s" / "train-job.yaml"
NPU_RESOURCE = "huawei.com/Ascend910"  # the Ascend device plugin's resource (the template's)
GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's resource
# Host paths only an Ascend node has (the driver, npu-smi and its libraries, the install record): a GPU pod drops them
# (the NVIDIA container runtime injects its driver).
ASCEND_MOUNTS = ("driver", "npu-smi", "dcmi", "install-info")
# A container's `command` replaces the image's ENTRYPOINT: the Ascend image's (docker/Dockerfile.ascend), which sources
# CANN's set_env.sh, is named explicitly for NPU pods (the template's, device npu or auto); the CPU/CUDA images (device
# cpu, cuda) have none.
ASCEND_ENTRYPOINT = "/usr/local/bin/entrypoint-ascend.sh"


def device_resource(cfg: PipelineConfig) -> str | None:
    """The extended resource a pod requests for its accelerators: GPUs for hardware.device cuda, none for cpu (a
    CPU pod must not wait for, nor hold, a device plugin's chips), else NPUs (npu, auto: the template's)."""
    return {"cuda": GPU_RESOURCE, "cpu": None}.get(cfg.hardware.device, NPU_RESOURCE)


def devices_of(container: dict) -> int:
    """The accelerators a rendered container requests (whichever device plugin's resource it names)."""
    limits = container["resources"]["limits"]
    return limits.get(NPU_RESOURCE) or limits.get(GPU_RESOURCE) or 0


RDZV_PORT = 29400  # the template's, and hardware.rdzv_endpoint's default port
DEFAULT_NPUS_PER_NODE = 8  # Atlas 800T A2 / A3 training servers


def rdzv_port(hw) -> int:
    """The rendezvous port of a multi-pod stage: hardware.rdzv_endpoint's (its host is pod 0's, known only at
    render time); the Service port, the container port and torchrun's endpoint all take it."""
    return split_endpoint(hw.rdzv_endpoint)[1]


def procs_per_node(hw) -> int:
    """torchrun's processes per pod of a multi-node stage: hardware.nproc_per_node, else a whole training server's."""
    return hw.nproc_per_node or DEFAULT_NPUS_PER_NODE


VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"  # Volcano's KubeGroupNameAnnotationKey
PODGROUP_API = ("scheduling.volcano.sh", "v1beta1", "podgroups")


@dataclass(frozen=True)
class Kind:
    """One hardware.k8s_kind (the table is KINDS, after the converters; docs/launchers.md adds a kind)."""

    final: tuple[str, str]  # the condition types that end a run, (succeeded, failed), when their status is "True"
    pod_selector: str  # the label every pod of the run carries with the run's name (to describe them)
    api: tuple[str, str, str, str] | None = None  # (group, version, plural, kind) of a custom resource; None: a Job
    rank_env: tuple[str, str] | None = None  # what a pod reads, as shell words: (node rank, rendezvous host:port);
    # None: our Indexed Job's own ($JOB_COMPLETION_INDEX, pod 0 behind the headless Service)
    convert: Callable[[dict, int, object], dict] | None = None  # (rendered Job, pods, hardware) → this kind's object


PYTORCHJOB_API = ("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
PYTORCHJOB_LABEL = "training.kubeflow.org/job-name"
PYTORCHJOB_CONTAINER, PYTORCHJOB_PORT = "pytorch", "pytorchjob-port"  # the operator finds the master port by these
TRAINJOB_API = ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob")
TRAINJOB_LABEL = "jobset.sigs.k8s.io/jobset-name"
TRAINJOB_RUNTIME = "torch-distributed"  # Kubeflow Trainer's ClusterTrainingRuntime for PyTorch
TRAINJOB_CONTAINER = "node"  # constants.Node: the trainer's replicated job and container
TRAINJOB_PATCH_MANAGER = "llm-pipeline"
# The operators also set these for a process that is itself a rank; the stage process is not one (torchrun sets
# its children's own), so they are dropped before it starts (tracking.is_rank0 reads RANK).
OPERATOR_RANK_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What every pod is told about its submission (tasks.runner's JOB_ENV, TRY_ENV: the runner stamps the job's name into
# the stage's result, and the stage's MLflow child run is tagged with the try): collect_result() takes only a result
# stamped with this job's name, never a still-running earlier try's.


def kind_of(stage: str, cfg: PipelineConfig) -> str:
    """What a stage is submitted as: hardware.k8s_kind for the torchrun stages, a Job for the one-pod ones."""
    return cfg.hardware.k8s_kind if stage in MULTI_NODE_STAGES else "job"


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
    kind = KINDS[kind_of(stage, cfg)]
    nproc = procs_per_node(hw) if n > 1 or stage in MULTI_NODE_STAGES else 1
    sets = {"hardware.nnodes": n, "hardware.nproc_per_node": nproc, "hardware.launcher": "local"}
    if n > 1 and kind.rank_env is None:
        sets["hardware.rdzv_endpoint"] = f"{name}-0.{name}:{rdzv_port(hw)}"
    # The pods read the whole config as a file (a preset): what the caller set explicitly stays explicit there,
    # so a data.seq_len that differs from the shard set's fails in the pod as it would here.
    from tasks.runner import FROM_SHARD_SET

    # Likewise the layout values the caller set (tasks.layout.EXPLICIT_LAYOUT): the plan's never replace them.
    from tasks.layout import EXPLICIT_LAYOUT

    sets.update({k: get(cfg, k) for k in (*FROM_SHARD_SET, *EXPLICIT_LAYOUT.values()) if k in cfg.explicit})
    args = ["python", "-m", "tasks", stage, "--config", str(config_file), "--run-dir", str(run_dir)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    exe = "exec " if kind.api is None else "exec env " + " ".join(f"-u {v}" for v in OPERATOR_RANK_VARS) + " "
    if n == 1:
        return exe + shlex.join(args + ["--set", "hardware.node_rank=0"])
    # The node rank (and a Kubeflow kind's rendezvous host) are known only inside the pod: left for bash to expand.
    if kind.rank_env is None:
        return exe + shlex.join(args) + ' --set "hardware.node_rank=$JOB_COMPLETION_INDEX"'
    rank, endpoint = kind.rank_env
    return exe + shlex.join(args) + f' --set "hardware.node_rank={rank}" --set "hardware.rdzv_endpoint={endpoint}"'


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


def render(
    cfg: PipelineConfig, run_dir: str | Path, name: str, stage: str = "train", try_number: int = 1
) -> list[dict]:
    """The manifests of one stage's Job ([Service,] [PodGroup,] Job); also writes the config the pods read into the
    run directory. Multi-node stages get the rendezvous Service; volcano adds the PodGroup. The pods' environment
    names the job and the Airflow task's try (JOB_ENV, TRY_ENV)."""
    hw = cfg.hardware
    if stage not in DEVICE_STAGES:
        raise ConfigError(f"stage {stage!r} runs on the Airflow worker, not as a Kubernetes Job")
    if not hw.k8s_image:
        raise ConfigError(
            "hardware.k8s_image: required with hardware.launcher=kubernetes (in a registry the cluster can pull "
            "from: for hardware.device npu the image built from docker/Dockerfile.ascend; for cuda "
            "docker/Dockerfile.cpu built with --build-arg TORCH_INDEX_URL=<PyTorch's CUDA index>, see its header)"
        )
    if not TEMPLATE.is_file():
        raise StageError(
            f"the Kubernetes Job template {TEMPLATE} is missing (an image built without deploy/): rebuild the image "
            "from docker/Dockerfile.ascend or docker/Dockerfile.cpu of this version, which COPY deploy ./deploy"
        )
    run_dir = Path(run_dir)
    config_file = run_dir / "k8s" / f"{name}.yaml"
    pod_cfg = copy.deepcopy(cfg)
    pod_cfg.tracking.uri = ""  # the pods take MLFLOW_TRACKING_URI (and credentials) from the llm-mlflow secret
    # The file is the pods' preset: no `preset` key in it (a preset file naming a preset is refused: config.py)
    body = {k: v for k, v in pod_cfg.to_dict().items() if k != "preset"}
    atomic_write_text(config_file, yaml.safe_dump(body, sort_keys=False))

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
    if hw.device in ("cpu", "cuda"):  # the CPU/CUDA image: no Ascend entrypoint to start the command with
        container["command"] = [w for w in container["command"] if w != ASCEND_ENTRYPOINT]
    container["args"] = [pod_command(cfg, run_dir, config_file, name, stage)]
    npus = procs_per_node(hw) if stage in MULTI_NODE_STAGES else 1
    resource = device_resource(cfg)
    for part in ("limits", "requests"):
        container["resources"][part].pop(NPU_RESOURCE, None)
        if resource:
            container["resources"][part][resource] = npus
    if resource != NPU_RESOURCE:
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] not in ASCEND_MOUNTS]
        pod["volumes"] = [v for v in pod["volumes"] if v["name"] not in ASCEND_MOUNTS]
    env = {e["name"]: e for e in container["env"]}
    env["HCCL_CONNECT_TIMEOUT"]["value"] = str(hw.hccl_connect_timeout)
    env["HCCL_EXEC_TIMEOUT"] = {"name": "HCCL_EXEC_TIMEOUT", "value": str(hw.hccl_exec_timeout)}
    env[JOB_ENV] = {"name": JOB_ENV, "value": name}
    env[TRY_ENV] = {"name": TRY_ENV, "value": str(try_number)}
    container["env"] = list(env.values())
    out = []
    if n > 1:
        port = rdzv_port(hw)
        service["spec"]["ports"] = [{**service["spec"]["ports"][0], "port": port, "targetPort": port}]
        container["ports"] = [{**container["ports"][0], "containerPort": port}]
        pod["subdomain"] = name
        pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"] = {
            "matchLabels": {"job-name": name}
        }
        out.append(service)
    else:  # one pod: no rendezvous, no peers to spread from
        for key in ("subdomain", "affinity"):
            pod.pop(key, None)
        container.pop("ports", None)
    convert = KINDS[kind_of(stage, cfg)].convert
    if convert is not None:  # an operator's kind: it makes the Services (and the PodGroup) itself
        return [convert(job, n, hw)]
    if hw.k8s_scheduler == "volcano":
        pod["schedulerName"] = "volcano"
        spec["template"]["metadata"]["annotations"] = {VOLCANO_GROUP_ANNOTATION: name}
        out.append(podgroup(name, hw.k8s_namespace, labels, n))
    return [*out, job]


def pytorchjob(job: dict, n: int, hw) -> dict:
    """The rendered Job as a Kubeflow PyTorchJob: Master (node 0) + n-1 Workers, one pod each. The operator makes
    the master's Service and sets MASTER_ADDR/MASTER_PORT (the container port named pytorchjob-port) and
    PET_NODE_RANK in every pod; runPolicy carries the deadline, no pod retries, the TTL and the gang size."""
    spec = job["spec"]
    template = copy.deepcopy(spec["template"])
    pod, name = template["spec"], job["metadata"]["name"]
    pod.pop("subdomain", None)  # the operator's own Services name the pods
    container = pod["containers"][0]
    container["name"] = PYTORCHJOB_CONTAINER
    container["ports"] = [{"name": PYTORCHJOB_PORT, "containerPort": rdzv_port(hw)}]  # → MASTER_PORT
    if "affinity" in pod:
        rule = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        rule["labelSelector"] = {"matchLabels": {PYTORCHJOB_LABEL: name}}
    if hw.k8s_scheduler == "volcano":
        pod["schedulerName"] = "volcano"  # the operator (--gang-scheduler-name=volcano) makes the PodGroup
    replica = {"restartPolicy": "Never", "template": template}
    replicas = {"Master": {"replicas": 1, **replica}}
    if n > 1:
        replicas["Worker"] = {"replicas": n - 1, **copy.deepcopy(replica)}
    run_policy = {
        "backoffLimit": spec["backoffLimit"],
        "activeDeadlineSeconds": spec["activeDeadlineSeconds"],
        "ttlSecondsAfterFinished": spec["ttlSecondsAfterFinished"],
        "cleanPodPolicy": "None",  # pods stay for `kubectl logs` until the TTL, as the Job's do
    }
    if hw.k8s_scheduler == "volcano":
        run_policy["schedulingPolicy"] = {"minAvailable": n}
    group, version, _, kind = PYTORCHJOB_API
    nproc = procs_per_node(hw)
    return {
        "apiVersion": f"{group}/{version}",
        "kind": kind,
        "metadata": job["metadata"],
        "spec": {"nprocPerNode": str(nproc), "pytorchReplicaSpecs": replicas, "runPolicy": run_policy},
    }


def trainjob(job: dict, n: int, hw) -> dict:
    """The rendered Job as a Kubeflow TrainJob on the `torch-distributed` runtime: numNodes pods, the command,
    image, resources and environment in spec.trainer (the MLflow secret's keys as valueFrom: a trainer takes no
    envFrom), the shared volumes and node settings through a runtime patch (PodSpecPatch: volumes, nodeSelector,
    affinity, tolerations; host networking is the runtime's to set). The torch plugin sets PET_NODE_RANK and
    PET_MASTER_ADDR/PET_MASTER_PORT. Gang scheduling and the rendezvous port are the runtime's: tasks/config.py refuses
    hardware.k8s_scheduler volcano and an hardware.rdzv_endpoint port other than 29400 with this kind."""
    spec = job["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    env = list(container["env"])
    for source in container.get("envFrom", []):
        secret = source["secretRef"]["name"]
        for key in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}})
    pod_patch = {"volumes": pod["volumes"]}
    for key in ("nodeSelector", "tolerations"):
        if key in pod:
            pod_patch[key] = pod[key]
    if "affinity" in pod:
        pod_patch["affinity"] = copy.deepcopy(pod["affinity"])
        rule = pod_patch["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        rule["labelSelector"] = {"matchLabels": {TRAINJOB_LABEL: job["metadata"]["name"]}}
    pod_patch["containers"] = [{"name": TRAINJOB_CONTAINER, "volumeMounts": container["volumeMounts"]}]
    patch = {"replicatedJobs": [{"name": TRAINJOB_CONTAINER, "template": {"spec": {"template": {"spec": pod_patch}}}}]}
    group, version, _, kind = TRAINJOB_API
    return {
        "apiVersion": f"{group}/{version}",
        "kind": kind,
        "metadata": job["metadata"],
        "spec": {
            "runtimeRef": {"name": TRAINJOB_RUNTIME, "apiGroup": group, "kind": "ClusterTrainingRuntime"},
            "activeDeadlineSeconds": spec["activeDeadlineSeconds"],
            "trainer": {
                "image": container["image"],
                "command": container["command"],
                "args": container["args"],
                "env": env,
                "numNodes": n,
                "numProcPerNode": procs_per_node(hw),
                "resourcesPerNode": container["resources"],
            },
            "runtimePatches": [
                {"manager": TRAINJOB_PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": patch}}}
            ],
        },
    }


# hardware.k8s_kind → its Kind (tasks.config's k8s_kind choices are these names). Pod labels: JobNameLabel of
# training-operator; JobSetNameKey of JobSet (a TrainJob runs as the JobSet of the same name).
KINDS = {
    "job": Kind(final=("Complete", "Failed"), pod_selector="job-name"),
    "pytorchjob": Kind(
        final=("Succeeded", "Failed"),
        pod_selector=PYTORCHJOB_LABEL,
        api=PYTORCHJOB_API,
        rank_env=("$PET_NODE_RANK", "$MASTER_ADDR:$MASTER_PORT"),
        convert=pytorchjob,
    ),
    "trainjob": Kind(
        final=("Complete", "Failed"),
        pod_selector=TRAINJOB_LABEL,
        api=TRAINJOB_API,
        rank_env=("$PET_NODE_RANK", "$PET_MASTER_ADDR:$PET_MASTER_PORT"),
        convert=trainjob,
    ),
}


def final_state(kind: str, obj: dict) -> tuple[bool, str]:
    """(done, failure reason or "") from a Job/PyTorchJob/TrainJob as the API returns it (a dict): done once its
    success or failure condition is "True" (the controllers' condition types, Kind.final). The reason is the
    condition's reason and message ("FailedIndexes: Job has failed indexes", "JobFailed: PyTorchJob x is failed
    because 1 Worker replica(s) failed."): the message is where a controller names what failed. A Job's
    FailureTarget/SuccessCriteriaMet (Kubernetes >= 1.31) come before Failed/Complete, while pods still terminate;
    waiting for the terminal condition means node 0 has finished writing its result (tests/data/k8s)."""
    ok, failed = KINDS[kind].final
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") == failed:
            return True, ": ".join(filter(None, (c.get("reason"), c.get("message")))) or failed
        if c.get("type") == ok:
            return True, ""
    return False, ""


def set_aside_result(run_dir: str | Path, name: str, stage: str = "train") -> Path | None:
    """Before job `name` is submitted: an earlier try's `<stage>.json` in the run directory (a failed or retried
    submission of the same DAG run) is moved to `k8s/<stage>.before-<name>.json`, so that what collect_result() and
    failure_cause() read afterwards is this job's pods' or nothing. Returns where it went (None: there was none)."""
    old = Path(run_dir) / f"{stage}.json"
    if not old.is_file():
        return None
    kept = Path(run_dir) / "k8s" / f"{stage}.before-{name}.json"
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        old.replace(kept)
    except OSError as e:
        raise StageError(
            f"{stage} job {name}: cannot move the earlier try's {old} aside before submitting: {os_error_cause(e)}"
        ) from None
    return kept


def written_by(result: dict, name: str) -> str | None:
    """The job that wrote `result` when it is another than `name` (its pods stamp their job's name, JOB_ENV, into
    `k8s_job`): an earlier try's job that was still running when this try set its result aside and wrote after.
    None: this job's, or unstamped (an image older than the stamp)."""
    other = result.get("k8s_job")
    return other if other and other != name else None


def failure_cause(
    run_dir: str | Path, name: str, reason: str, stage: str = "train", pods: str = "", selector: str = "job-name"
) -> str:
    """One line: node 0's own cause (its <stage>.json on the shared volume: set_aside_result() moved an earlier
    try's away before the submission; one another job wrote since is not this job's) when it wrote one, else the
    failed pods (`pods`, e.g. "x-1-abcde Failed (exit 137 OOMKilled)") and where their logs are."""
    path = Path(run_dir) / f"{stage}.json"
    record = read_json(path) if path.is_file() else {}
    error = None if written_by(record, name) else record.get("error")
    if error:
        return f"{stage} job {name} failed ({reason}): {error}"
    return f"{stage} job {name} failed ({reason}){'; ' + pods if pods else ''}; see `kubectl logs -l {selector}={name}`"


def collect_result(
    run_dir: str | Path,
    name: str,
    parent_run_id: str | None = None,
    tracking_uri: str | None = None,
    stage: str = "train",
    selector: str = "job-name",
) -> dict:
    """Node 0's result of the stage (this job's: set_aside_result() moved an earlier try's away before the
    submission, and one stamped by another job, an earlier try's still running then, is refused: retryable); its
    MLflow run is attached to the DAG run's parent run."""
    path = Path(run_dir) / f"{stage}.json"
    if not path.is_file():
        raise StageError(
            f"{stage} job {name} completed but wrote no {path} (is the shared volume mounted at the "
            "same path in the pods and on the Airflow workers?)"
        )
    result = read_json(path)
    other = written_by(result, name)
    if other:
        raise StageError(
            f"{stage} job {name} completed, but {path} was written by job {other} (an earlier try's, still running "
            f"after this try set its result aside), not by this job: not taken; stop {other} if it still runs "
            f"(`kubectl get pods -l {selector}={other}`) and retry the task",
            retryable=True,
        )
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
