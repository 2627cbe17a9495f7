"""The trainer: one rank of a training run (torchrun starts `python -m tasks.train.worker`), and the one train step.

    worker.py        torchrun entry: process group, one Trainer per launch spec, HF export; exit codes
    trainer.py       Trainer: __init__ is the list of build steps, train_step does one step, checkpoint, finish
    build.py         the build steps: build_mesh, choose_resume, build_model (+ parallelize), build_optimizer,
                     build_step, build_loader
    step.py          TrainStep (shared with the smoke stage), PlainStep / PipelineStep, global_loss
    hooks.py         step hooks (Hook, StopTraining) and the built-in ones: heartbeats, fault injection, ZeRO evidence,
                     the rehearsal
    loss_scale.py    FP16's dynamic loss scaler (the inf check all-reduced over every rank)
    router_stats.py  MoE router statistics reduced over all ranks
    failures.py      diagnosis.json (divergence guard) and failures/<kind>-rank-K.json (OOM, timeout)

How to add a step hook or a model converter: docs/trainer.md.
"""
