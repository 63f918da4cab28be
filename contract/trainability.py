"""Why a recorded call trains nothing, and whether a whole episode does: one rule for the proxy (the
episode's page and the export) and the trainer (its step metrics), so they name the same reasons.

A call trains its sampled tokens when it was answered (200), not replayed from another episode,
sampled from the policy in a trained mode (``TRAINED_MODES``; a constrained call with its grammar
recorded and not ``exclude``), served by a policy version, with the exact ids the engine saw, and
not purged by retention. An episode none of whose calls trains is *untrainable*: it can carry a
reward, but a group of such episodes teaches nothing, and an agent whose traffic is all like that
(a harness that sends ``temperature: 0``, or penalties, by default) is recorded for nothing. The
reason shown is the one most of its calls share, with what to change (``FIX``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal, Protocol, get_args

from contract.vocabulary import TRAINED_MODES

Untrained = Literal[
    "not_answered", "purged", "replayed", "greedy", "penalized", "constrained_context", "unsampled",
    "no_policy_version", "no_exact_ids",
]  # fmt: skip
"""Why one call trains nothing, in the order the rule checks."""

FIX: Final[dict[Untrained, str]] = {
    "not_answered": "every call failed, was refused or was never read by its client (its errors say why)",
    "purged": "retention purged its bodies and token ids (retention.bodies_ttl_s); nothing is left to train",
    "replayed": "its calls were replayed from the fork's source, which trained them; only calls past the fork "
    "point train",
    "greedy": "the agent asks for temperature 0 (greedy decoding): nothing is sampled from the policy. Let it "
    "sample (a temperature above 0 in its model settings; many harnesses default to 0)",
    "penalized": "the agent sets a repetition, presence or frequency penalty, logit_bias or the like: the "
    "engine's distribution is not the policy's. Drop them from its model settings",
    "constrained_context": "its calls were grammar-constrained with sampling.constrained: exclude, or their "
    "grammar was not recorded: they are kept as context. Use constrained: train",
    "unsampled": "its calls carry no sampling record (recorded before the proxy kept one, or passthrough)",
    "no_policy_version": "no call was served by a policy version (passthrough, side or teacher calls); send "
    "the agent's calls through its episode's base URL",
    "no_exact_ids": "the engine returned no exact token ids; run vLLM with return_token_ids (the proxy asks "
    "for them) or set the trainer's retokenize_inexact",
}
"""Per reason, what it means and what to change, shown with an untrainable episode."""


class CallFacts(Protocol):
    """What the rule reads of a call: the contract's ``Call`` and the proxy's store record both have it."""

    @property
    def status_code(self) -> int: ...
    @property
    def notes(self) -> Mapping[str, Any] | None: ...
    @property
    def policy_version(self) -> int | None: ...
    @property
    def exact_ids(self) -> bool: ...
    @property
    def prompt_token_ids(self) -> list[int] | None: ...


def untrained(call: CallFacts) -> Untrained | None:
    """Why ``call`` trains nothing, or None when its sampled tokens are trained (``trainer/turns.py``)."""
    notes = call.notes or {}
    if call.status_code != 200:
        return "not_answered"
    if notes.get("purged"):
        return "purged"
    if notes.get("replay") is not None:
        return "replayed"
    sampling = notes.get("sampling")
    if not isinstance(sampling, Mapping):
        return "unsampled"
    mode = sampling.get("mode")
    if mode in ("greedy", "penalized"):
        return "greedy" if mode == "greedy" else "penalized"
    if mode == "constrained" and (sampling.get("constrained") == "exclude" or not sampling.get("grammar")):
        return "constrained_context"
    if mode not in TRAINED_MODES:
        return "unsampled"
    if call.policy_version is None:
        return "no_policy_version"
    if not call.exact_ids or call.prompt_token_ids is None:
        return "no_exact_ids"
    return None


def untrainable(calls: Iterable[CallFacts]) -> Untrained | None:
    """Why an episode trains nothing: None when one of its calls trains (or it has none yet), else
    the reason most of its calls share (ties: the earlier in ``Untrained``'s order)."""
    reasons: Counter[Untrained] = Counter()
    for call in calls:
        why = untrained(call)
        if why is None:
            return None
        reasons[why] += 1
    if not reasons:
        return None
    order = get_args(Untrained)
    return max(reasons, key=lambda r: (reasons[r], -order.index(r)))
