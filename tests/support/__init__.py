"""Shared test helpers: real services (vLLM, the proxy as a process) and free ports."""
