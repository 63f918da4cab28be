"""HTTP routes: the model routes ``chat``, ``responses`` (OpenAI) and ``messages`` (Anthropic), each
served on the three mounts of ``mounts``; ``episodes`` (groups, episodes, rewards), ``policy``
(publishing adapters), ``trainer`` (claim/ack/metrics), ``ops`` (health and metrics) and ``probe``
(base URLs answering a connectivity check)."""
