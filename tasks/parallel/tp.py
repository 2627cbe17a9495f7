"""Tensor parallelism: torchtitan's Llama plan (Megatron column/row split) with optional sequence parallelism.

Column-wise q/k/v and w1/w3 shard heads and the FFN width; row-wise wo/w2 reduce back. With sequence parallelism
the norms and the residual stream between blocks stay sharded along the sequence (Shard(1)), so activations outside
attention/FFN shrink by the TP degree; without it, every TP rank holds the full sequence.

Mixture-of-experts blocks (tasks/model/moe.py), as torchtitan without expert-tensor parallelism: the block's input
is gathered to the full sequence (Replicate), the shared expert is split like the dense FFN (its row-wise w2
all-reduces), and the router, the shared-expert gate and the routed experts stay whole on every TP rank — each TP
rank routes the same tokens and computes the same routed result (under expert parallelism its own all-to-alls
within the EP group of its TP coordinate), so their gradients are equal on the TP ranks and need no reduction
over tp. The block's output goes back to the sequence layout (a local slice: no communication forward, an
all-gather of the gradient backward).

Tied embeddings (Qwen2-0.5B/1.5B): both uses of the shared weight are sharded along the hidden dimension — the
embedding column-wise (ColwiseParallel on nn.Embedding: weight Shard(1)), the output projection row-wise
(RowwiseParallel on nn.Linear: weight Shard(1); its partial logits are summed into the replicated logits the loss
takes, as the vocabulary-split projection all-gathers them) — so one DTensor parameter serves both. Not the vocabulary
split (Shard(0)) used untied: DTensor has no vocabulary-sharded strategy for aten::embedding_dense_backward
(torch/distributed/tensor/_ops/_embedding_ops.py), so that embedding's backward builds the whole vocab × hidden
gradient and reduce-scatters it (measured: two whole-vocabulary gradients at once, Qwen2-0.5B dp2×tp2 ran out of
memory on a 24 GB host). Each style registers its own new DTensor parameter (torch/distributed/tensor/parallel/
style.py `_partition_embedding_fn` / `_partition_linear_fn`); re-tying right away leaves one parameter that both
uses' gradients accumulate into, as on one process. (materialize re-ties after to_empty too, but FSDP2 wraps the
part before that: without this re-tie its root unit would also manage the stale second copy — one more sharded
tensor gathered and reduce-scattered every step.)
"""

from __future__ import annotations


def apply_tp(model, tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    tied = model.config.tie_embeddings
    top = {}
    if model.tok_embeddings is not None:
        # Tied: hidden-sharded (ColwiseParallel on nn.Embedding: weight Shard(1)), see the module docstring.
        top["tok_embeddings"] = (ColwiseParallel if tied else RowwiseParallel)(
            input_layouts=Replicate(), output_layouts=seq
        )
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = (RowwiseParallel if tied else ColwiseParallel)(
            input_layouts=seq, output_layouts=Replicate(), use_local_output=True
        )
    if top:
        parallelize_module(model, tp_mesh, top)
        model.tie_weights()  # a no-op unless the model ties its embeddings (and this part holds both ends)
    for block in model.layers.values():
        plan = {
            # The rope table (second input) stays a plain tensor: every rank needs all of it.
            "attention": PrepareModuleInput(
                input_layouts=(seq, None), desired_input_layouts=(Replicate(), None), use_local_output=True
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if "moe" in block._modules:
            plan["moe"] = PrepareModuleInputOutput(
                input_layouts=(seq,),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(seq,),
                use_local_output=True,
            )
            if block.moe.shared is not None:
                plan.update(
                    {
                        "moe.shared.w1": ColwiseParallel(),
                        "moe.shared.w3": ColwiseParallel(),
                        "moe.shared.w2": RowwiseParallel(output_layouts=Replicate()),
                    }
                )
        else:
            plan.update(
                {
                    "feed_forward": PrepareModuleInput(
                        input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
                    ),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(output_layouts=seq),
                    "feed_forward.w3": ColwiseParallel(),
                }
            )
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
