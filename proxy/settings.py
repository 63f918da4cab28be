"""Proxy settings: one pydantic model, read from YAML with ``FLYWHEEL_*`` environment overrides.

Built once in the entrypoint (``python -m proxy serve``) and passed to ``create_app``; nothing here
is a module-level global, so a test can build as many apps as it likes.

Environment overrides use ``__`` for nesting: ``FLYWHEEL_STORE__URL=postgresql+asyncpg://...``,
``FLYWHEEL_AUTH__ADMIN_KEY=...``. ``FLYWHEEL_ADMIN_KEY`` and ``FLYWHEEL_ADMIN_KEY_FILE`` are accepted as short forms.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from contract.vocabulary import SeedRule
from proxy.canary import CanarySettings

ENV_PREFIX = "FLYWHEEL_"
Penalties = Literal["flag", "reject"]
"""What happens to a recorded call that sets a penalty (``SamplingSettings.penalties``)."""
Constrained = Literal["train", "exclude", "reject"]
"""What happens to a grammar-constrained recorded call (``SamplingSettings.constrained``)."""
CompatMode = Literal["lenient", "strict"]
"""How the translated APIs treat fields that are not *used* (``proxy/compat.py``)."""
HostedTools = Literal["drop", "reject"]
"""What happens to a hosted tool (web search, code interpreter...) offered to the model (``proxy/compat.py``)."""
SHORTCUTS = {
    "FLYWHEEL_ADMIN_KEY": ("auth", "admin_key"),
    "FLYWHEEL_ADMIN_KEY_FILE": ("auth", "admin_key_file"),
    "FLYWHEEL_STORE_URL": ("store", "url"),
}
MIN_KEY_CHARS = 16
"""The shortest admin key accepted, in settings and in the key file."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class UpstreamSettings(_Section):
    """One vLLM replica: an entry of ``upstreams``."""

    name: str
    """Replica name, recorded with every call it serves."""
    url: str
    """Base URL of a vLLM OpenAI server, without ``/v1``."""
    api_key: SecretStr | None = None
    """Bearer key the proxy sends to this replica (vLLM's ``--api-key``); None: no authorization header."""
    seed_rule: SeedRule = "drop"
    """What to do with ``seed`` on a sampled request (``contract.vocabulary.SeedRule``). Safe by
    default; set ``pass`` for GPU builds that take it."""


