"""Warm start: supervised fine-tuning of the LoRA on recorded episodes, then GRPO from that adapter.

A trainer mode (issue 46), not a script beside it: ``python -m trainer warmstart`` runs only the warm
start, ``python -m trainer run`` with ``warm_start_steps > 0`` runs it first on a fresh ``output_dir``.

Selection. Rewarded episodes already in the store, read over HTTP (``GET /episodes``, the contract's
``episodes``) with the config's filters, which all must hold: ``warm_start_min_reward`` (rejection
sampling: the agent's own best episodes), ``warm_start_tasks`` (exact task ids), ``warm_start_source``
(``metadata.source`` exactly: a teacher's ``teacher:<name>``, a scripted demonstrator's tag); the newest
``warm_start_max_episodes``, then each one's calls (``GET /episodes/{id}``). Nothing is claimed,
leased or acked: GRPO's queue is untouched, and a lone episode (no group) is selectable like any
other. A selection with nothing to train is an error naming the filter (``EmptySelection``, exit
status 2): no step is taken, nothing is published.

Samples. GRPO's own data path: ``turns.py`` in its supervised mode, ``merge.py``'s token-exact samples
and masks (prompts, tool results and template glue never trained; only the assistant's completions),
long samples split as ``long_samples`` says, every rule counted in ``DataStats``. Supervised turns
train what was answered however it was sampled and need no engine log-probs. A teacher's calls (no
policy version, ``notes.teacher``) carry the ids the proxy made by re-rendering the teacher's text with
the student's chat template (``proxy/teachers.py``): trained on those, counted in ``calls_teacher`` and
marked on the sample (``Sample.rerendered``); any other model's calls stay foreign. Calls without exact
ids follow ``retokenize_inexact`` (rebuilt with ``chat_template``, or dropped; counted either way).
Every trained token weighs the same (advantage 1).

Steps. ``warm_start_steps`` supervised steps (``Learner.step(objective="sft")``: ``loss.sft_loss``, the
mean negative log-likelihood over the step's trained tokens) with their own AdamW at
``warm_start_learning_rate``, ``warm_start_episodes_per_step`` episodes each, through the selection in
a shuffled order (``seed``), epoch after epoch. They are steps 1..N of the run: journalled
(``steps.jsonl``, ``"phase": "warm_start"`` and the episodes), reported to the proxy and TensorBoard
with ``sft/`` metrics and ``"phase": "warm_start"``. A stop signal ends the warm start after the step
in flight with nothing saved: the next start runs it again from the beginning.

Hand-over. After the last step the adapter is checkpointed as step N with GRPO's optimizer state
*fresh* (GRPO's own AdamW, never stepped): the supervised moments estimate another loss's gradients
at another learning rate, and GRPO starts from the adapter, not from them, as a GRPO trainer started
from an SFT model does. The adapter is published as version base + N, so the engine serves the warm
policy before GRPO's first claim. ``trainer run`` resumes from that checkpoint like any other; a run
resumed from a checkpoint never repeats the warm start.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from contract.client import Episode, ProxyClient
from trainer.config import ConfigError, LongSamples, TrainerConfig
from trainer.counters import DataStats
from trainer.merge import episode_samples
from trainer.retokenize import Retokenizer
from trainer.sample import Sample
from trainer.turns import member_turns

if TYPE_CHECKING:
    from trainer.loop import Trainer

PAGE = 200
"""Episodes asked for per ``GET /episodes`` page (the proxy allows up to 1000)."""
PHASE = "warm_start"
"""The ``phase`` of a warm-start step's metrics and journal line (GRPO steps carry none)."""


class EmptySelection(ConfigError):
    """The warm start's filter selected nothing to train on; the message names the filter."""


@dataclass(frozen=True)
class Selection:
    """Which recorded episodes the warm start trains on: rewarded ones, and every filter set here."""

    min_reward: float | None = None
    tasks: tuple[str, ...] = ()
    source: str | None = None

    @classmethod
    def of(cls, config: TrainerConfig) -> Selection:
        return cls(config.warm_start_min_reward, tuple(config.warm_start_tasks), config.warm_start_source)

    def describe(self) -> str:
        tasks = ", ".join(self.tasks) if self.tasks else "any"
        reward = "any" if self.min_reward is None else f">= {self.min_reward:g}"
        source = "any" if self.source is None else repr(self.source)
        return f"status rewarded, reward {reward}, tasks {tasks}, source {source}"


def select_episodes(client: ProxyClient, selection: Selection, limit: int) -> list[Episode]:
    """The newest ``limit`` episodes the selection holds, each with its calls; ``EmptySelection`` when none."""
    listed: dict[str, Episode] = {}
    offset = 0
    while len(listed) < limit:
        page = client.episodes(
            status="rewarded",
            task_ids=list(selection.tasks) or None,
            min_reward=selection.min_reward,
            source=selection.source,
            limit=PAGE,
            offset=offset,
        )
        for episode in page:  # an episode created meanwhile shifts the pages: the same one may come twice
            if len(listed) < limit:
                listed.setdefault(episode.id, episode)
        if len(page) < PAGE:
            break
        offset += len(page)
    if not listed:
        raise EmptySelection(
            f"the warm start's filter selected no episode ({selection.describe()}): record or reward episodes "
            "that match, or change warm_start_min_reward, warm_start_tasks or warm_start_source"
        )
    return [client.episode(episode_id) for episode_id in listed]


