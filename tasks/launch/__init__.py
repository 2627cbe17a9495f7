"""Launching: where each stage runs and how its processes start (docs/launchers.md adds a launcher kind).

- placement.py   hardware.launcher: which stages leave the Airflow worker, the Celery queue of the others
- torchrun.py    a stage's ranks on this node: process count, torchrun argv and environment, the bounded run
- agent.py       torchrun for CPU ranks: torch.distributed.run's agent forking ranks after their imports
- binding.py     host binding, the launcher's side: each local rank's cores (applied by tasks/parallel/affinity.py)
- k8s_job.py     a device stage as Kubernetes objects (Job, PyTorchJob, TrainJob): render, final state, collect
- k8s_submit.py  the Airflow side of hardware.launcher=kubernetes: submit through the cncf hook, wait, clean up
"""