class TeacherSettings(_Section):
    """A stronger model served behind the proxy as a teacher: an entry of ``teachers``
    (``proxy/teachers.py``). An episode created with ``metadata.source: teacher:<name>`` has every
    chat call answered by it, recorded in the student's token space, never trained on-policy."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """What ``metadata.source`` names after ``teacher:``."""
    url: str
    """Base URL of an OpenAI-compatible server, without ``/v1`` (the scripted demonstrator,
    ``python -m workflows.tac.demonstrator``, or a larger model's vLLM)."""
    api_key: SecretStr | None = None
    """Bearer key sent to the teacher; None: no authorization header. Never logged."""
    model: str
    """The model name the teacher is asked for (the agent's requested name is replaced by it)."""


class CanaryRollout(_Section):
    """A published adapter first serves a share of new episodes (``policy.canary``; ``proxy/adapters.py``),
    and ``proxy/canary.py``'s test on their rewards promotes it or rolls it back. The test's fields are
    ``CanarySettings``'s, frozen into each canary when it starts: a running test never changes under it."""

    share: float = Field(default=0.0, ge=0.0, lt=1.0)
    """The share of new episodes a published adapter serves while its canary runs (drawn from each
    episode's id); the others stay on the current adapter. 0: off, a publish switches every caller at
    once. The first publish (nothing current yet) always switches everyone."""
    alpha: float = Field(default=0.05, gt=0, lt=1)
    """The most probability of ever rolling back, on evidence, a canary that is in truth not worse."""
    beta: float = Field(default=0.05, gt=0, lt=1)
    """The most probability of ever promoting a canary that is in truth worse by ``margin`` or more."""
    margin: float = Field(default=0.05, ge=0)
    """Non-inferiority margin in reward units: the canary is promoted once shown worse by less than this."""
    min_per_arm: int = Field(default=20, ge=1)
    """No automatic verdict before each arm holds this many rewards."""
    max_per_arm: int = Field(default=5000, ge=1)
    """Pairs after which ``at_cap`` decides if neither confidence bound crossed."""
    at_cap: Literal["rollback", "promote"] = "rollback"
    """The verdict at ``max_per_arm`` without evidence: ``rollback`` keeps the baseline (the safe default)."""
    low: float = 0.0
    """The lowest reward the workflow gives: a canary episode's reward below it is refused (400)."""
    high: float = 1.0
    """The highest reward the workflow gives: a canary episode's reward above it is refused (400)."""

    def test(self) -> CanarySettings:
        """The test's parameters (validated together there: ``low < high``, the margin, the cap)."""
        return CanarySettings.model_validate(self.model_dump(exclude={"share"}))

    @model_validator(mode="after")
    def _valid_test(self) -> CanaryRollout:
        self.test()
        return self


class PolicySettings(_Section):
    """The policy's model names and how its published adapter versions are loaded (``proxy/adapters.py``)."""

    aliases: list[str] = ["policy"]
    """Model names that mean "the current policy"; they route to the latest published adapter."""
    base_model: str = "policy-base"
    """The name vLLM serves the base model under (``--served-model-name``): version 0 of the policy."""
    adapter_prefix: str = "policy-v"
    """Published versions are loaded as ``{prefix}{N}``; a new name per version avoids vLLM's
    prefix-cache reuse across reloads under one name (vLLM issues 30931, 42125)."""
    keep_versions: int = Field(default=3, ge=1)
    """Adapters kept loaded on vLLM; requests still in flight on an older version keep working."""
    refresh_s: float = Field(default=0.5, gt=0)
    """How often a proxy re-reads the current version from the store (other replicas may publish)."""
    canary: CanaryRollout = CanaryRollout()
    """The canary rollout of published adapters (off by default: ``share`` 0)."""


class StoreSettings(_Section):
    """The store of episodes, calls, groups and policy versions (``proxy/store/``)."""

    url: str = "sqlite+aiosqlite:///data/flywheel.db"
    """SQLAlchemy async URL: SQLite (``sqlite+aiosqlite:///path``, the directory is created) or PostgreSQL
    (``postgresql+asyncpg://user:password@host/db``)."""
    batch_max: int = Field(default=512, ge=1)
    """Most call records written in one transaction (group commit)."""
    sqlite_synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    """NORMAL survives a process crash (kill -9); FULL also survives power loss, at an fsync per commit."""
    pool_size: int = Field(default=10, ge=1)
    """Pooled database connections per proxy process: on PostgreSQL, as many again may open under load;
    on SQLite, the fixed pool of read connections."""


class EpisodeSettings(_Section):
    """When idle episodes are abandoned, when a group completes, and how large a group may be."""

    deadline_s: float = Field(default=1800.0, gt=0)
    """An open episode with no call and no reward for this long is abandoned, so its group completes
    (one of a task in ``late_rewards.tasks`` starts awaiting its reward instead)."""
    reaper_interval_s: float = Field(default=5.0, gt=0)
    """How often (s) open episodes are checked against ``deadline_s``."""
    min_rewarded: int = Field(default=2, ge=1)
    """A group completes when every episode is rewarded or abandoned and at least this many are rewarded."""
    max_group_size: int = Field(default=1024, ge=1)
    """The most episodes one group may have: a larger ``size`` (``POST /groups``, a fork) is answered 400."""


class LateRewardSettings(_Section):
    """Episodes whose reward comes late (a human's review, a slow judge): they await it instead of
    being abandoned at ``episodes.deadline_s`` (``EpisodeStatus`` ``awaiting``). A workflow declares
    one with ``POST /episodes/{id}/await_reward``; these settings declare them by task."""

    tasks: list[str] = []
    """Task id patterns (``fnmatch``: ``*`` matches all, ``review-*`` a family): an open episode of
    such a task that idles past ``episodes.deadline_s`` starts awaiting its reward instead of being
    abandoned. Empty: only the workflow's own declaration makes an episode await."""
    max_wait_s: float | None = Field(default=None, gt=0)
    """An episode awaiting its reward this long (s) is abandoned (cause ``deadline``, the reason
    says so) and its group completes without it. None: it waits until rewarded or abandoned."""


class AuthSettings(_Section):
    """Keys: the admin key (every route), agent keys (model routes only), and throttling of wrong keys."""

    admin_key: SecretStr | None = None
    """Full access: control API, trainer API, every episode. Required unless ``admin_key_file`` is set."""
    admin_key_file: str | None = None
    """A file holding the admin key (first line; further lines: earlier keys still accepted). Wins
    over ``admin_key``, and is read again on SIGHUP and every ``key_reload_s``: the key rotates
    without a restart (``proxy/keyfile.py``). ``serve`` points it at ``data/admin.key`` unless
    ``FLYWHEEL_ADMIN_KEY`` is set."""
    key_reload_s: float = Field(5.0, ge=0)
    """How often each proxy process re-reads ``admin_key_file``; 0: only on SIGHUP."""
    rotation_grace_s: float = Field(3600.0, ge=0)
    """How long a key that left the key file still works (admin, its episode keys, its dashboard
    sessions) in each process that had it: longer than the episodes running at a rotation last."""
    agent_keys: list[SecretStr] = []
    """Keys that reach the model routes (any episode, and passthrough) but never the control API."""
    failed_limit: int = Field(30, ge=0)
    """Wrong keys one client may present within ``failed_window_s`` before every keyed request of
    its is answered 429 (``proxy/throttle.py``); 0: no limit (e.g. behind a reverse proxy)."""
    failed_window_s: float = Field(60.0, gt=0)
    """The window (s) over which a client's wrong keys are counted against ``failed_limit``."""

    @field_validator("admin_key")
    @classmethod
    def _strong_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_KEY_CHARS:
            raise ValueError(f"admin_key must be at least {MIN_KEY_CHARS} characters (try: openssl rand -hex 24)")
        return value

    @model_validator(mode="after")
    def _some_admin_key(self) -> AuthSettings:
        if self.admin_key is None and self.admin_key_file is None:
            raise ValueError("set auth.admin_key or auth.admin_key_file (env FLYWHEEL_ADMIN_KEY or _FILE)")
        return self


class SamplingSettings(_Section):
    """How recorded calls sample, so the trainer learns from the distribution vLLM sampled (``proxy/sampling.py``)."""

    generation_config: str | None = None
    """The model directory vLLM serves (or its ``generation_config.json``): its temperature, top_p,
    top_k and min_p are what vLLM applies when a request omits them. None: vLLM's neutral values.
    Either way the proxy sends every field explicitly, so the record is what vLLM applied."""
    defaults: dict[str, float] = {}
    """Overrides of the model's defaults (temperature, top_p, top_k, min_p) for omitted fields."""
    penalties: Penalties = "flag"
    """Requests setting a penalty, logit_bias, bad_words, allowed_token_ids, min_tokens or beam search:
    ``flag`` passes them on and marks the call ``penalized`` (context only, counted by the trainer);
    ``reject`` answers 400. Omitted penalties are always pinned neutral."""
    constrained: Constrained = "train"
    """Grammar-constrained calls (tool_choice required/named, response_format json): ``train`` on the
    unmasked policy with importance weights (forced tokens out of the loss), ``exclude`` (context
    only), or ``reject`` (400)."""


class SpliceSettings(_Section):
    """Token in, token out for an episode's follow-up calls (``proxy/splice.py``)."""

    enabled: bool = True
    """Earlier assistant turns reach vLLM as the ids it sampled, not re-rendered from their messages
    (needs vLLM's token API: ``vllm serve --enable-scale-out``, vLLM 0.32 or later). Off: vLLM renders
    every prompt from its messages; a turn that re-renders differently is a break for the trainer."""
    depth: int = Field(default=32, ge=1)
    """How many of the episode's newest calls are searched for the one a call continues. A harness's
    sub-agent (Claude Code's ``Agent`` tool) makes its calls between two of the main agent's, so the
    main agent's next call continues one that many calls back: at 4, a sub-agent of four calls broke
    the main lineage (``tests/integration/test_harnesses.py``). Each searched call is one row read."""
    reasoning: Literal["keep", "strip"] = "strip"
    """Templates that drop earlier turns' reasoning (Qwen3-style: the ``<think>`` block of an assistant
    turn before the latest user turn is not rendered) re-render every earlier turn differently, so
    each turn of a thinking model would start a sample of its own (quadratic training cost).
    ``keep``: the follow-up's prompt holds the sampled ids, reasoning included, and the rest of the
    render after that turn: one sequence per episode, what vLLM sees recorded and trained exactly,
    though it is not what the template alone would show the model. ``strip``: the template decides
    (the call goes the ordinary way, a break)."""
    shadow_share: float = Field(default=1.0, ge=0.0, le=1.0)
    """The share of spliced calls whose prompt is compared with vLLM's ordinary render of the same
    request outside the sampled ids (``proxy/shadow.py``; ``notes.splice.shadow``,
    ``flywheel_splice_shadow_total``). The splice makes that render anyway, so checking is one pass
    over two id lists: 1.0 checks every call; 0 turns the check off."""


class CompatSettings(_Section):
    """What the Responses and Messages routes do with each field a client sends (``proxy/compat.py``)."""

    mode: CompatMode = "lenient"
    """``lenient``: fields without effect here are accepted (listed in the call's ``notes.compat`` and
    counted), and mapped ones served as documented, so agent harnesses run unchanged; ``strict``:
    everything that is not *used* is refused with a 400 naming it."""
    hosted_tools: HostedTools = "drop"
    """Tools the provider would run (web search, code interpreter, ...): ``drop`` removes them from
    what the model sees (noted and counted); ``reject`` answers 400."""
    system_messages: Literal["turn", "merge"] = "turn"
    """A system message inside ``messages`` (Anthropic's mid-conversation system): ``turn`` keeps it
    a system turn where it stands (ChatML templates such as SmolLM2's and Qwen's render one
    anywhere); ``merge`` appends it to the leading system message, for templates that take a
    system message only first."""
    thinking_switch: str | None = None
    """The chat-template variable that turns the model's reasoning on and off (Qwen3:
    ``enable_thinking``), set from Anthropic's ``thinking`` (off without it, Anthropic's default); None:
    the model has no reasoning, and ``thinking`` is served as disabled."""
    reasoning_effort: bool = False
    """The chat template reads ``reasoning_effort`` (gpt-oss): effort hints (Responses'
    ``reasoning.effort``, Anthropic's ``output_config.effort``) are sent on; False: accepted without effect."""


class AdmissionSettings(_Section):
    """Backpressure on ``POST /groups`` (``proxy/admission.py``): refuse a group (429 with
    ``Retry-After``) that could only be trained after it went stale."""

    enabled: bool = True
    """Off: every group is admitted (no trainer's demand is enforced)."""
    slack: float = Field(default=1.0, gt=0)
    """Multiplies the derived limit ``(max_staleness + 1) * groups_per_step``. 1.0 admits exactly what
    the trainer can still take within its staleness bound; above 1 keeps a margin of ready groups
    (some may go stale), below 1 keeps the data fresher but may leave the trainer waiting."""
    max_backlog_groups: int | None = Field(default=None, ge=1)
    """A fixed limit instead of the derived one, enforced from the start (no trainer need be seen);
    the way to give several proxy replicas one limit (the backlog itself is counted in the store)."""
    trainer_timeout_s: float = Field(default=900.0, gt=0)
    """A trainer with no claim or renewal for this long is forgotten (its demand no longer limits
    admission), so a stopped trainer does not block rollouts forever."""
    retry_after_s: int = Field(default=5, ge=1)
    """``Retry-After`` while the trainer's step time is not yet known."""
    max_retry_after_s: int = Field(default=60, ge=1)
    """The longest ``Retry-After`` given, however slow the trainer's steps."""


class RetentionSettings(_Section):
    """How long recorded bodies and token ids are kept, and who an episode belongs to for deletion on
    request (``proxy/retention.py``). Store-wide: once runs exist, a run's own ``bodies_ttl_s``
    overrides this one for its episodes."""

    bodies_ttl_s: float | None = Field(default=None, gt=0)
    """Seconds after an episode finished when its calls' bodies and token ids are purged (request,
    answer, error, client request, prompt and sampled ids, log-probs), once its group is done with:
    trained, skipped, stale or failed (a lone episode: finished). The rows stay, with their token
    counts, status, versions, reward and timings; the episode gets ``purged_at``. None: kept forever."""
    interval_s: float = Field(default=300.0, gt=0)
    """How often (s) the retention sweeper looks for episodes past ``bodies_ttl_s``."""
    batch: int = Field(default=200, ge=1, le=10_000)
    """Episodes purged per transaction (each batch is one audit entry): short write locks on SQLite."""
    user_key: str = Field(default="user", min_length=1, max_length=64)
    """The episode metadata key naming the end user an episode was recorded for:
    ``DELETE /episodes?user=<id>`` deletes every episode whose ``metadata[user_key]`` is that string."""


class UpstreamTimeouts(_Section):
    """Timeouts (s) of the proxy's requests to vLLM."""

    connect_s: float = 5.0
    """Longest wait to open a connection to a replica."""
    read_s: float = 600.0
    """Longest silence between two bytes from vLLM; long generations on CPU are slow."""
    write_s: float = 30.0
    """Longest wait to send a request's bytes (``upstream_transport: httpx`` only; ``lean`` does not use it)."""
    pool_s: float = 30.0
    """Longest wait for a pooled connection (``upstream_transport: httpx`` only; ``lean`` never waits for one)."""


class Settings(_Section):
    """The proxy's settings (``python -m proxy serve --config``): top-level keys, then one section each."""

    host: str = "127.0.0.1"
    """Address ``python -m proxy serve`` listens on; ``0.0.0.0`` accepts other machines."""
    port: int = 8100
    """Port ``python -m proxy serve`` listens on."""
    public_url: str | None = None
    """URL agents reach this proxy at, for the ``base_url`` of new episodes; default: the URL the
    creating request used (its Host header)."""
    upstreams: list[UpstreamSettings] = Field(min_length=1)
    """The vLLM replicas (at least one, unique names). An episode's calls stay on one replica while it is
    healthy (rendezvous hash of the episode id); other calls go to the least busy healthy one."""
    teachers: list[TeacherSettings] = []
    """Teachers behind the proxy (unique names): an episode whose ``metadata.source`` is
    ``teacher:<name>`` is answered by that teacher instead of the policy (``proxy/teachers.py``)."""
    policy: PolicySettings = PolicySettings()
    store: StoreSettings = StoreSettings()
    episodes: EpisodeSettings = EpisodeSettings()
    late_rewards: LateRewardSettings = LateRewardSettings()
    auth: AuthSettings
    timeouts: UpstreamTimeouts = UpstreamTimeouts()
    sampling: SamplingSettings = SamplingSettings()
    splice: SpliceSettings = SpliceSettings()
    admission: AdmissionSettings = AdmissionSettings()
    compat: CompatSettings = CompatSettings()
    retention: RetentionSettings = RetentionSettings()
    upstream_transport: Literal["lean", "httpx"] = "lean"
    """The HTTP transport under the one client to vLLM: ``lean`` (``proxy/transport.py``, the
    default: an O(1) keep-alive pool) or ``httpx`` (httpx's own, httpcore, with the same pool size),
    kept as a fallback and as the baseline ``bench/proxy_overhead.py --transports lean,httpx``
    measures the lean one against."""
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Largest request body accepted (bytes); a larger one is answered 413 without being read whole."""
    health_interval_s: float = Field(default=2.0, gt=0)
    """Seconds between health probes (``GET /health``) of every replica; a replica that comes back gets
    the published adapters loaded before it takes traffic again."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level the proxy logs (to stderr)."""
    log_format: Literal["json", "text"] = "json"
    """``json``: one JSON object per line; ``text``: time (UTC), level, logger and message."""

    @model_validator(mode="after")
    def _unique_replicas(self) -> Settings:
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"upstream names must be unique, got {names}")
        teachers = [t.name for t in self.teachers]
        if len(set(teachers)) != len(teachers):
            raise ValueError(f"teacher names must be unique, got {teachers}")
        return self


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def env_overrides(environ: dict[str, str] | os._Environ[str]) -> dict[str, Any]:
    """Turn ``FLYWHEEL_A__B=v`` into ``{"a": {"b": v}}``; values are parsed as YAML scalars/lists."""
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or not raw:
            continue
        if name in SHORTCUTS:
            path = list(SHORTCUTS[name])
        elif "__" in name or name[len(ENV_PREFIX) :].lower() in Settings.model_fields:
            path = name[len(ENV_PREFIX) :].lower().split("__")
        else:
            continue
        if path[0] not in Settings.model_fields:
            continue
        _set_path(tree, path, yaml.safe_load(raw) if path[-1] not in {"admin_key", "admin_key_file", "url"} else raw)
    return tree


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_settings(
    path: str | Path | None = None, *, environ: dict[str, str] | None = None, **overrides: Any
) -> Settings:
    """Read YAML (if given), then environment overrides, then keyword overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        data = loaded.get("proxy", loaded)
    data = _merge(data, env_overrides(os.environ if environ is None else environ))
    data = _merge(data, overrides)
    return Settings.model_validate(data)
