"""Memory estimator and parallel-strategy planner (the logic behind the `plan` stage).

memory.py   per-device bytes: ZeRO model states, Korthikanti activations, pipeline in-flight micro-batches
cluster.py  cluster presets (910b, 910c, a100-80g, h100-80g, cpu-laptop) and their overrides
search.py   enumeration of (dp, tp, pp, zero, recompute, micro-batch, schedule), step-time model, ranking
table.py    the ranked table with rejection reasons
"""
from tasks.parallel.layout import Layout
from tasks.planner.memory import ModelShape, estimate, estimate_for_run, shape_of
from tasks.units import GB

__all__ = ["GB", "Layout", "ModelShape", "estimate", "estimate_for_run", "shape_of"]
