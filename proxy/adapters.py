"""The adapter table: which LoRA adapter serves "the policy" (and any version asked by name), and publishing a new one.

The current version lives in the store (highest published version), so every proxy replica agrees;
each replica re-reads it every ``refresh_s``. Publishing loads the adapter into every replica under
a new name (``policy-v{N}``; reloading one name reuses stale prefix-cache blocks, vLLM issues
30931 and 42125), then records the version (the atomic switch), then unloads versions older than
the last ``keep_versions``. A replica that restarts gets the kept versions loaded again before it
takes traffic (``sync_replica``).

With ``policy.canary.share`` above 0 and a current version, a publish loads the adapter the same
way but starts it as the *canary* (``proxy/store/canaries.py``): a new episode's arm is drawn in the
store when it is created, and an alias call of a canary-arm episode goes to the canary while the
canary runs; every other call goes to the current, as do all calls once the canary is decided
(promoted: it is the current; rolled back: never served again). Which arm an episode is in is read
once per episode and process while a canary runs (``prime``), never per call.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from contract.vocabulary import BASE_VERSION
from proxy.errors import Conflict, InvalidRequest, UpstreamError, UpstreamUnavailable
from proxy.settings import PolicySettings
from proxy.store.records import CanaryStart, PolicyVersionRecord
from proxy.store.versions import Versions
from proxy.upstream import Replica, Upstreams

log = logging.getLogger("flywheel.adapters")
MAX_ARMS = 100_000
"""Episode arms remembered per process (cleared when full: each is read again once)."""


class AdapterTable:
    """The published policy versions as a routing table: a requested model name to the adapter name
    sent upstream and its version (``resolve``); publishing adds a version and switches the aliases."""

    def __init__(self, settings: PolicySettings, versions: Versions, upstreams: Upstreams) -> None:
        self.settings = settings
        self._versions = versions
        self._upstreams = upstreams
        self._aliases = frozenset(settings.aliases)
        self._version_name = re.compile(re.escape(settings.adapter_prefix) + r"(\d+)$")
        self.current: PolicyVersionRecord | None = None
        self.canary: PolicyVersionRecord | None = None
        """The running canary's version, or None."""
        self._arms: dict[str, int | None] = {}
        """Episode id -> the canary version it is in the canary arm of (None: baseline, or no canary)."""
        self._publish_lock = asyncio.Lock()

    def resolve(self, model: str, episode_id: str | None = None) -> tuple[str, int | None]:
        """Map a requested model to (name to send upstream, policy version or None); an alias asked
        for by a canary-arm episode (``prime`` it first) goes to the running canary."""
        if model in self._aliases:
            canary = self.canary
            if canary is not None and episode_id is not None and self._arms.get(episode_id) == canary.version:
                return canary.name, canary.version
            current = self.current
            return (current.name, current.version) if current else (self.settings.base_model, BASE_VERSION)
        if model == self.settings.base_model:
            return model, BASE_VERSION
        match = self._version_name.match(model)
        return model, int(match.group(1)) if match else None

    async def prime(self, episode_id: str) -> None:
        """Learn the episode's arm before ``resolve``: one store read per episode while a canary
        runs (an arm never changes), none otherwise."""
        if self.canary is None or episode_id in self._arms:
            return
        arm = await self._versions.canaries.arm_of(episode_id)
        self._learn(episode_id, arm[1] if arm is not None and arm[0] == "canary" else None)

    def assigned(self, episodes: list[tuple[str, str | None, int | None]]) -> None:
        """(id, policy_arm, canary_version) of episodes this process just created: no read needed later."""
        if self.canary is not None:
            for episode_id, arm, version in episodes:
                self._learn(episode_id, version if arm == "canary" else None)

    def _learn(self, episode_id: str, canary_version: int | None) -> None:
        if len(self._arms) >= MAX_ARMS:
            self._arms.clear()
        self._arms[episode_id] = canary_version

    @property
    def version(self) -> int:
        """The current policy version (``BASE_VERSION`` until an adapter is published)."""
        return self.current.version if self.current else BASE_VERSION

    def is_alias(self, model: str) -> bool:
        return model in self._aliases

    async def refresh(self) -> None:
        latest = await self._versions.current()
        if latest is not None and (self.current is None or latest.version > self.current.version):
            self.current = latest
        self.canary = await self._versions.canary()

    async def refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # the store being briefly unreachable must not stop routing
                log.warning("policy refresh failed", extra={"error": repr(exc)})
            await asyncio.sleep(self.settings.refresh_s)

    async def _kept(self) -> list[PolicyVersionRecord]:
        """The newest ``keep_versions``, and always the current and the running canary (both serve)."""
        newest = await self._versions.list(self.settings.keep_versions)
        serving = (await self._versions.current(), await self._versions.canary())
        kept = {v.version: v for v in [*newest, *(r for r in serving if r is not None)]}
        return sorted(kept.values(), key=lambda v: v.version)

    async def publish(self, *, adapter_path: str, version: int | None, metadata: dict[str, Any]) -> PolicyVersionRecord:
        """Load on every healthy replica, switch routing, unload what falls out of the window."""
        async with self._publish_lock:
            # The store's version, not only this replica's last refresh: another proxy may have published
            # since, and loading a version it already holds would replace the adapter serving under that name.
            await self.refresh()
            if self.canary is not None:  # checked again in the store's transaction; here before loading anything
                raise Conflict(
                    f"canary v{self.canary.version} is still running: promote or roll it back before publishing",
                    param="version",
                    code="canary_pending",
                )
            version = version if version is not None else await self._versions.next_number()
            current = self.version
            if version <= current:
                raise Conflict(
                    f"version {version} is not newer than the current version {current}",
                    param="version",
                    code="version_conflict",
                )
            name = f"{self.settings.adapter_prefix}{version}"
            targets = [r for r in self._upstreams.replicas if r.healthy] or list(self._upstreams.replicas)
            results = await asyncio.gather(
                *(self._load(r, name, adapter_path) for r in targets), return_exceptions=True
            )
            loaded = [r for r, res in zip(targets, results, strict=True) if res is None]
            errors = [res for res in results if isinstance(res, BaseException)]
            if not loaded:
                raise errors[0] if errors else UpstreamUnavailable("no replica to load the adapter on")
            for replica, res in zip(targets, results, strict=True):
                if res is not None:  # it missed the adapter: out of rotation until the health loop syncs it
                    log.warning("adapter load failed", extra={"replica": replica.name, "error": repr(res)})
                    replica.healthy = False
            rollout = self.settings.canary
            canary = (
                CanaryStart(baseline_version=current, share=rollout.share, settings=rollout.test().model_dump())
                if rollout.share > 0 and self.current is not None
                else None
            )
            record = await self._versions.add(
                version=version, name=name, adapter_path=adapter_path, metadata=metadata, canary=canary
            )
            if canary is None:
                self.current = record
            else:
                self.canary = record
            kept = {v.name for v in await self._kept()}
            await asyncio.gather(*(self._unload_except(r, kept) for r in loaded), return_exceptions=True)
            log.info(
                "policy published",
                extra={"version": version, "adapter": name, "replicas": len(loaded), "canary": canary is not None},
            )
            return record

    async def _load(self, replica: Replica, name: str, path: str) -> None:
        response = await self._upstreams.post_json(
            replica, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}
        )
        if response.status_code != 200 and "already been loaded" in response.text:
            # Loaded earlier (a retried publish, or a restarted proxy): fine if it is the same adapter;
            # a different adapter under this name must be replaced, never silently served.
            roots = {m["id"]: m.get("root") for m in await self._upstreams.list_models(replica)}
            if roots.get(name) == path:
                replica.adapters.add(name)
                return
            await self._upstreams.post_json(replica, "/v1/unload_lora_adapter", {"lora_name": name})
            response = await self._upstreams.post_json(
                replica, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}
            )
        if response.status_code == 200:
            replica.adapters.add(name)
            return
        message = _error_message(response.text)
        if response.status_code in (400, 404, 422):
            hint = (
                " (is VLLM_ALLOW_RUNTIME_LORA_UPDATING=True set for vLLM?)"
                if response.status_code == 404 and "cannot be found" not in message
                else ""
            )
            raise InvalidRequest(
                f"vLLM {replica.name} refused adapter {path!r}: {message}{hint}",
                param="adapter_path",
                code="adapter_rejected",
            )
        raise UpstreamError(f"vLLM {replica.name} failed to load adapter: {response.status_code} {message}")

    async def _unload_except(self, replica: Replica, kept: set[str]) -> None:
        """Unload every published version on ``replica`` outside ``kept``. The replica's own model
        list is the truth: another proxy replica may have published (and loaded) versions here."""
        served = {m["id"] for m in await self._upstreams.list_models(replica)}
        replica.adapters = {name for name in served if self._version_name.match(name)}
        for name in sorted(replica.adapters - kept):
            response = await self._upstreams.post_json(replica, "/v1/unload_lora_adapter", {"lora_name": name})
            if response.status_code in (200, 404):
                replica.adapters.discard(name)

    async def sync_replica(self, replica: Replica) -> None:
        """Make a (re)started replica hold the kept versions before it takes traffic again."""
        served = {m["id"] for m in await self._upstreams.list_models(replica)}
        kept = await self._kept()
        for record in kept:
            if record.name not in served:
                await self._load(replica, record.name, record.adapter_path)
                log.info("adapter restored on replica", extra={"replica": replica.name, "adapter": record.name})
        await self._unload_except(replica, {r.name for r in kept})


def _error_message(text: str) -> str:
    import orjson

    try:
        body = orjson.loads(text)
        return str(body.get("error", {}).get("message") or body.get("message") or text)[:500]
    except (orjson.JSONDecodeError, AttributeError):
        return text[:500]
