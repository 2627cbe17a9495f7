"""The Airflow side of hardware.launcher=kubernetes: submit a device stage's Job, wait within its bound, collect.

Called from the main DAG's stage tasks (never at parse time) for env, smoke, train, profile, quantize and evaluate
(tasks/launch/placement.py). The cncf provider (requirements.txt) is imported inside the call, so the DAGs parse
without it. The connection `kubernetes_default` (in-cluster, or a kubeconfig) chooses the cluster. The manifests
and their reading back are tasks/launch/k8s_job.py's; this module only talks to the cluster.
"""

from __future__ import annotations

import json
import logging
import re

log = logging.getLogger(__name__)

ROLE = "llm-pipeline-launcher"  # the Role the 403 message tells an admin to create


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


def _describe_pods(hook, namespace: str, name: str, selector: str = "job-name", failed_only: bool = False) -> str:
    """What the job's pods are doing, in one line: "x-0 Pending (Unschedulable: 0/4 nodes …), x-1 Running", a
    finished container's exit code and reason ("x-1-abcde Failed (exit 137 OOMKilled)")."""
    pods = hook.core_v1_client.list_namespaced_pod(namespace=namespace, label_selector=f"{selector}={name}").items
    if failed_only:
        pods = [p for p in pods if p.status.phase == "Failed"]
    elif not pods:
        return "no pod was created (quota, admission, or the PodGroup waits for all of them)"
    out = []
    for p in pods:
        why = [f"{c.reason}: {c.message}" for c in (p.status.conditions or []) if c.status != "True" and c.reason]
        for c in p.status.container_statuses or []:
            done = c.state.terminated if c.state else None
            if done is not None and done.exit_code:
                why.append(f"exit {done.exit_code}" + (f" {done.reason}" if done.reason else ""))
        out.append(f"{p.metadata.name} {p.status.phase}" + (f" ({'; '.join(why)[:200]})" if why else ""))
    return ", ".join(out)


def _api_status(error) -> dict:
    """The API server's `Status` reply (code, reason, message, details) inside a client error, or {}. The kubernetes
    client raises ApiException with the reply's body; its create_from_yaml (the hook's apply_from_yaml_file) wraps
    one per object in FailToCreateError."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.utils import FailToCreateError

    if isinstance(error, FailToCreateError) and error.api_exceptions:
        error = error.api_exceptions[0]
    if not isinstance(error, ApiException):
        return {}
    try:
        body = json.loads(error.body or "")
    except (TypeError, ValueError):
        return {}
    return body if isinstance(body, dict) and body.get("kind") == "Status" else {}


def launcher_resources(kind: str, volcano: bool) -> list[str]:
    """What the Airflow workers' identity creates, reads and deletes in hardware.k8s_namespace (kubectl's
    resource.group[/subresource] form): the one-pod stages' Jobs and their pods always; the Indexed Job's Service,
    the Volcano PodGroup, or the Kubeflow kind's custom resource."""
    from tasks.launch import k8s_job

    resources = ["jobs.batch", "jobs.batch/status", "pods"]
    if k8s_job.KINDS[kind].api is None:
        resources.append("services")
    else:
        group, _, plural, _ = k8s_job.KINDS[kind].api
        resources.append(f"{plural}.{group}")
    if volcano:
        group, _, plural = k8s_job.PODGROUP_API
        resources.append(f"{plural}.{group}")
    return resources


