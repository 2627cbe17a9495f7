"""Where each stage runs: `hardware.launcher` local (this host) or kubernetes (a Job on the training nodes).

With kubernetes every device stage (env probe, smoke, train, profile, quantize, evaluate) runs as a Job in the
training image on the Ascend nodes; shard, plan and the summary stay on the Airflow worker, which only orchestrates:
it submits the Job, waits within the stage's bound (tasks/bounds.py) and reads `<stage>.json` back from the run
directory on the shared volume. Nothing here imports Airflow or talks to a cluster (tasks/launch/k8s_submit.py does).
"""

from __future__ import annotations

from tasks.config import PipelineConfig
from tasks.device import DEVICE_STAGES  # the stages that need the accelerator (defined in the device layer)

__all__ = ["DEVICE_STAGES", "MULTI_NODE_STAGES", "celery_queue", "runs_on_kubernetes"]
# Stages that run on every node (one pod per node, rendezvous at pod 0); the others use one pod.
MULTI_NODE_STAGES = ("env", "train", "profile")


def runs_on_kubernetes(stage: str, cfg: PipelineConfig) -> bool:
    return cfg.hardware.launcher == "kubernetes" and stage in DEVICE_STAGES


def celery_queue(stage: str, cfg: PipelineConfig) -> str | None:
    """The Celery queue of a stage's Airflow task: hardware.device_queue for a device stage that runs on the
    worker itself (launcher local); None (Airflow's default queue) otherwise — a Kubernetes-launched stage's task
    only submits and waits, any worker can do that."""
    if stage in DEVICE_STAGES and cfg.hardware.launcher == "local" and cfg.hardware.device_queue:
        return cfg.hardware.device_queue
    return None
