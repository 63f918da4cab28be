"""Which calls of an episode are trained, and how: calls to turns (token ids, effective sampling, masks).

Calls are taken in ordinal order. Failed calls, calls to a model that is not the policy, and calls
without exact token ids are left out (the last retokenized first if configured), counted either
way. Retried calls (identical prompt ids, one after another) keep the one a later call continues,
else the last; the same prompt after other turns is a branch and kept (``_without_retries``). A
spliced call whose prompt the proxy's shadow check found to differ from the ordinary render outside
the sampled ids (``notes.splice.shadow``) is kept and counted by cause (``data/splice_shadow_*``).

Which tokens are trained is decided by the call's *effective* sampling, which the proxy records
(``notes.sampling``, see proxy/sampling.py): ``sampled`` and ``truncated`` calls are reproduced
exactly (temperature, top-k, top-p, min-p go to the log-prob computation); ``constrained`` calls
(grammar mask) are trained under the mask the engine applied, rebuilt from the recorded grammar
(``grammar.py``: ``masks`` per token), unless the proxy marked them ``exclude`` or the mask cannot
be rebuilt (both context only, counted); ``penalized`` and ``greedy`` calls, calls recorded
without their effective sampling, and a fork's replayed calls stay in the sequence as context (``mode`` -1).

A call with n > 1 choices: in a multi-turn episode the choice that the next call continues is the
one taken (the others are counted as unused); a member that is one choice forces it (``choice``).

Supervised turns (``supervised=True``: the warm start, ``trainer/warmstart.py``) imitate the text,
they do not reproduce a distribution: every answered call's completion is trained, whatever it was
sampled with (greedy, penalized, constrained, unrecorded), scored plainly (temperature 1, no filter,
no grammar mask), and needs no engine log-probs. A teacher's call (no policy version, ``notes.teacher``:
``proxy/teachers.py`` recorded the teacher's text re-rendered with the student's chat template, so its
ids are the student's) is trained on those ids, counted (``calls_teacher``) and said so on its sample
(``Sample.rerendered``); any other model's call stays foreign (its ids may be another tokenizer's). The
other rules hold as in GRPO: failed calls out, calls without exact ids follow ``retokenize_inexact``,
retries deduped, a fork's replayed calls context only, all counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import torch

from contract.client import Call, Episode
from contract.tokens import continues, extends
from contract.vocabulary import ShadowMismatch
from trainer.counters import DataStats
from trainer.retokenize import Retokenizer
from trainer.sample import MODES, NAN

Masker = Callable[[dict[str, Any] | None, Sequence[int], Sequence[int]], "torch.Tensor | str"]
"""(recorded grammar, sampled ids, request stop ids) -> the (n, words) int32 bitmask each sampled id
was drawn under, or why it cannot be rebuilt (``trainer.grammar.GrammarMasks``)."""


@dataclass
class Turn:
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    sampling: dict[str, Any]
    mode: int
    """Index into MODES, or -1: context only."""
    version: int | None
    ordinal: int
    choice: int
    masks: torch.Tensor | None = None
    """(len(completion), words) grammar bitmask of a trained constrained turn."""
    rerendered: bool = False
    """A teacher's text re-rendered with the student's chat template (a supervised turn), not sampled ids."""


def _sampling(call: Call, stats: DataStats) -> tuple[dict[str, Any], int]:
    """The call's effective sampling and its trained mode (-1: context only), counted. A fork's
    replayed call (``notes.replay``) is context: its tokens were sampled, and trained, in its source."""
    recorded = (call.notes or {}).get("sampling")
    if (call.notes or {}).get("replay") is not None:
        stats.calls_replayed += 1
        return recorded if isinstance(recorded, dict) else {"temperature": 1.0}, -1
    if not isinstance(recorded, dict):
        temperature = call.request.get("temperature")
        if temperature is not None and float(temperature) <= 0:
            stats.calls_greedy += 1
        else:
            stats.calls_sampling_unrecorded += 1
        return {"temperature": 1.0}, -1
    mode = recorded.get("mode")
    if mode == "greedy":
        stats.calls_greedy += 1
        return recorded, -1
    if mode == "penalized":
        stats.calls_penalized += 1
        return recorded, -1
    if mode == "constrained":
        if recorded.get("constrained") == "exclude":
            stats.calls_constrained_excluded += 1
            return recorded, -1
        stats.calls_constrained += 1
        return recorded, MODES.index("constrained")
    if mode == "truncated":
        stats.calls_truncated_sampling += 1
        return recorded, MODES.index("truncated")
    if mode == "sampled":
        return recorded, MODES.index("sampled")
    stats.calls_sampling_unrecorded += 1
    return recorded, -1


SUPERVISED = {"temperature": 1.0}
"""A supervised turn's sampling: the plain distribution, whose log-likelihood the warm start raises."""


