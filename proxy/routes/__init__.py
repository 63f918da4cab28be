"""HTTP routes: ``chat`` (OpenAI surface), ``episodes`` (groups, episodes, rewards), ``policy``
(publishing adapters), ``trainer`` (claim/ack/metrics), ``ops`` (health and metrics)."""
