"""Publish the adapter as policy version N: save it, ask the proxy to load it on vLLM, prune old ones.

The adapter goes to ``output_dir/adapters/v{N}`` (written under a temporary name, then renamed, so
vLLM never reads a half-written file); the proxy loads it on every replica under a new name
(``policy-v{N}``: reloading one name reuses stale prefix-cache blocks) and switches routing. The
call is idempotent here: if the proxy already has version N from this very directory (a retry, or
a restart after a crash between publish and checkpoint), that counts as done. A step's publish
(``publish_step``) first asks whether the proxy already has version N, and whose adapter it is: one
another trainer published is never taken for this trainer's. The last ``keep_adapters``
directories stay on disk: the proxy reloads its kept versions from them when a
vLLM replica restarts.

An ``adapters/vN`` that already exists is reused only if it holds exactly the adapter being
published (the same tensors): that is the restart case, where the checkpoint restores the adapter
that was saved there. Anything else there (left by another run, or another model) is refused, never
published as version N.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from contract.client import PolicyVersion, ProxyClient, ProxyError
from trainer.lora import LoraPolicy


class PublishError(RuntimeError):
    pass


class Publisher:
    def __init__(self, client: ProxyClient, output_dir: Path, keep: int) -> None:
        self.client = client
        self.root = output_dir / "adapters"
        self.keep = keep

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def save(self, policy: LoraPolicy, version: int) -> Path:
        final = self.path(version)
        if final.exists():
            problem = _differs(final, policy.adapter_state())
            if problem is None:
                return final
            raise PublishError(
                f"{final} already exists but does not hold this trainer's adapter for version "
                f"{version} ({problem}): it is left from another run. Use a fresh output_dir, or "
                "move that directory away if nothing serves it any more"
            )
        tmp = self.root / f".tmp-v{version}"
        shutil.rmtree(tmp, ignore_errors=True)
        policy.save_adapter(tmp)
        tmp.rename(final)
        return final

    def publish_step(
        self, policy: LoraPolicy, version: int, step: int, log: Callable[[str], None]
    ) -> tuple[dict[str, Any], bool]:
        """Make ``version`` this trainer's adapter on the proxy unless it already is (published before
        a restart). Returns the step's ``proxy/*`` (and ``perf/publish_s``) metrics and whether the
        proxy serves this trainer's adapter as ``version``. A version someone else took is never
        ours; a failure the proxy may recover from (5xx, unreachable) is left to the next publish."""
        if self.client.policy().version >= version:  # published before a restart, or by someone else
            ours = str(self.path(version))
            if not any(v.version == version and v.adapter_path == ours for v in self.client.policy_versions()):
                # Another trainer took this version: its weights are not ours, so they are never
                # remembered as this trainer's (engine-mismatch and stale re-scoring would use them).
                log(f"[warning] v{version} on the proxy is another trainer's adapter; not publishing")
                return {"proxy/publish_conflicts": 1}, False
            return {"proxy/published_version": version}, True
        try:
            record, seconds = self.publish(policy, version, {"step": step})
        except ProxyError as exc:
            if 400 <= exc.status < 500:
                raise  # the adapter or the request is wrong: every later publish would fail the same way
            log(f"[warning] publishing v{version} failed, the next publish retries: {exc}")
            return {"proxy/publish_failed": 1}, False
        return {"proxy/published_version": record.version, "perf/publish_s": seconds}, True

    def publish(self, policy: LoraPolicy, version: int, metadata: dict[str, Any]) -> tuple[PolicyVersion, float]:
        """Save + load on vLLM + switch. Returns the proxy's record and the seconds it all took."""
        started = time.perf_counter()
        directory = self.save(policy, version)
        try:
            record = self.client.publish(adapter_path=str(directory), version=version, metadata=metadata)
        except ProxyError as exc:
            if exc.status != 409:
                raise
            record = self._already(version, directory, exc)
        self._prune(version)
        return record, time.perf_counter() - started

    def _already(self, version: int, directory: Path, exc: ProxyError) -> PolicyVersion:
        for known in self.client.policy_versions():
            if known.version == version and known.adapter_path == str(directory):
                return known
        raise PublishError(
            f"the proxy refused version {version}: {exc.message}. Another trainer published it, or "
            "this output_dir belongs to a different store; use a fresh output_dir (it starts "
            "numbering after the proxy's current version)"
        ) from exc

    def _prune(self, current: int) -> None:
        versions = sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())
        for old in versions[: -self.keep]:
            if old != current:
                shutil.rmtree(self.path(old), ignore_errors=True)


def _differs(directory: Path, state: dict[str, torch.Tensor]) -> str | None:
    """Why the adapter saved in ``directory`` is not ``state``, or None when it is exactly it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        saved = load_file(str(directory / "adapter_model.safetensors"))
    except (OSError, SafetensorError) as exc:
        return f"unreadable adapter_model.safetensors: {exc}"
    if saved.keys() != state.keys():
        return "different tensor names"
    changed = [k for k, v in state.items() if v.dtype != saved[k].dtype or not torch.equal(v, saved[k])]
    return f"different values in {len(changed)} of {len(state)} tensors" if changed else None
