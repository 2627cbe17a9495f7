"""Measure what autograd really keeps for backward, to calibrate the activation estimate on any backend.

Peak-memory counters need an accelerator (on CPU the process RSS is dominated by the libraries), but the tensors
autograd saves are visible everywhere through `torch.autograd.graph.saved_tensors_hooks`.
"""

from __future__ import annotations


def saved_activation_bytes(model, tokens, loss_fn, autocast_dtype=None) -> int:
    """Bytes of distinct storages autograd saves during one forward + loss (parameters excluded)."""
    import contextlib

    import torch

    storages: dict[int, int] = {}
    # Parameters (and views of them, such as the transposed weight a linear layer saves) are model state.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    cast = (
        torch.autocast(tokens.device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        loss_fn(model(tokens), tokens)
    return sum(storages.values())