def _supervised(call: Call, stats: DataStats) -> tuple[dict[str, Any], int]:
    """A supervised turn's sampling and mode: trained as sampled, except a fork's replayed call
    (context: trained in its source, as in GRPO)."""
    if (call.notes or {}).get("replay") is not None:
        stats.calls_replayed += 1
        return SUPERVISED, -1
    return SUPERVISED, MODES.index("sampled")


def _shadow(call: Call, stats: DataStats) -> None:
    """Count the splice's shadow mismatch on ``call`` by cause (``notes.splice.shadow``): the data is
    kept, the step's metrics show how often the model acted on a context the template would not give."""
    splice = (call.notes or {}).get("splice")
    shadow = splice.get("shadow") if isinstance(splice, dict) else None
    cause = shadow.get("mismatch") if isinstance(shadow, dict) else None
    if cause in get_args(ShadowMismatch):
        field = f"splice_shadow_{cause}"
        setattr(stats, field, getattr(stats, field) + 1)


def _choice_tokens(call: Call, index: int) -> tuple[list[int], list[float]] | None:
    choice = next((c for c in call.choices if c.get("index", 0) == index), None)
    if choice is None or not call.exact_ids or call.prompt_token_ids is None or choice.get("token_ids") is None:
        return None
    return list(choice["token_ids"]), [float(x) for x in choice.get("logprobs") or []]


def _continued(prompt: list[int], choices: list[tuple[int, list[int]]], later: Sequence[Call]) -> int | None:
    """The choice the first later call that continues one of them continues, if any. A later call
    that only shares the prompt (an unrelated call, a retry of the same prompt) decides nothing."""
    for call in later:
        ids = call.prompt_token_ids
        if ids is None or not extends(ids, prompt):
            continue
        for index, completion in choices:
            if continues(ids, prompt, completion):
                return index
    return None


def _masks(call: Call, turn: Turn, masker: Masker | None, stats: DataStats) -> None:
    """Rebuild the grammar mask of a trained constrained turn; one that cannot be rebuilt becomes context."""
    if turn.mode != MODES.index("constrained"):
        return
    found = (
        masker(turn.sampling.get("grammar"), turn.completion, call.request.get("stop_token_ids") or [])
        if masker is not None
        else "the trainer has no grammar masker (xgrammar or vLLM is not installed)"
    )
    if isinstance(found, str):
        stats.calls_constrained -= 1
        stats.calls_constrained_unmasked += 1
        turn.mode = -1
        return
    turn.masks = found


