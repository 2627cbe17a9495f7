"""Memory estimator and parallel-strategy planner (the logic behind the `plan` stage).

The model is the one shape type, tasks.shape.TransformerConfig (dense or mixture of experts).

memory.py   per-device bytes: ZeRO model states, Korthikanti activations, pipeline in-flight micro-batches
cluster.py  cluster presets (910b, 910c, a100-80g, h100-80g, cpu-laptop) and their overrides
moe.py      the mixture-of-experts planner (dp/ep/zero/recompute/micro-batch)
search.py   enumeration of (dp, tp, pp, zero, recompute, micro-batch, schedule), step-time model, ranking
table.py    the ranked table with rejection reasons
"""

from tasks.layout import Layout
from tasks.planner import moe
from tasks.planner.memory import dense_estimate_for_run, estimate
from tasks.shape import TransformerConfig
from tasks.units import GB

__all__ = ["GB", "Layout", "estimate", "estimate_for_run"]


def estimate_for_run(
    tcfg: TransformerConfig, seq_len: int, micro_batch: int, dp: int = 1, tp: int = 1, pp: int = 1, **kw
) -> int:
    """Estimated peak bytes one device allocates for a run: a mixture-of-experts model (tp = pp = 1) sized by
    moe.py (its experts, routed activations, all-to-all buffers), any other by memory.dense_estimate_for_run."""
    if tcfg.n_experts and tp == pp == 1:
        keep = ("zero", "recompute", "recompute_every", "precision", "microbatches")
        return moe.estimate_for_run(tcfg, seq_len, micro_batch, dp=dp, **{k: v for k, v in kw.items() if k in keep})
    return dense_estimate_for_run(tcfg, seq_len, micro_batch, dp=dp, tp=tp, pp=pp, **kw)
