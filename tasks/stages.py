"""The one registry of stages, in pipeline order: name → module holding `run(cfg, ctx)`."""

STAGES = {
    "env": "tasks.env",
    "shard": "tasks.shard",
    "smoke": "tasks.smoke",
    "plan": "tasks.plan",
    "train": "tasks.train",
    "profile": "tasks.profile",
    "quantize": "tasks.quantize",
    "evaluate": "tasks.evaluate",
}

# Stages on their own schedule, outside the pipeline's order (their own DAG); the runner runs them like the others.
OWN_SCHEDULE = {
    "health": "tasks.health",
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