class _Submitted:
    """One stage's training job on the cluster, whatever its kind (hardware.k8s_kind): submit, status, delete."""

    def __init__(self, hook, kind: str, manifests: list[dict], namespace: str, stage: str = "train", volcano=False):
        from tasks.launch import k8s_job

        self.hook, self.kind, self.manifests, self.namespace = hook, kind, manifests, namespace
        self.stage, self.volcano = stage, volcano
        self.main = manifests[-1]
        self.name = self.main["metadata"]["name"]
        self.api = k8s_job.KINDS[kind].api  # (group, version, plural, kind) of a custom resource; None: a Job

    def refused(self, error):
        """The API server's refusal of a request as one StageError line naming the cause and the fix, or None
        (an error that is not AlreadyExists or Forbidden goes up as it is)."""
        from tasks.errors import StageError

        status = _api_status(error)
        reason, message = status.get("reason"), status.get("message", "")
        details = status.get("details") or {}
        resource = ".".join(filter(None, (details.get("kind"), details.get("group"))))
        where = f"{self.stage} job {self.name} in namespace {self.namespace}"
        if reason == "AlreadyExists":
            return StageError(
                f"{where}: {message} (409 AlreadyExists: left by an earlier submission of this try); delete it "
                f"(kubectl delete {resource} {details.get('name') or self.name} -n {self.namespace}) and clear the task"
            )
        if reason == "Forbidden":
            who = re.search(r'User "([^"]+)" cannot (\S+) resource', message)
            user, verb = who.groups() if who else ("the Airflow workers' identity", "use")
            subject = (
                f"--serviceaccount={user.removeprefix('system:serviceaccount:')}"
                if user.startswith("system:serviceaccount:")
                else f"--user={user}"
            )
            resources = ",".join(launcher_resources(self.kind, self.volcano))
            return StageError(
                f"{where}: the cluster does not let {user} {verb} {resource} (403 Forbidden: {message}); grant the "
                f"launcher's role: kubectl create role {ROLE} -n {self.namespace} --verb=create,get,list,delete "
                f"--resource={resources} && kubectl create rolebinding {ROLE} -n {self.namespace} --role={ROLE} "
                f"{subject}"
            )
        return None

    def call(self, fn, *args):
        """fn(*args), with the API server's AlreadyExists/Forbidden as one line (the client's own error otherwise)."""
        try:
            return fn(*args)
        except Exception as e:
            refusal = self.refused(e)
            if refusal is None:
                raise
            raise refusal from None

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

    def describe(self, failed_only: bool = False) -> str:
        from tasks.launch import k8s_job

        selector = k8s_job.KINDS[self.kind].pod_selector
        return _describe_pods(self.hook, self.namespace, self.name, selector, failed_only)

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
    poll_s: float = 5.0,  # one GET per Job every 5 s: a short stage's end is seen in seconds, not up to 30 s late
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
    manifests = k8s_job.render(cfg, run_dir, name, stage, try_number)
    volcano = cfg.hardware.k8s_scheduler == "volcano"
    job = _Submitted(hook, kind, manifests, cfg.hardware.k8s_namespace, stage, volcano)
    k8s_job.set_aside_result(run_dir, name, stage)  # an earlier try's result must not pass for this job's
    job.call(job.submit)
    try:
        try:
            _, reason = k8s_job.wait_for_job(
                lambda: job.call(job.status),
                name,
                k8s_job.deadline_s(stage, cfg, run_dir),
                poll_s,
                describe=job.describe,
            )
        except StageError:
            try:  # a job nobody waits for would hold the nodes until its deadline
                job.delete()
            except Exception as e:  # the cause of the failure matters more than a failed delete
                log.warning("could not delete %s/%s: %s", job.namespace, name, str(e).splitlines()[0])
            raise
        if reason:
            try:  # the failed pods' exit codes, for when node 0 could not write its own cause (OOM kill, node loss)
                pods = job.describe(failed_only=True)
            except Exception as e:  # the job's own failure matters more than a failed description
                pods = f"pods not described: {str(e).splitlines()[0]}"
            cause = k8s_job.failure_cause(run_dir, name, reason, stage, pods, k8s_job.KINDS[kind].pod_selector)
            # train is retryable: the next try submits a new job that resumes from the DCP checkpoint.
            raise StageError(cause, retryable=stage == "train")
        selector = k8s_job.KINDS[kind].pod_selector
        return k8s_job.collect_result(run_dir, name, parent, tracking.tracking_uri(cfg), stage, selector)
    finally:
        try:
            job.cleanup()
        except Exception as e:  # already gone, or no permission: the job's own outcome is what matters
            log.warning("could not delete the service/podgroup of %s/%s: %s", job.namespace, name, e)
