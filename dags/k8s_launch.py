"""The Airflow side of hardware.launcher=kubernetes: submit the rendered training Job, wait, return its result.

Called from the main DAG's train task (never at parse time). The cncf provider (requirements-k8s.txt) is imported
inside the call, so the DAGs parse without it. The connection `kubernetes_default` (in-cluster, or a kubeconfig)
chooses the cluster. Not a DAG file: listed in dags/.airflowignore.
"""
from __future__ import annotations


def run_train_job(cfg, dag_id: str, run_id: str, try_number: int = 1, conn_id: str = "kubernetes_default",
                  poll_s: float = 30.0) -> dict:
    from tasks import k8s_job, tracking
    from tasks.errors import StageError
    from tasks.runner import default_run_dir

    try:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    except ImportError as e:
        raise StageError(f"hardware.launcher=kubernetes needs the cncf provider ({e}); "
                         "pip install -r requirements-k8s.txt on the Airflow workers") from None

    run_dir = default_run_dir(dag_id, run_id)
    parent = tracking.parent_run(cfg, dag_id, run_id, try_number) if cfg.tracking.enabled else None
    name = k8s_job.job_name(dag_id, run_id, try_number)
    namespace = cfg.hardware.k8s_namespace
    hook = KubernetesHook(conn_id=conn_id)
    hook.apply_from_yaml_file(yaml_objects=k8s_job.render(cfg, run_dir, name), namespace=namespace)
    try:
        job = hook.wait_until_job_complete(job_name=name, namespace=namespace, job_poll_interval=poll_s)
        reason = hook.is_job_failed(job=job)
        if reason:
            # Retryable: the next try submits a new Job that resumes from the DCP checkpoint on the shared volume.
            raise StageError(k8s_job.failure_cause(run_dir, name, reason), retryable=True)
        return k8s_job.collect_result(run_dir, name, parent, tracking.tracking_uri(cfg))
    finally:
        # The Service only serves this Job's rendezvous; the Job and its pods stay for `kubectl logs` until its TTL.
        try:
            hook.core_v1_client.delete_namespaced_service(name=name, namespace=namespace)
        except Exception as e:  # already gone, or no permission: the job's own outcome is what matters
            import logging

            logging.getLogger(__name__).warning("could not delete service %s/%s: %s", namespace, name, e)
