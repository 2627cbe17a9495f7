"""hardware.launcher=kubernetes: every device stage renders as a Job on the training nodes (or, hardware.k8s_kind, its
torchrun stages as a Kubeflow PyTorchJob / TrainJob), valid against the Kubernetes API schemas and the CRDs' own
(Volcano's PodGroup, training-operator's PyTorchJob, Trainer's TrainJob; tests/fixtures/k8s, made from each CRD by
crd_schema.py, sources named in each file's $comment), and the DAG's tasks route to that launcher. No API server can run
here: the Kubernetes schemas are the official client's models (tests/fixtures/k8s/generate_schema.py); the
submit/wait/collect path runs through the cncf provider's KubernetesHook and the client's request layer against a
loopback endpoint that answers with real responses recorded upstream (tests/helpers/k8s_api.py, tests/data/k8s: each
file names its source)."""

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tasks.launch import k8s_job, k8s_submit
from tasks.bounds import stage_timeout_s
from tasks.launch.placement import DEVICE_STAGES, MULTI_NODE_STAGES, runs_on_kubernetes
from tasks.stages import STAGES

from tests.helpers.k8s_api import DATA, POD_NAMES, RecordedApi, connected, on_kubernetes, recorded
from tests.helpers.k8s_schema import validate
from tests.helpers.mlflow_store import fresh_store

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def k8s_cfg(cfg):
    return on_kubernetes(cfg)


