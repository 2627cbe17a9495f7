"""INT8 quantization and evaluation helpers: backend choice (plan), AMCT configs, torchao, metrics, registry gate."""