def _turns(
    calls: Sequence[Call],
    retokenize: Retokenizer | None,
    stats: DataStats,
    force_choice: int | None = None,
    masker: Masker | None = None,
    supervised: bool = False,
) -> list[Turn]:
    """Usable calls of one episode, in order, as token turns (failed, foreign and inexact ones out;
    ``supervised``: the warm start's turns, the module docstring)."""
    ordered = sorted(calls, key=lambda c: c.ordinal)
    turns: list[Turn] = []
    for i, call in enumerate(ordered):
        stats.calls += 1
        _shadow(call, stats)
        if (call.notes or {}).get("purged") is not None:  # retention emptied it: no ids, no text
            stats.calls_purged += 1
            continue
        if call.status_code != 200 or not call.choices:
            stats.calls_failed += 1
            continue
        teacher = supervised and call.policy_version is None and isinstance((call.notes or {}).get("teacher"), dict)
        if call.policy_version is None and not teacher:
            stats.calls_foreign += 1
            continue
        index = _choice(call, ordered[i + 1 :], force_choice, stats)
        ids = _ids(call, index, retokenize, stats)
        if ids is None:
            stats.calls_dropped_inexact += 1
            continue
        stats.calls_teacher += teacher
        prompt, completion, logprobs = ids
        sampling, mode = _supervised(call, stats) if supervised else _sampling(call, stats)
        if mode >= 0 and len(logprobs) != len(completion) and not supervised:
            stats.calls_logprobs_missing += 1
        if len(logprobs) != len(completion):
            logprobs = [NAN] * len(completion)
        turn = Turn(prompt, completion, logprobs, sampling, mode, call.policy_version, call.ordinal, index)
        turn.rerendered = teacher
        _masks(call, turn, masker, stats)
        turns.append(turn)
    kept = _without_retries(turns)
    stats.calls_deduped += len(turns) - len(kept)
    return kept


def _choice(call: Call, later: Sequence[Call], force_choice: int | None, stats: DataStats) -> int:
    """The choice taken: the only one; of n > 1, the forced one, else the one a later call
    continues, else the first listed (the others are counted unused)."""
    index = int(call.choices[0].get("index", 0))
    if len(call.choices) == 1:
        return index
    indexed = [(int(c.get("index", 0)), list(c.get("token_ids") or [])) for c in call.choices]
    picked = force_choice if force_choice is not None else _continued(list(call.prompt_token_ids or []), indexed, later)
    stats.choices_unused += len(call.choices) - 1
    return picked if picked is not None else index


def _ids(
    call: Call, index: int, retokenize: Retokenizer | None, stats: DataStats
) -> tuple[list[int], list[int], list[float]] | None:
    """(prompt, completion, engine log-probs) of the choice taken: the exact ids, else rebuilt if
    configured (no engine log-probs for rebuilt ids), else None."""
    tokens = _choice_tokens(call, index)
    if tokens is not None:
        return list(call.prompt_token_ids or []), tokens[0], tokens[1]
    rebuilt = retokenize(call) if retokenize is not None else None
    if rebuilt is None:
        return None
    stats.calls_retokenized += 1
    return rebuilt[0], rebuilt[1], []


def _without_retries(turns: list[Turn]) -> list[Turn]:
    """One turn per run of retries: calls with the same prompt one after another are one request
    asked again (a client timeout, an SDK retry); the one a later call continues is the answer the
    agent acted on, whatever order the calls committed in; if none is continued, the last. The same
    prompt sent again after other turns is a branch (an agent restarting from an earlier state), not
    a retry: both are kept, and the second starts a sample of its own."""
    kept: list[Turn] = []
    i = 0
    while i < len(turns):
        j = i
        while j + 1 < len(turns) and turns[j + 1].prompt == turns[i].prompt:
            j += 1
        run, later = turns[i : j + 1], turns[j + 1 :]
        acted_on = next(
            (t for t in run if any(continues(n.prompt, t.prompt, t.completion) for n in later)),
            run[-1],
        )
        kept.append(acted_on)
        i = j + 1
    return kept


def member_turns(
    episode: Episode,
    *,
    retokenize: Retokenizer | None = None,
    stats: DataStats | None = None,
    choice: int | None = None,
    masker: Masker | None = None,
    supervised: bool = False,
) -> list[Turn]:
    """The usable turns of an episode (``choice`` forces the choice of n > 1 calls; ``supervised``:
    the warm start's turns, the module docstring)."""
    stats = stats if stats is not None else DataStats()
    turns = _turns(episode.calls or [], retokenize, stats, choice, masker, supervised)
    if not supervised and episode.calls and all(t.mode < 0 for t in turns):
        stats.episodes_untrainable += 1  # the per-call counters say why (contract/trainability.py names it)
    return turns
