"""Memory estimator and parallel-strategy planner (the logic behind the `plan` stage).

memory.py   per-device bytes: ZeRO model states, Korthikanti activations, pipeline in-flight micro-batches
cluster.py  cluster presets (910b, 910c, a100-80g, h100-80g, cpu-laptop) and their overrides
search.py   enumeration of (dp, tp, pp, zero, recompute, micro-batch, schedule), step-time model, ranking
table.py    the ranked table with rejection reasons
"""

from tasks.layout import Layout
from tasks.planner import moe
from tasks.planner.memory import ModelShape, dense_estimate_for_run, estimate, shape_of
from tasks.units import GB

__all__ = ["GB", "Layout", "ModelShape", "estimate", "estimate_for_run", "shape_of"]


def estimate_for_run(tcfg, seq_len: int, micro_batch: int, dp: int = 1, tp: int = 1, pp: int = 1, **kw) -> int:
    """Estimated peak bytes one device allocates for a run: a mixture-of-experts model (tp = pp = 1) sized by
    moe.py (its experts, routed activations, all-to-all buffers), any other by memory.dense_estimate_for_run."""
    if getattr(tcfg, "n_experts", 0) and tp == pp == 1:
        keep = ("zero", "recompute", "precision", "microbatches")
        return moe.estimate_for_run(tcfg, seq_len, micro_batch, dp=dp, **{k: v for k, v in kw.items() if k in keep})
    return dense_estimate_for_run(tcfg, seq_len, micro_batch, dp=dp, tp=tp, pp=pp, **kw)
