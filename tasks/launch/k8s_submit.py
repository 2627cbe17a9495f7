"""The Airflow side of hardware.launcher=kubernetes: submit a device stage's Job, wait within its bound, collect.

Called from the main DAG's stage tasks (never at parse time) for env, smoke, train, profile, quantize and evaluate
(tasks/launch/placement.py). The cncf provider (requirements.txt) is imported inside the call, so the DAGs parse
without it. The connection `kubernetes_default` (in-cluster, or a kubeconfig) chooses the cluster. The manifests
and their reading back are tasks/launch/k8s_job.py's; this module only talks to the cluster.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def _hook(conn_id: str):
    from tasks.errors import StageError

    try:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    except ImportError as e:
        raise StageError(
            f"hardware.launcher=kubernetes needs the cncf provider ({e}); "
            "pip install -r requirements.txt -c constraints.txt on the Airflow workers"
        ) from None
    return KubernetesHook(conn_id=conn_id)


def _describe_pods(hook, namespace: str, name: str, selector: str = "job-name") -> str:
    """What the job's pods are doing, in one line: "x-0 Pending (Unschedulable: 0/4 nodes …), x-1 Running"."""
    pods = hook.core_v1_client.list_namespaced_pod(namespace=namespace, label_selector=f"{selector}={name}").items
    if not pods:
        return "no pod was created (quota, admission, or the PodGroup waits for all of them)"
    out = []
    for p in pods:
        why = [f"{c.reason}: {c.message}" for c in (p.status.conditions or []) if c.status != "True" and c.reason]
        out.append(f"{p.metadata.name} {p.status.phase}" + (f" ({'; '.join(why)[:200]})" if why else ""))
    return ", ".join(out)


class _Submitted:
    """One stage's training job on the cluster, whatever its kind (hardware.k8s_kind): submit, status, delete."""

    def __init__(self, hook, kind: str, manifests: list[dict], namespace: str):
        from tasks.launch import k8s_job

        self.hook, self.kind, self.manifests, self.namespace = hook, kind, manifests, namespace
        self.main = manifests[-1]
        self.name = self.main["metadata"]["name"]
        self.api = k8s_job.KINDS[kind].api  # (group, version, plural, kind) of a custom resource; None: a Job

    def submit(self) -> None:
        from tasks.launch import k8s_job

        if self.api:
            group, version, plural, _ = self.api
            self.hook.create_custom_object(group, version, plural, self.main, self.namespace)
            return
        group, version, plural = k8s_job.PODGROUP_API
        for pg in (m for m in self.manifests if m["kind"] == "PodGroup"):  # first: Volcano binds pods to it
            self.hook.create_custom_object(
                group=group, version=version, plural=plural, body=pg, namespace=self.namespace
            )
        objects = [m for m in self.manifests if m["kind"] != "PodGroup"]
        self.hook.apply_from_yaml_file(yaml_objects=objects, namespace=self.namespace)

    def status(self) -> tuple[bool, str]:
        from tasks.launch import k8s_job

        if self.api:
            group, version, plural, _ = self.api
            obj = self.hook.get_custom_object(group, version, plural, self.name, self.namespace)
        else:
            # the client's dict of a V1Job: its conditions' type/status/reason keys are the API's names
            obj = self.hook.get_job_status(job_name=self.name, namespace=self.namespace).to_dict()
        return k8s_job.final_state(self.kind, obj)

    def describe(self) -> str:
        from tasks.launch import k8s_job

        return _describe_pods(self.hook, self.namespace, self.name, k8s_job.KINDS[self.kind].pod_selector)

    def delete(self) -> None:
        if self.api:
            group, version, plural, _ = self.api
            self.hook.delete_custom_object(group, version, plural, self.name, self.namespace)
        else:
            self.hook.batch_v1_client.delete_namespaced_job(
                name=self.name, namespace=self.namespace, propagation_policy="Foreground"
            )

    def cleanup(self) -> None:
        """The Service and PodGroup only serve this Job; the job and its pods stay for `kubectl logs` (TTL)."""
        from tasks.launch import k8s_job

        group, version, plural = k8s_job.PODGROUP_API
        for m in self.manifests[:-1]:
            if m["kind"] == "Service":
                self.hook.core_v1_client.delete_namespaced_service(name=self.name, namespace=self.namespace)
            elif m["kind"] == "PodGroup":
                self.hook.delete_custom_object(
                    group=group, version=version, plural=plural, name=m["metadata"]["name"], namespace=self.namespace
                )


def run_stage_job(
    stage: str,
    cfg,
    dag_id: str,
    run_id: str,
    try_number: int = 1,
    conn_id: str = "kubernetes_default",
    poll_s: float = 30.0,
) -> dict:
    from tasks import tracking
    from tasks.launch import k8s_job
    from tasks.errors import StageError
    from tasks.runner import default_run_dir

    hook = _hook(conn_id)
    run_dir = default_run_dir(dag_id, run_id)
    parent = tracking.parent_run(cfg, dag_id, run_id, try_number) if cfg.tracking.enabled else None
    name = k8s_job.job_name(dag_id, run_id, try_number, stage)
    kind = k8s_job.kind_of(stage, cfg)
    job = _Submitted(hook, kind, k8s_job.render(cfg, run_dir, name, stage), cfg.hardware.k8s_namespace)
    job.submit()
    try:
        try:
            _, reason = k8s_job.wait_for_job(
                job.status, name, k8s_job.deadline_s(stage, cfg, run_dir), poll_s, describe=job.describe
            )
        except StageError:
            job.delete()
            raise
        if reason:
            # train is retryable: the next try submits a new job that resumes from the DCP checkpoint.
            raise StageError(k8s_job.failure_cause(run_dir, name, reason, stage), retryable=stage == "train")
        return k8s_job.collect_result(run_dir, name, parent, tracking.tracking_uri(cfg), stage)
    finally:
        try:
            job.cleanup()
        except Exception as e:  # already gone, or no permission: the job's own outcome is what matters
            log.warning("could not delete the service/podgroup of %s/%s: %s", job.namespace, name, e)
