"""Model architectures, keyed by config.json ``model_type``."""

SUPPORTED = ("bert", "qwen3")
