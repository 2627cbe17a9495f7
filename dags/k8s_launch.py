"""The Airflow side of hardware.launcher=kubernetes: submit a device stage's Job, wait within its bound, collect.

Called from the main DAG's stage tasks (never at parse time) for env, smoke, train, profile, quantize and evaluate
(tasks/launcher.py). The cncf provider (requirements-k8s.txt) is imported inside the call, so the DAGs parse without
it. The connection `kubernetes_default` (in-cluster, or a kubeconfig) chooses the cluster. Not a DAG file: listed in
dags/.airflowignore.
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
            "pip install -r requirements-k8s.txt on the Airflow workers"
        ) from None
    return KubernetesHook(conn_id=conn_id)


def _describe_pods(hook, namespace: str, name: str) -> str:
    """What the Job's pods are doing, in one line: "x-0 Pending (Unschedulable: 0/4 nodes …), x-1 Running"."""
    pods = hook.core_v1_client.list_namespaced_pod(namespace=namespace, label_selector=f"job-name={name}").items
    if not pods:
        return "no pod was created (quota, admission, or the PodGroup waits for all of them)"
    out = []
    for p in pods:
        why = [f"{c.reason}: {c.message}" for c in (p.status.conditions or []) if c.status != "True" and c.reason]
        out.append(f"{p.metadata.name} {p.status.phase}" + (f" ({'; '.join(why)[:200]})" if why else ""))
    return ", ".join(out)


def run_stage_job(
    stage: str,
    cfg,
    dag_id: str,
    run_id: str,
    try_number: int = 1,
    conn_id: str = "kubernetes_default",
    poll_s: float = 30.0,
) -> dict:
    from tasks import k8s_job, tracking
    from tasks.errors import StageError
    from tasks.runner import default_run_dir

    hook = _hook(conn_id)
    run_dir = default_run_dir(dag_id, run_id)
    parent = tracking.parent_run(cfg, dag_id, run_id, try_number) if cfg.tracking.enabled else None
    name = k8s_job.job_name(dag_id, run_id, try_number, stage)
    namespace = cfg.hardware.k8s_namespace
    manifests = k8s_job.render(cfg, run_dir, name, stage)
    group, version, plural = k8s_job.PODGROUP_API
    custom = [m for m in manifests if m["kind"] == "PodGroup"]
    for pg in custom:  # the PodGroup first: Volcano binds the pods to it by annotation
        hook.create_custom_object(group=group, version=version, plural=plural, body=pg, namespace=namespace)
    hook.apply_from_yaml_file(yaml_objects=[m for m in manifests if m["kind"] != "PodGroup"], namespace=namespace)
    try:

        def status():
            job = hook.get_job_status(job_name=name, namespace=namespace)
            if not hook.is_job_complete(job=job):
                return False, ""
            return True, hook.is_job_failed(job=job) or ""

        try:
            _, reason = k8s_job.wait_for_job(
                status,
                name,
                k8s_job.deadline_s(stage, cfg, run_dir),
                poll_s,
                describe=lambda: _describe_pods(hook, namespace, name),
            )
        except StageError:
            hook.batch_v1_client.delete_namespaced_job(name=name, namespace=namespace, propagation_policy="Foreground")
            raise
        if reason:
            # train is retryable: the next try submits a new Job that resumes from the DCP checkpoint.
            raise StageError(k8s_job.failure_cause(run_dir, name, reason, stage), retryable=stage == "train")
        return k8s_job.collect_result(run_dir, name, parent, tracking.tracking_uri(cfg), stage)
    finally:
        # The Service and PodGroup only serve this Job; the Job and its pods stay for `kubectl logs` until its TTL.
        try:
            if any(m["kind"] == "Service" for m in manifests):
                hook.core_v1_client.delete_namespaced_service(name=name, namespace=namespace)
            for pg in custom:
                hook.delete_custom_object(
                    group=group, version=version, plural=plural, name=pg["metadata"]["name"], namespace=namespace
                )
        except Exception as e:  # already gone, or no permission: the job's own outcome is what matters
            log.warning("could not delete the service/podgroup of %s/%s: %s", namespace, name, e)
