"""Flywheel proxy: an OpenAI-compatible front for vLLM that records every call of an episode."""
