"""The one registry of stages, in pipeline order: name → module holding `run(cfg, ctx)`."""

STAGES = {
    "env": "tasks.stages.env",
    "shard": "tasks.stages.shard",
    "smoke": "tasks.stages.smoke",
    "plan": "tasks.stages.plan",
    "train": "tasks.stages.train",
    "profile": "tasks.stages.profile",
    "quantize": "tasks.stages.quantize",
    "evaluate": "tasks.stages.evaluate",
}

# Stages on their own schedule, outside the pipeline's order (their own DAG); the runner runs them like the others.
OWN_SCHEDULE = {
    "health": "tasks.stages.health",
}

# What each stage shows in the end-of-run summary (the Airflow task id equals the stage name).
TITLES = {
    "env": "Environment validation",
    "shard": "WebDataset sharding",
    "smoke": "Smoke run (FP32 → BF16)",
    "plan": "Parallel plan",
    "train": "Hybrid-parallel training",
    "profile": "Profiling",
    "quantize": "INT8 quantization",
    "evaluate": "Evaluation & registry",
}
