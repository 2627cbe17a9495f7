"""lm-evaluation-harness as the evaluation engine: the project's models as an lm-eval `LM` (lm.py), their tokenizers
and loading (models.py), evaluate.tasks loaded, checked and scored (suite.py), and the demo task written from a
shard set's val split (demo_task.py)."""
