"""Strict validation of rendered manifests against the Kubernetes API models and the CRDs' own schemas
(tests/fixtures/k8s; the launcher and real-preset tests)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "k8s"
K8S = json.loads((FIXTURES / "k8s-api-schema.json").read_text())
PODGROUP = json.loads((FIXTURES / "volcano-podgroup-v1beta1.schema.json").read_text())
# A custom resource's schema by its hardware.k8s_kind name (kind_name): Volcano's Job, say, shares its `kind` with
# batch/v1's, never its name there.
CRDS = {
    "pytorchjob": json.loads((FIXTURES / "kubeflow-pytorchjob-v1.schema.json").read_text()),
    "trainjob": json.loads((FIXTURES / "kubeflow-trainjob-v1alpha1.schema.json").read_text()),
}


def kind_name(obj: dict) -> str | None:
    """The hardware.k8s_kind (a key of tasks/launch/k8s_job.KINDS) whose objects have this object's apiVersion and
    kind; None for another object (a Service, a PodGroup, a pod list, a Status). The test helpers' tables (CRDS,
    POD_NAMES, the loopback API's replies) are keyed by it."""
    from tasks.launch.k8s_job import KINDS

    for name, kind in KINDS.items():
        group, version, _, api_kind = kind.api or ("batch", "v1", "jobs", "Job")
        if (obj.get("apiVersion"), obj.get("kind")) == (f"{group}/{version}", api_kind):
            return name
    return None


@functools.cache
def validator(name: str):
    """A validator for one of the Kubernetes API's models (V1Job, V1PodTemplateSpec, V1EnvVar, …) or a CRD's kind,
    built once (jsonschema.validate would check the large schema against the metaschema on every call)."""
    if name in CRDS:
        return jsonschema.Draft7Validator(CRDS[name])
    if name == "PodGroup":
        return jsonschema.Draft7Validator(PODGROUP)
    return jsonschema.Draft7Validator({"$ref": f"#/definitions/{name}", "definitions": K8S["definitions"]})


def check(name: str, obj) -> None:
    error = jsonschema.exceptions.best_match(validator(name).iter_errors(obj))
    if error is not None:
        raise error


def k8s_model(name: str, obj) -> None:
    check(name, obj)


def validate(manifest: dict) -> None:
    """Validate one manifest against its kind's API schema (strict: unknown fields fail, as `--validate=strict`).
    A Kubeflow kind: its CRD's schema, and the Kubernetes parts inside it against the API's own models too."""
    if manifest["kind"] == "PodGroup":
        check("PodGroup", manifest)
        return
    if kind_name(manifest) in CRDS:
        check(kind_name(manifest), manifest)
        k8s_model("V1ObjectMeta", manifest["metadata"])
        spec = manifest["spec"]
        for replica in spec.get("pytorchReplicaSpecs", {}).values():
            k8s_model("V1PodTemplateSpec", replica["template"])
        if "trainer" in spec:
            k8s_model("V1ResourceRequirements", spec["trainer"]["resourcesPerNode"])
            for env in spec["trainer"]["env"]:
                k8s_model("V1EnvVar", env)
            for patch in spec["runtimePatches"]:
                for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
                    pod = job["template"]["spec"]["template"]["spec"]
                    for volume in pod["volumes"]:
                        k8s_model("V1Volume", volume)
                    if "affinity" in pod:
                        k8s_model("V1Affinity", pod["affinity"])
                    for mount in pod["containers"][0]["volumeMounts"]:
                        k8s_model("V1VolumeMount", mount)
        return
    api = f"{manifest['apiVersion']}/{manifest['kind']}"
    check(K8S["roots"][api], manifest)
    assert manifest["metadata"]["name"]
