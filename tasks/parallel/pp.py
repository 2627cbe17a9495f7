"""Pipeline parallelism with torch.distributed.pipelining: each stage is a copy of the (meta) model with the
layers it does not own deleted — names stay global ("layers.5"), so checkpoints and seeded init are layout-free.

Stages are placed loop-style: with pp ranks and v stages per rank (interleaved 1F1B), rank r owns stages
r, r + pp, r + 2·pp, …
"""

from __future__ import annotations

import copy


def layer_ranges(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, as even as possible; earlier stages take the remainder (later ones hold the
    output projection and the loss)."""
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        end = start + base + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def split_model(model, pp_rank: int, pp: int, per_rank: int) -> list[tuple[int, object]]:
    """[(stage_index, stage_module)] for this rank; `model` is on the meta device (deep copies are free)."""
    n_stages = pp * per_rank
    ranges = layer_ranges(len(model.layers), n_stages)
    parts = []
    for k in range(per_rank):
        stage = pp_rank + k * pp
        lo, hi = ranges[stage]
        part = copy.deepcopy(model)
        for name in list(part.layers.keys()):
            if not lo <= int(name) < hi:
                del part.layers[name]
        if stage != 0:
            part.tok_embeddings = None
        if stage != n_stages - 1:
            part.norm = None
            part.output = None
        parts.append((stage, part))
    return parts


def build_schedule(schedule: str, parts, n_stages: int, device, pp_group, n_microbatches: int, loss_fn):
    """The pipeline schedule over this rank's stage modules (already parallelised and materialised)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    stages = [PipelineStage(module, index, n_stages, device, group=pp_group) for index, module in parts]
    for stage in stages:
        _quiet_shape_inference(stage)
    if schedule == "interleaved1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches, loss_fn=loss_fn)


def _quiet_shape_inference(stage) -> None:
    """torch.distributed.pipelining infers each stage's shapes on the first step by running its forward once more
    (real tensors on the first stage, filled ones after): that forward must not count in the MoE router statistics
    (tasks.model.moe.stats_paused)."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:  # a torch without it infers otherwise: nothing to quiet
        return
    from tasks.model.moe import stats_paused

    def quiet(*args, **kwargs):
        with stats_paused():
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = quiet