def test_committed_manifests_are_valid_kubernetes_objects():
    for path in (REPO / "deploy" / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            validate(doc)


def test_the_schema_is_strict_enough_to_catch_a_typo():
    _, job = yaml.safe_load_all((REPO / "deploy" / "k8s" / "train-job.yaml").read_text())
    job["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # "resources" misspelt
    with pytest.raises(jsonschema.ValidationError, match="resource"):
        validate(job)
    job["spec"]["template"]["spec"]["containers"][0].pop("resource")
    job["spec"]["completions"] = "2"  # a string where the API wants an integer
    with pytest.raises(jsonschema.ValidationError):
        validate(job)


@pytest.mark.parametrize("stage", DEVICE_STAGES)
def test_every_device_stage_renders_as_a_valid_job_on_the_training_nodes(k8s_cfg, tmp_path, stage):
    k8s_cfg.hardware.device = "npu"  # NPU pods (a cpu one requests no device: test_k8s_audit.py)
    name = k8s_job.job_name("llm_pipeline", "manual__1", 1, stage)
    manifests = k8s_job.render(k8s_cfg, tmp_path / "run", name, stage)
    for m in manifests:
        validate(m)
    job = manifests[-1]
    pods = 2 if stage in MULTI_NODE_STAGES else 1
    assert job["kind"] == "Job" and job["spec"]["completions"] == job["spec"]["parallelism"] == pods
    assert [m["kind"] for m in manifests[:-1]] == (["Service"] if pods > 1 else [])
    assert (
        job["spec"]["activeDeadlineSeconds"]
        == stage_timeout_s(stage, k8s_cfg, tmp_path / "run") + k8s_cfg.timeouts.k8s_pending_s
    )
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == k8s_cfg.hardware.k8s_image  # the same image for every stage
    args = container["args"][0]
    assert args.startswith(f"exec python -m tasks {stage} --config ") and f"--run-dir {tmp_path / 'run'}" in args
    assert "hardware.launcher=local" in args  # inside the pod the stage runs where it is
    if pods > 1:
        assert f"hardware.rdzv_endpoint={name}-0.{name}:29400" in args and "$JOB_COMPLETION_INDEX" in args
        assert container["resources"]["limits"]["huawei.com/Ascend910"] == 8
    else:
        assert "hardware.node_rank=0" in args and container["resources"]["limits"]["huawei.com/Ascend910"] == 1
    assert (tmp_path / "run" / "k8s" / f"{name}.yaml").is_file()  # the config the pods read


def test_volcano_gang_schedules_multi_pod_stages(k8s_cfg, tmp_path):
    k8s_cfg.hardware.k8s_scheduler = "volcano"
    k8s_cfg.hardware.nnodes = 4
    name = k8s_job.job_name("llm_pipeline", "manual__1", 1, "train")
    service, podgroup, job = k8s_job.render(k8s_cfg, tmp_path, name, "train")
    for m in (service, podgroup, job):
        validate(m)
    assert podgroup["kind"] == "PodGroup" and podgroup["spec"]["minMember"] == 4 == job["spec"]["parallelism"]
    template = job["spec"]["template"]
    assert template["spec"]["schedulerName"] == "volcano"
    assert template["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == podgroup["metadata"]["name"]
    bad = {**podgroup, "spec": {"minMembers": 4}}  # a typo Volcano's CRD would reject
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_only_device_stages_leave_the_airflow_worker(k8s_cfg):
    assert {s for s in STAGES if runs_on_kubernetes(s, k8s_cfg)} == set(DEVICE_STAGES)
    assert set(STAGES) - set(DEVICE_STAGES) == {"shard", "plan"}
    k8s_cfg.hardware.launcher = "local"
    assert not any(runs_on_kubernetes(s, k8s_cfg) for s in STAGES)


def test_job_wait_is_bounded_and_names_what_the_pods_were_doing():
    from tasks.errors import StageError

    now = [0.0]
    polls = []

    def status():
        polls.append(now[0])
        return False, ""

    with pytest.raises(StageError) as err:
        k8s_job.wait_for_job(
            status,
            "llm-abc",
            timeout_s=90,
            poll_s=30,
            describe=lambda: "llm-abc-0 Pending (Unschedulable: 0/4 nodes have huawei.com/Ascend910)",
            clock=lambda: now[0],
            sleep=lambda s: now.__setitem__(0, now[0] + s),
        )
    assert polls == [0, 30, 60, 90]
    assert "job llm-abc did not finish within 90 s" in str(err.value) and "Unschedulable" in str(err.value)
    done = iter([(False, ""), (True, "BackoffLimitExceeded")])
    assert k8s_job.wait_for_job(lambda: next(done), "j", 60, 1, clock=lambda: 0.0, sleep=lambda s: None) == (
        True,
        "BackoffLimitExceeded",
    )


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("stage", DEVICE_STAGES)
def test_kubeflow_kinds_render_the_torchrun_stages_valid_against_the_crds(k8s_cfg, tmp_path, kind, stage):
    k8s_cfg.hardware.device = "npu"  # NPU pods (a cpu one requests no device: test_k8s_audit.py)
    k8s_cfg.hardware.k8s_kind = kind
    name = k8s_job.job_name("llm_pipeline", "manual__1", 1, stage)
    manifests = k8s_job.render(k8s_cfg, tmp_path / "run", name, stage)
    for m in manifests:
        validate(m)
    if stage not in MULTI_NODE_STAGES:  # one pod: stays a Job
        assert [m["kind"] for m in manifests] == ["Job"]
        return
    (obj,) = manifests  # the operator makes the Services; no PodGroup of ours
    assert obj["metadata"]["name"] == name and obj["metadata"]["namespace"] == "llm"
    deadline = stage_timeout_s(stage, k8s_cfg, tmp_path / "run") + k8s_cfg.timeouts.k8s_pending_s
    if kind == "pytorchjob":
        assert obj["apiVersion"] == "kubeflow.org/v1" and obj["kind"] == "PyTorchJob"
        replicas = obj["spec"]["pytorchReplicaSpecs"]
        assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 1  # 2 nodes
        assert obj["spec"]["runPolicy"]["activeDeadlineSeconds"] == deadline
        assert obj["spec"]["runPolicy"]["backoffLimit"] == 0  # Airflow retries; training resumes from DCP
        container = replicas["Master"]["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch" and container["ports"] == [
            {"name": "pytorchjob-port", "containerPort": 29400}
        ]
        args = container["args"][0]
        assert (
            '"hardware.node_rank=$PET_NODE_RANK"' in args
            and '"hardware.rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT"' in args
        )
    else:
        assert obj["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and obj["kind"] == "TrainJob"
        spec = obj["spec"]
        assert spec["runtimeRef"] == {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                                      "kind": "ClusterTrainingRuntime"}  # fmt: skip
        assert spec["trainer"]["numNodes"] == 2 and spec["trainer"]["numProcPerNode"] == 8
        assert spec["trainer"]["resourcesPerNode"]["limits"]["huawei.com/Ascend910"] == 8
        assert spec["activeDeadlineSeconds"] == deadline
        assert not any(e["name"].startswith("PET_") for e in spec["trainer"]["env"])  # reserved by the torch plugin
        assert {"MLFLOW_TRACKING_URI", "LLM_PIPELINE_VAR_DIR"} <= {e["name"] for e in spec["trainer"]["env"]}
        pod = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        assert pod["name"] == "node" and pod["template"]["spec"]["template"]["spec"]["containers"][0]["name"] == "node"
        args = spec["trainer"]["args"][0]
        assert '"hardware.rdzv_endpoint=$PET_MASTER_ADDR:$PET_MASTER_PORT"' in args
    assert args.startswith("exec env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT python -m tasks ")


def test_the_crd_schemas_catch_a_misspelt_field(k8s_cfg, tmp_path):
    k8s_cfg.hardware.k8s_kind = "pytorchjob"
    (job,) = k8s_job.render(k8s_cfg, tmp_path, "x", "train")
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(jsonschema.ValidationError, match="resource"):
        validate(job)
    k8s_cfg.hardware.k8s_kind = "trainjob"
    (job,) = k8s_job.render(k8s_cfg, tmp_path, "x", "train")
    job["spec"]["trainer"]["numNode"] = job["spec"]["trainer"].pop("numNodes")
    with pytest.raises(jsonschema.ValidationError, match="numNode"):
        validate(job)
    (job,) = k8s_job.render(k8s_cfg, tmp_path, "x", "train")
    del job["spec"]["runtimeRef"]
    with pytest.raises(jsonschema.ValidationError, match="runtimeRef"):
        validate(job)
    k8s_cfg.hardware.k8s_kind, k8s_cfg.hardware.k8s_scheduler = "job", "volcano"
    (group,) = [o for o in k8s_job.render(k8s_cfg, tmp_path, "x", "train") if o["kind"] == "PodGroup"]
    group["spec"]["minMembers"] = group["spec"].pop("minMember")
    with pytest.raises(jsonschema.ValidationError, match="minMembers"):
        validate(group)


@pytest.mark.parametrize("kind", ["job", "pytorchjob", "trainjob"])
def test_the_pod_command_gets_its_rank_and_rendezvous_from_the_operator(k8s_cfg, tmp_path, kind):
    """The rendered command run by bash with the variables each operator sets on node 1 (training-operator's
    envvar.go/master.go, Trainer's torch plugin, the Job controller's completion index): the stage sees node rank 1,
    the master's rendezvous, and none of the operator's per-rank variables."""
    k8s_cfg.hardware.k8s_kind = kind
    manifest = k8s_job.render(k8s_cfg, tmp_path / "run", "llm-x", "train")[-1]
    if kind == "pytorchjob":
        container = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        env = {"MASTER_ADDR": "llm-x-master-0", "MASTER_PORT": "29400", "RANK": "1", "WORLD_SIZE": "16",
               "PET_NODE_RANK": "1", "PET_NNODES": "2"}  # fmt: skip
        endpoint = "llm-x-master-0:29400"
    elif kind == "trainjob":
        container = manifest["spec"]["trainer"]
        env = {"PET_MASTER_ADDR": "llm-x-node-0-0.llm-x", "PET_MASTER_PORT": "29500", "PET_NODE_RANK": "1"}
        endpoint = "llm-x-node-0-0.llm-x:29500"
    else:
        container = manifest["spec"]["template"]["spec"]["containers"][0]
        env, endpoint = {"JOB_COMPLETION_INDEX": "1"}, "llm-x-0.llm-x:29400"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text('#!/bin/bash\nprintf "%s\\n" "$@"; echo "RANK=${RANK-unset}"\n')
    (fake / "python").chmod(0o755)
    out = subprocess.run(
        [*container["command"], *container["args"]],
        env={"PATH": f"{fake}:/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    words = out.stdout.splitlines()
    assert out.returncode == 0 and words[:3] == ["-m", "tasks", "train"], out.stderr
    assert "hardware.node_rank=1" in words and f"hardware.rdzv_endpoint={endpoint}" in words
    assert words[-1] == "RANK=unset"


KIND = {"job": "Job", "pytorchjob": "PyTorchJob", "trainjob": "TrainJob"}  # each k8s_kind's object (the kind)
SUCCEEDS = {"job": ["job-running", "job-complete"], "pytorchjob": [None, "pytorchjob-succeeded"],
            "trainjob": [None, "trainjob-complete"]}  # fmt: skip
FAILS = {"job": ["job-running", "job-failed"], "pytorchjob": [None, "pytorchjob-failed"],
         "trainjob": [None, "trainjob-failed"]}  # fmt: skip
FAILED_REASON = {  # the recorded Failed condition's reason: message, as final_state reports it
    "job": "FailedIndexes: Job has failed indexes",
    "pytorchjob": "JobFailed: PyTorchJob pytorch-tcp-dist-mnist is failed because 1 Worker replica(s) failed.",
    "trainjob": "DeadlineExceeded: TrainJob exceeded its active deadline",
}


def test_every_recording_names_its_source_and_has_the_apis_shape():
    """Each recorded reply cites where it comes from, says whether it is verbatim, and its status is valid against
    the kind's own schema (the Kubernetes API's V1JobStatus, the CRDs' status schemas)."""
    from tests.helpers.k8s_schema import CRDS, check, kind_name

    files = sorted(DATA.glob("*.json"))
    assert len(files) == 10
    for path in files:
        rec = recorded(path.stem)
        assert rec["source"] and rec["recorded"] and rec["adjusted"] and rec["code"] in (200, 403, 409), path.name
        body = rec["body"]
        if kind_name(body) == "job":
            check("V1JobStatus", body["status"])
        elif kind_name(body) in CRDS:  # the status schema only: the 2018 PyTorchJob's spec predates runPolicy
            jsonschema.Draft7Validator(CRDS[kind_name(body)]["properties"]["status"]).validate(body["status"])
        elif body["kind"] == "Status":
            assert body["code"] == rec["code"] and body["status"] == "Failure"


@pytest.mark.parametrize("kind", KIND)
def test_final_state_reads_each_kinds_recorded_conditions(kind):
    """The recorded replies, as the client hands them over: a running or just-created object is not done, the
    success condition (after a Job's SuccessCriteriaMet) ends it cleanly, the failure condition (after a Job's
    FailureTarget) ends it with the controller's reason and message."""
    for reply in SUCCEEDS[kind][:-1]:
        assert k8s_job.final_state(kind, recorded(reply)["body"] if reply else {}) == (False, "")
    assert k8s_job.final_state(kind, recorded(SUCCEEDS[kind][-1])["body"]) == (True, "")
    assert k8s_job.final_state(kind, recorded(FAILS[kind][-1])["body"]) == (True, FAILED_REASON[kind])
    target = recorded("job-failed")["body"]  # a Job between FailureTarget and Failed: its pods still terminate
    target["status"]["conditions"] = target["status"]["conditions"][:1]
    assert k8s_job.final_state("job", target) == (False, "")


def test_the_config_offers_exactly_the_kinds_there_are():
    """hardware.k8s_kind's choices (tasks.config, validated before any render) are the names in k8s_job.KINDS."""
    from typing import get_args

    from tasks.config import HardwareConfig

    assert set(get_args(HardwareConfig.model_fields["k8s_kind"].annotation)) == set(k8s_job.KINDS)


def test_the_test_tables_key_kinds_by_their_k8s_kind_name_not_their_api_kind():
    """The helpers' tables (CRDS, POD_NAMES, the loopback API's replies) are keyed by hardware.k8s_kind: each kind's
    object maps back to its own name, and another API's object of the same `kind` (Volcano's batch.volcano.sh Job)
    to none of them, nor does its 409 read as batch/v1's jobs.batch (docs/launchers.md, "Add a Kubernetes kind")."""
    from tests.helpers.k8s_api import refusal
    from tests.helpers.k8s_schema import kind_name

    for name, kind in k8s_job.KINDS.items():
        group, version, _, api_kind = kind.api or ("batch", "v1", "jobs", "Job")
        assert kind_name({"apiVersion": f"{group}/{version}", "kind": api_kind}) == name
    assert kind_name({"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job"}) is None
    _, body = refusal("status-409-alreadyexists", "j-1", "llm", "batch.volcano.sh", "jobs")
    assert body["message"].startswith('jobs.batch.volcano.sh "j-1" already exists'), body["message"]
    _, body = refusal("status-409-alreadyexists", "j-1", "llm", "batch", "jobs")
    assert body["message"].startswith('jobs.batch "j-1" already exists'), body["message"]


@pytest.fixture
def api_server(tmp_path, monkeypatch):
    api = RecordedApi(validate, dict(SUCCEEDS))
    yield connected(api, tmp_path, monkeypatch)
    api.close()


def _run(cfg, kind, run_id):
    cfg.hardware.k8s_kind = kind
    cfg.tracking.enabled = False
    return k8s_submit.run_stage_job("train", cfg, "llm_pipeline", run_id, conn_id="k8s_loopback", poll_s=0.05)


@pytest.mark.parametrize("kind", KIND)
def test_submit_wait_collect_through_the_hook_and_the_client(k8s_cfg, api_server, kind):
    """The provider's KubernetesHook and the kubernetes client, over HTTP, on recorded replies: the job is created
    (its body accepted by the strict schema check), polled through the controller's recorded states until its
    success condition, the result the pods wrote collected, and the rendezvous Service removed. Unrun here: a real
    API server's admission (Trainer's webhook, CEL rules), the operators themselves, and pods on nodes."""
    from tasks.runner import default_run_dir

    run_dir = default_run_dir("llm_pipeline", "manual__1")

    def pods_finish(obj):  # node 0's stage result on the shared volume
        (run_dir / "train.json").write_text(json.dumps({"status": "ok", "summary": f"done as {obj['kind']}"}))

    api_server.on_done = pods_finish
    result = _run(k8s_cfg, kind, "manual__1")
    assert result["summary"] == f"done as {KIND[kind]}" and result["launcher"] == "kubernetes"
    name = result["k8s_job"]
    paths = [(m, p.split("?")[0]) for m, p in api_server.requests]
    if kind == "job":
        assert ("POST", "/api/v1/namespaces/llm/services") in paths
        assert ("POST", "/apis/batch/v1/namespaces/llm/jobs") in paths
        assert ("GET", f"/apis/batch/v1/namespaces/llm/jobs/{name}/status") in paths
        assert ("DELETE", f"/api/v1/namespaces/llm/services/{name}") in paths  # the Service only served the Job
    else:
        group, version, plural, _ = k8s_job.KINDS[kind].api
        assert paths[0] == ("POST", f"/apis/{group}/{version}/namespaces/llm/{plural}")
        assert paths[-1] == ("GET", f"/apis/{group}/{version}/namespaces/llm/{plural}/{name}")
        assert len(paths) == 1 + len(SUCCEEDS[kind])  # created once, polled until done, nothing else
    assert api_server.polls[(k8s_job.KINDS[kind].api or ("", "", "jobs"))[2], name] == len(SUCCEEDS[kind])


@pytest.mark.parametrize("kind", KIND)
def test_a_failed_job_names_the_controllers_reason_and_the_failed_pod(k8s_cfg, api_server, kind):
    """The recorded failure: one line with the controller's reason and message and, node 0 having written nothing
    (an OOM kill), the failed pod from the recorded pod list with its exit code, and where its logs are."""
    from tasks.errors import StageError

    api_server.replies = dict(FAILS)
    api_server.pods = "podlist-failed"
    with pytest.raises(StageError) as err:
        _run(k8s_cfg, kind, "manual__2")
    line = str(err.value)
    name = k8s_job.job_name("llm_pipeline", "manual__2")
    running_pod, failed_pod = (f"{name}-{suffix}" for suffix in POD_NAMES[kind])
    assert line.startswith(f"train job {name} failed ({FAILED_REASON[kind]}); ") and "\n" not in line
    assert f"{failed_pod} Failed (exit 137 OOMKilled)" in line and running_pod + " " not in line
    assert f"kubectl logs -l {k8s_job.KINDS[kind].pod_selector}={name}`" in line and err.value.retryable


def test_node_0s_own_cause_comes_before_the_pods(k8s_cfg, api_server):
    from tasks.errors import StageError
    from tasks.runner import default_run_dir

    run_dir = default_run_dir("llm_pipeline", "manual__2")
    api_server.replies = dict(FAILS)
    api_server.on_done = lambda obj: (run_dir / "train.json").write_text(
        json.dumps({"status": "failed", "error": "train: rank 3 killed by SIGKILL (out of memory?)"})
    )
    with pytest.raises(StageError) as err:
        _run(k8s_cfg, "pytorchjob", "manual__2")
    assert f"failed ({FAILED_REASON['pytorchjob']}): train: rank 3 killed by SIGKILL" in str(err.value)


@pytest.mark.parametrize("kind", KIND)
def test_a_name_that_already_exists_is_one_line_with_the_fix(k8s_cfg, api_server, kind):
    """The recorded 409 AlreadyExists Status, through the client's ApiException (a Job's through create_from_yaml's
    FailToCreateError): one line naming the object and the kubectl command that removes it; nothing is polled."""
    from tasks.errors import StageError

    api_server.refuse["POST"] = "status-409-alreadyexists"
    with pytest.raises(StageError) as err:
        _run(k8s_cfg, kind, "manual__3")
    name = k8s_job.job_name("llm_pipeline", "manual__3")
    group, _, plural, _ = k8s_job.KINDS[kind].api or ("batch", "v1", "jobs", "Job")
    assert str(err.value) == (
        f'train job {name} in namespace llm: {plural}.{group} "{name}" already exists (409 AlreadyExists: left by '
        f"an earlier submission of this try); delete it (kubectl delete {plural}.{group} {name} -n llm) and clear "
        "the task"
    )
    assert not [m for m, _ in api_server.requests if m == "GET"]


@pytest.mark.parametrize("kind", KIND)
@pytest.mark.parametrize("method", ["POST", "GET"])
def test_a_forbidden_request_names_the_verb_the_resource_and_the_role_to_grant(k8s_cfg, api_server, kind, method):
    """The recorded 403 Forbidden Status (RBAC's message): one line naming who may not do what on which resource,
    and the Role and RoleBinding that let the launcher create, read and delete what it submits."""
    from tasks.errors import StageError

    api_server.refuse[method] = "status-403-forbidden"
    with pytest.raises(StageError) as err:
        _run(k8s_cfg, kind, "manual__4")
    line = str(err.value)
    group, _, plural, _ = k8s_job.KINDS[kind].api or ("batch", "v1", "jobs", "Job")
    user = "system:serviceaccount:helm-test:prefect-worker-dev"  # the recorded identity
    # the recording's verb ("create") even on a GET: its message is served as recorded, only names adjusted
    assert f"the cluster does not let {user} create {plural}.{group} (403 Forbidden: " in line
    assert "kubectl create role llm-pipeline-launcher -n llm --verb=create,get,list,delete --resource=" in line
    assert f"{plural}.{group}" in line.split("--resource=")[1] and "pods" in line.split("--resource=")[1]
    assert line.endswith("--role=llm-pipeline-launcher --serviceaccount=helm-test:prefect-worker-dev")


def test_a_body_the_api_would_refuse_is_refused_over_the_wire(k8s_cfg, api_server, monkeypatch):
    """The loopback endpoint validates what it is sent: a manifest with a misspelt field comes back as the
    client's ApiException (422 Invalid) — the strict check sits on the request path, not only in these tests."""
    from kubernetes.client.exceptions import ApiException

    real = k8s_job.KINDS["trainjob"]
    monkeypatch.setitem(
        k8s_job.KINDS, "trainjob", dataclasses.replace(real, convert=lambda *a: {**real.convert(*a), "sepc": {}})
    )
    with pytest.raises(ApiException) as err:
        _run(k8s_cfg, "trainjob", "manual__5")
    assert err.value.status == 422 and "sepc" in err.value.body


@pytest.mark.slow
def test_the_smoke_task_goes_to_the_kubernetes_launcher(tmp_path, airflow_db, api_server):
    """Through Airflow: with launcher=kubernetes the smoke task (a device stage) does not run on the worker; it
    submits a Job through the `kubernetes_default` connection (here the loopback API) and collects what the pod
    wrote. The preset is a site's own file ($LLM_PIPELINE_PRESET), as a deployment names its image there."""
    preset = yaml.safe_load((REPO / "configs" / "ci-tiny.yaml").read_text())
    preset["hardware"]["k8s_image"] = "registry.example/llm-pipeline:ascend"
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(preset))

    def pod_runs_smoke(job):  # the pod's `python -m tasks smoke --run-dir D …` writes D/smoke.json
        args = job["spec"]["template"]["spec"]["containers"][0]["args"][0].split()
        run_dir = Path(args[args.index("--run-dir") + 1])
        (run_dir / "smoke.json").write_text(json.dumps({"status": "ok", "summary": "smoke in the pod"}))

    api_server.on_done = pod_runs_smoke
    conn = json.loads(os.environ["AIRFLOW_CONN_K8S_LOOPBACK"])
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LLM_PIPELINE_PRESET": str(tmp_path / "site.yaml"),
        "AIRFLOW_CONN_KUBERNETES_DEFAULT": json.dumps(conn),
        "MLFLOW_TRACKING_URI": fresh_store(tmp_path / "m.db"),
    }
    params = json.dumps({"launcher": "kubernetes"})
    cmd = f"source scripts/airflow-env.sh && airflow tasks test llm_pipeline smoke 2026-01-05 -t '{params}'"
    out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    posted = [p for m, p in api_server.requests if m == "POST"]
    assert posted == ["/apis/batch/v1/namespaces/llm/jobs"], api_server.requests  # one pod: no Service
    (job,) = api_server.objects.values()
    assert job["metadata"]["labels"]["llm-pipeline/stage"] == "smoke"
    assert "smoke in the pod" in text  # the task's result is what the pod wrote


def test_the_pods_config_loads_back_and_keeps_the_explicit_layout(k8s_cfg, tmp_path):
    """The pods run `--config <run-dir>/k8s/<name>.yaml`: that file loads as a preset (once it held a `preset` key,
    which a preset file may not), and a zero the caller set stays explicit there, so the plan's never replaces it."""
    from tasks.config import apply_overrides, load_config

    apply_overrides(k8s_cfg, {"parallel.zero": "1"})  # as the DAG's Params set it
    manifest = k8s_job.render(k8s_cfg, tmp_path / "run", "llm-x", "train")[-1]
    config_file = tmp_path / "run" / "k8s" / "llm-x.yaml"
    assert "preset" not in yaml.safe_load(config_file.read_text())
    pod_cfg = load_config(str(config_file))
    assert pod_cfg.parallel.zero == 1 and pod_cfg.train.steps == k8s_cfg.train.steps
    args = manifest["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "--set parallel.zero=1" in args


@pytest.mark.parametrize("kind", ["job", "pytorchjob", "trainjob"])
def test_npu_pods_run_the_ascend_entrypoint_and_cpu_cuda_pods_do_not(k8s_cfg, tmp_path, kind):
    """A container's `command` replaces the image's ENTRYPOINT: an NPU pod's command starts with the Ascend image's
    entrypoint (docker/entrypoint-ascend.sh, run here in its place), so CANN's set_env.sh is sourced before the stage;
    the CPU and CUDA images have no such file, and their pods start bash directly."""
    k8s_cfg.hardware.k8s_kind = kind

    def command(device: str) -> list[str]:
        k8s_cfg.hardware.device = device
        manifest = k8s_job.render(k8s_cfg, tmp_path / "run", "llm-x", "train")[-1]
        if kind == "pytorchjob":
            return manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
        if kind == "trainjob":
            return manifest["spec"]["trainer"]["command"]
        return manifest["spec"]["template"]["spec"]["containers"][0]["command"]

    for device in ("cpu", "cuda"):
        assert command(device) == ["bash", "-c"], device
    entry = command("npu")
    assert entry == [k8s_job.ASCEND_ENTRYPOINT, "bash", "-c"] and command("auto") == entry
    steps = [line.split() for line in (REPO / "docker" / "Dockerfile.ascend").read_text().splitlines()]
    assert ["COPY", "docker/entrypoint-ascend.sh", k8s_job.ASCEND_ENTRYPOINT] in steps
    cann = tmp_path / "Ascend" / "cann"
    cann.mkdir(parents=True)
    (cann / "set_env.sh").write_text("export ASCEND_HOME_PATH=/fake/cann\n")
    out = subprocess.run(
        ["bash", str(REPO / "docker" / "entrypoint-ascend.sh"), *entry[1:], 'echo "cann=$ASCEND_HOME_PATH"'],
        env={"PATH": "/usr/bin:/bin", "ASCEND_INSTALL_ROOT": str(tmp_path / "Ascend")},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout.strip() == "cann=/fake/cann", out.stderr


def test_a_missing_job_template_is_one_line_naming_it_and_the_fix(k8s_cfg, tmp_path, monkeypatch):
    """An image built without deploy/ (older Dockerfiles did not COPY it): one line, not a FileNotFoundError."""
    monkeypatch.setattr(k8s_job, "TEMPLATE", tmp_path / "deploy" / "k8s" / "train-job.yaml")
    with pytest.raises(k8s_job.StageError, match=r"train-job\.yaml is missing .*COPY deploy \./deploy") as e:
        k8s_job.render(k8s_cfg, tmp_path / "run", "llm-x", "train")
    assert "\n" not in str(e.value)
