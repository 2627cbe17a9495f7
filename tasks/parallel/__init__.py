"""Hybrid parallelism behind the training stage: one DeviceMesh over pp × dp × tp.

Per model part the order is fixed (torchtitan's): split for PP → TP → activation checkpointing → FSDP, then
materialise the weights (tasks/train/build.py). The per-rank entry that torchrun starts is tasks/train/worker.py;
`layout.py` checks a layout before any worker starts; `checkpoint.py` writes DCP checkpoints that load into any
other layout.
"""
