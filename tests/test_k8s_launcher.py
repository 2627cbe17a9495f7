"""hardware.launcher=kubernetes: every device stage renders as a Job on the training nodes, valid against the Kubernetes
API schemas (and Volcano's PodGroup schema), and the DAG's tasks route to that launcher. The API server cannot run
here: the schemas are the official client's models (tests/fixtures/k8s/generate_schema.py) and the PodGroup CRD's."""

import json
import os
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tasks import k8s_job
from tasks.bounds import stage_timeout_s
from tasks.launcher import DEVICE_STAGES, MULTI_NODE_STAGES, runs_on_kubernetes
from tasks.stages import STAGES

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "k8s"
K8S = json.loads((FIXTURES / "k8s-api-schema.json").read_text())
PODGROUP = json.loads((FIXTURES / "volcano-podgroup-v1beta1.schema.json").read_text())


def validate(manifest: dict) -> None:
    """Validate one manifest against its kind's API schema (strict: unknown fields fail, as `--validate=strict`)."""
    if manifest["kind"] == "PodGroup":
        jsonschema.validate(manifest, PODGROUP)
        return
    api = f"{manifest['apiVersion']}/{manifest['kind']}"
    root = K8S["roots"][api]
    schema = {"$ref": f"#/definitions/{root}", "definitions": K8S["definitions"]}
    jsonschema.validate(manifest, schema)
    assert manifest["metadata"]["name"]


@pytest.fixture
def k8s_cfg(cfg):
    cfg.hardware.launcher = "kubernetes"
    cfg.hardware.k8s_image = "registry.example/llm-pipeline:ascend"
    cfg.hardware.nnodes, cfg.hardware.nproc_per_node = 2, 8
    return cfg


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


def has_cncf_provider() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("airflow.providers.cncf") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(has_cncf_provider(), reason="the cncf provider is installed: the task would submit to a cluster")
def test_the_smoke_task_goes_to_the_kubernetes_launcher(tmp_path, airflow_db):
    """Through Airflow: with launcher=kubernetes the smoke task (a device stage) does not run on the worker; it asks
    for the Kubernetes launcher (here: the provider is not installed, so the one-line cause says what to install)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LLM_PIPELINE_VAR_DIR": str(tmp_path / "var"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}",
    }
    params = json.dumps({"preset": "ci-tiny", "launcher": "kubernetes"})
    cmd = f"source scripts/airflow-env.sh && airflow tasks test llm_pipeline smoke 2026-01-05 -t '{params}'"
    out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    text = out.stdout + out.stderr
    assert "failed at smoke: hardware.launcher=kubernetes needs the cncf provider" in text, text[-3000:]
    assert not list(tmp_path.glob("var/runs/**/smoke.json"))  # nothing ran on the worker
