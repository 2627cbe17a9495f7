"""Tensor parallelism: torchtitan's Llama plan (Megatron column/row split) with optional sequence parallelism.

Column-wise q/k/v and w1/w3 shard heads and the FFN width; row-wise wo/w2 reduce back. With sequence parallelism
the norms and the residual stream between blocks stay sharded along the sequence (Shard(1)), so activations outside
attention/FFN shrink by the TP degree; without it, every TP rank holds the full sequence.

Tied embeddings (Qwen2-0.5B/1.5B): the embedding (RowwiseParallel on nn.Embedding: weight Shard(0), the vocabulary)
and the output projection (ColwiseParallel on nn.Linear: weight Shard(0), the vocabulary) place the shared weight
alike, but each style registers its own new DTensor parameter (torch/distributed/tensor/parallel/style.py
`_partition_embedding_fn` / `_partition_linear_fn`); re-tying right away leaves one parameter that both uses'
gradients accumulate into, as on one process. (materialize re-ties after to_empty too, but FSDP2 wraps the part
before that: without this re-tie its root unit would also manage the stale second copy — one more sharded tensor
gathered and reduce-scattered every step.)
"""
from __future__ import annotations


def apply_tp(model, tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    seq = Shard(1) if sequence_parallel else Replicate()
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True)
    if top:
        parallelize_module(model, tp_mesh, top)
        model.tie_weights()  # a no-op unless the model ties its embeddings (and this part holds both ends)
    for block in model.layers.values():
        plan = {
            # The rope table (second input) stays a plain tensor: every rank needs all of it.
            "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None),
                                            use_local_output=True),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
