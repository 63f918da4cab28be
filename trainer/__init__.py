"""Flywheel trainer: GRPO on a LoRA adapter from the proxy's recorded groups (``python -m trainer run``)."""