@dataclass
class Supervised:
    """The selected episodes as supervised samples, with every data rule's counters per episode."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)
    """Episode id -> its samples (only episodes with at least one trained token)."""
    stats: dict[str, DataStats] = field(default_factory=dict)
    """Episode id -> its counters (every selected episode)."""

    def total(self) -> DataStats:
        out = DataStats()
        for stats in self.stats.values():
            out.add(stats)
        return out


def supervised_samples(
    episodes: Sequence[Episode],
    *,
    max_seq_len: int,
    long_samples: LongSamples = "split",
    retokenize: Retokenizer | None = None,
) -> Supervised:
    """Token-exact samples of the episodes' answered calls (``turns.py``'s supervised turns, ``merge.py``),
    each token trained with advantage 1; ``retokenize`` rebuilds calls without exact ids
    (``retokenize_inexact``)."""
    out = Supervised()
    for episode in episodes:
        stats = out.stats.setdefault(episode.id, DataStats())
        turns = member_turns(episode, retokenize=retokenize, stats=stats, supervised=True)
        samples = episode_samples(
            episode,
            group_id=episode.group_id or "",
            max_seq_len=max_seq_len,
            stats=stats,
            turns=turns,
            long_samples=long_samples,
        )
        for sample in samples:
            sample.advantage = 1.0
        if samples:
            out.samples[episode.id] = samples
    return out


def schedule(episode_ids: Sequence[str], steps: int, per_step: int, seed: int) -> list[list[str]]:
    """The episodes of each step: the selection shuffled (``seed``), epoch after epoch, ``per_step`` a
    step (at most the selection's size); no episode twice in one step."""
    rng = random.Random(seed)
    take = min(per_step, len(episode_ids))
    queue: list[str] = []
    plan: list[list[str]] = []
    for _ in range(steps):
        batch: list[str] = []
        while len(batch) < take:
            if not queue:
                queue = list(episode_ids)
                rng.shuffle(queue)
            chosen = queue.pop()
            if chosen in batch:  # an epoch ended mid-step: take another of the new epoch first
                queue.insert(0, chosen)
                continue
            batch.append(chosen)
        plan.append(batch)
    return plan


def warm_start(trainer: Trainer, episodes: Sequence[Episode]) -> int:
    """Train ``warm_start_steps`` supervised steps on ``episodes`` (selected by ``select_episodes``),
    checkpoint and publish the last; returns the last step (0 when stopped before the end)."""
    from trainer.learner import Learner  # torch: only once the model is loaded
    from trainer.metrics import sft_metrics

    cfg = trainer.config
    if trainer.step != 0:
        raise ConfigError(f"a warm start begins a run, but {cfg.out} holds step {trainer.step} already")
    data = supervised_samples(
        episodes, max_seq_len=cfg.max_seq_len, long_samples=cfg.long_samples, retokenize=trainer.retokenize
    )
    if not data.samples:
        counted = {k: v for k, v in data.total().as_dict().items() if v}
        raise EmptySelection(
            f"the warm start's filter selected {len(episodes)} episodes ({Selection.of(cfg).describe()}) but none "
            f"holds a trainable call: {counted}"
        )
    lr = cfg.warm_start_learning_rate or cfg.learning_rate
    learner = Learner(trainer.policy, dataclasses.replace(cfg, learning_rate=lr), trainer.world)
    plan = schedule(list(data.samples), cfg.warm_start_steps, cfg.warm_start_episodes_per_step, cfg.seed)
    trainer.reporter.log(
        f"warm start: {len(data.samples)} of {len(episodes)} selected episodes trainable "
        f"({Selection.of(cfg).describe()}); {cfg.warm_start_steps} supervised steps of {len(plan[0])} episodes"
    )
    for step, chosen in enumerate(plan, start=1):
        if trainer.stop_requested:
            trainer.reporter.log(f"warm start stopped before step {step}: nothing saved, the next start runs it again")
            return 0
        samples = [s for episode_id in chosen for s in data.samples[episode_id]]
        trainer.reporter.status(f"warm start step {step}/{len(plan)}: {len(samples)} samples")
        stats = learner.step(samples, objective="sft")
        counters = DataStats()
        for episode_id in chosen:
            counters.add(data.stats[episode_id])
        metrics = sft_metrics(stats, counters, samples, episodes=len(chosen), learning_rate=lr)
        if not stats.finite:
            trainer.reporter.log(f"[warning] warm start step {step}: non-finite gradient, no update")
        record = {"step": step, "phase": PHASE, "episodes": chosen, "trained": [], "skipped": [], "leases": []}
        if step < len(plan):
            trainer.report(step, metrics, record)
        else:
            trainer.commit_warm_start(step, metrics, record)
    return len(plan)
