"""Prometheus metrics, in a registry per app (tests build many apps in one process)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

UNSERVED_SHAPES = 64
"""Distinct (method, path shape) labels of ``flywheel_unserved_routes`` before the rest count as ``other``."""
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "flywheel_requests", "Model requests by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "flywheel_request_seconds",
            "Model request latency (to last byte)",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "flywheel_time_to_first_token_seconds", "Streamed time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tokens = Counter("flywheel_tokens", "Tokens through the proxy", ["kind"], registry=r)
        self.episodes = Counter("flywheel_episodes", "Episodes created and finished", ["event"], registry=r)
        self.recorded = Counter("flywheel_calls_recorded", "Calls committed to the store", registry=r)
        self.commit_seconds = Histogram(
            "flywheel_store_commit_seconds", "Group commit duration", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("flywheel_store_queue_depth", "Calls waiting for their commit", registry=r)
        self.calls_stored = Gauge(
            "flywheel_store_calls_stored",
            "Calls this process stored, by layout (delta: new prompt ids and messages only, on an earlier call; "
            "whole: a first call, a break, or ids and messages that could not be compared exactly)",
            ["layout"],
            registry=r,
        )
        self.base_reads = Gauge(
            "flywheel_store_base_reads",
            "Episodes whose last call was read back from the store (cache misses)",
            registry=r,
        )
        self.replicas_healthy = Gauge("flywheel_replicas_healthy", "Healthy vLLM replicas", registry=r)
        self.upstream_waiting = Gauge(
            "flywheel_upstream_waiting",
            "Model requests sent upstream whose answer (non-streamed) or first bytes (streamed) have not arrived",
            registry=r,
        )
        self.policy_version = Gauge("flywheel_policy_version", "Current policy version", registry=r)
        self.canary_version = Gauge(
            "flywheel_canary_version", "The running canary's policy version (0: no canary runs)", registry=r
        )
        self.canary_decisions = Counter(
            "flywheel_canary_decisions",
            "Canary decisions this proxy recorded, by verdict and whether made by hand",
            ["verdict", "manual"],
            registry=r,
        )
        self.dropped = Counter(
            "flywheel_dropped_fields", "Request fields dropped to protect the engine", ["field"], registry=r
        )
        self.admission_refused = Counter(
            "flywheel_admission_refused",
            "POST /groups answered 429 backlog_full: the groups ahead of the trainer filled its staleness window",
            registry=r,
        )
        self.key_reloads = Counter(
            "flywheel_admin_key_reloads",
            "Admin key file reads that changed the keys (rotated) or could not be used (refused)",
            ["outcome"],
            registry=r,
        )
        self.retiring_used = Counter(
            "flywheel_auth_retiring_used",
            "Requests accepted under an admin key in its grace window (or an episode key it signed), by role: "
            "clients that have not switched to the new key yet",
            ["role"],
            registry=r,
        )
        self.retiring_keys = Gauge(
            "flywheel_auth_retiring_keys", "Admin keys out of the key file, still in their grace window", registry=r
        )

        self.splices = Counter(
            "flywheel_splices",
            "Follow-up calls by token splice outcome "
            "(spliced, unchanged: the render already held the sampled ids, skipped)",
            ["outcome"],
            registry=r,
        )
        self.splice_shadow = Counter(
            "flywheel_splice_shadow",
            "Planned splices by shadow check result: agree (the spliced prompt is vLLM's render outside the "
            "sampled ids), a mismatch's cause (prefix, closing, tail), unchecked (not drawn, or spans unknown)",
            ["result"],
            registry=r,
        )

        self.forks = Counter(
            "flywheel_fork_calls",
            "Calls of fork episodes by replay outcome: replayed (answered from the source's record), "
            "diverged (the request differed: the replay ended there), sampled (after the fork point)",
            ["outcome"],
            registry=r,
        )

        self.teacher_calls = Counter(
            "flywheel_teacher_calls",
            "Calls a teacher answered (metadata.source teacher:<name>), by teacher and how their ids were recorded: "
            "rendered (the student's template, exact), mismatch (the rendering with the answer does not extend the "
            "prompt's: recorded inexact), unrendered (the student's engine has no render route: no ids)",
            ["teacher", "ids"],
            registry=r,
        )

        self.refused = Counter(
            "flywheel_refused_calls",
            "Model calls refused with a 4xx (by the proxy, or by the engine: upstream_rejected), by route (the API) "
            "and reason (the error's code, else its type); each is also a failed call on its episode when known",
            ["route", "reason"],
            registry=r,
        )
        self.compat = Counter(
            "flywheel_compat_fields",
            "Fields of Responses and Messages requests accepted without effect (ignored), served another way "
            "(mapped) or hosted tools removed (dropped), by API, rule and field (other: a field unknown here)",
            ["api", "rule", "field"],
            registry=r,
        )
        self.unserved = Counter(
            "flywheel_unserved_routes",
            "Requests on a route the proxy lacks (404) or with a method it does not serve there (405), by method "
            "and path shape (ids as {id}; past 64 shapes, other): a client speaking an API or version not served",
            ["method", "path"],
            registry=r,
        )
        self._unserved_shapes: set[tuple[str, str]] = set()

    def on_compat(self, api: str, decisions: Iterable[tuple[str, str]]) -> None:
        """Count what ``proxy/compat.py`` decided for one request: (rule, field) pairs."""
        for rule, field in decisions:
            self.compat.labels(api, rule, field).inc()

    def on_unserved(self, method: str, shape: str) -> None:
        """Count a request no route serves; the label set is bounded (a scanner's paths would be unbounded)."""
        key = (method, shape)
        if key not in self._unserved_shapes:
            if len(self._unserved_shapes) >= UNSERVED_SHAPES:
                key = (method, "other")
            else:
                self._unserved_shapes.add(key)
        self.unserved.labels(*key).inc()

    def on_batch(self, calls: int, seconds: float) -> None:
        self.recorded.inc(calls)
        self.commit_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
