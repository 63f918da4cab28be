"""The training loop: claim groups -> samples -> loss -> step -> checkpoint -> ack -> publish -> metrics.

Exactly once. A step's groups are acked only after the checkpoint that contains their update is
on disk, and the checkpoint names the leases and groups it trained. While a step trains, its
leases are renewed every ``lease_s / 3`` on a thread of their own (``leases.LeaseKeeper``), and
once more just before the checkpoint: a step whose lease was lost (another trainer claimed a group
after it lapsed) is rolled back to the last checkpoint (``restore.py``), never checkpointed, acked
or published. A restart loads the newest checkpoint and re-acks its groups (the proxy treats an
ack of the same step as a no-op; a lease that lapsed meanwhile is renewed first, which fails if
anyone claimed the group), so a kill -9 between checkpoint and ack loses nothing and trains
nothing twice. Leases claimed after the checkpoint are journalled (``pending.json``); a restart
renews them and trains their groups under the same lease, or hands them back if they were lost.

A step whose gradient is not finite changed nothing (AdamW was skipped): it is not checkpointed or
published, its groups are acked ``skipped`` with the reason (retrying a poisoned group would fail
the same way), and it is counted (``trainer/nonfinite_steps``).

Under torchrun only rank 0 (the leader) runs this loop; the other ranks run ``follow.follow``:
they receive each step's samples from the leader and take their share of the step
(``trainer.distributed``: data parallel, or FSDP2 under ``parallelism: fsdp``).

The jobs live in their own modules: claiming (``claims.py``), lease renewal and acks
(``leases.py``), samples (``data.py``), the update (``learner.py``), checkpoints and rollback
(``checkpoint.py``, ``restore.py``), publishing (``publish.py``), metrics (``metrics.py``),
stop signals and test hooks (``stopping.py``).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from contract.client import ProxyClient, ProxyError
from contract.schemas import EpisodeAudit
from trainer.audit import group_audits
from trainer.checkpoint import Checkpoints, CheckpointState, LeaseRecord
from trainer.claims import Claims
from trainer.config import TrainerConfig
from trainer.data import ChatRetokenizer, Rules, build_batch, late_rule
from trainer.distributed import World
from trainer.grammar import masks_for, unmasked
from trainer.learner import Learner
from trainer.leases import LeaseKeeper, Leases, skip_trained, take_step
from trainer.lora import LoraPolicy
from trainer.metrics import step_metrics
from trainer.publish import Publisher
from trainer.report import Reporter, finite
from trainer.restore import Restore
from trainer.stopping import Stop, fault, slow_step

__all__ = ["COUNTERS", "Trainer", "data_rules", "step_metrics"]

COUNTERS = ("trainer/steps_rolled_back", "trainer/nonfinite_steps")
"""Steps that changed nothing, counted over the run (carried in every checkpoint, so across restarts too)."""


class Trainer:
    def __init__(
        self,
        config: TrainerConfig,
        client: ProxyClient,
        policy: LoraPolicy,
        reporter: Reporter,
        world: World | None = None,
    ) -> None:
        self.config = config
        self.client = client
        self.policy = policy
        self.world = world or World()
        self.learner = Learner(policy, config, self.world)
        self.reporter = reporter
        self.checkpoints = Checkpoints(config.out, config.keep_checkpoints)
        self.publisher = Publisher(client, config.out, config.keep_adapters)
        self.leases = Leases(client, config.lease_s, reporter.log)
        self.stop = Stop()
        self.claims = Claims(client, config, self.checkpoints, reporter, self.stop)
        self.restore = Restore(self.checkpoints, policy, self.learner, self.world)
        self.retokenize = ChatRetokenizer(policy.tokenizer, _template(config)) if config.retokenize_inexact else None
        vocab = int(policy.output_weight.shape[0])
        self.masker = (
            masks_for(
                config.model_dir, policy.tokenizer, vocab, disable_any_whitespace=config.grammar_disable_any_whitespace
            )
            if config.grammar_mask
            else unmasked(vocab)
        )
        self.step = 0
        self.version_base = 0
        self.counters = dict.fromkeys(COUNTERS, 0)

    @property
    def stop_requested(self) -> bool:
        return self.stop.requested

    def install_signals(self) -> None:
        self.stop.install(self.reporter.log)

    # -- start and resume --------------------------------------------------------------------------

    def resume(self) -> None:
        """Load the newest checkpoint and finish its step (ack, journal, publish, report) idempotently."""
        latest = self.restore.load()
        if latest is None:
            self.version_base = self.client.policy().version
            self.reporter.log(f"fresh start: publishing versions after the proxy's current v{self.version_base}")
        else:
            directory, state = latest
            self.step, self.version_base = state.step, state.version_base
            self.counters.update({k: int(state.metrics.get(k) or 0) for k in COUNTERS})
            self.reporter.log(f"resumed from {directory.name}: step {self.step}")
            self._finish(state, publish=state.metrics.get("phase") == "warm_start")  # the warm policy is served
        self.restore.share()
        done = {lease.lease_id for lease in latest[1].leases} if latest else set()
        self.claims.resumable = [
            lease
            for lease in self.checkpoints.pending()
            if lease.lease_id not in done and self.leases.still_held(lease)
        ]

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Steps until ``max_steps`` or a stop signal; returns the last completed step."""
        while not self.stop_requested and (self.config.max_steps is None or self.step < self.config.max_steps):
            if not self.run_once():
                break
        self.world.broadcast(None)  # followers stop (on an error the leader exits and torchrun stops them)
        if self.step > 0 and self.step % self.config.publish_every:  # the last steps were not published yet
            latest = self.checkpoints.latest()
            if latest is not None and latest[1].step == self.step:
                self.reporter.log(f"final step {self.step}: {self._publish(self.step)}")
        return self.step

    def run_once(self) -> bool:
        """Claim, train, checkpoint, ack, publish, report. False when stopped before anything was claimed."""
        keeper = LeaseKeeper(self.client, self.config.lease_s, self.reporter.log, trainer_id=self.config.trainer_id)
        try:
            return self._run_once(keeper)
        finally:
            keeper.stop()

    def _run_once(self, keeper: LeaseKeeper) -> bool:
        wait_started = time.perf_counter()
        groups, leases, current, stale = self.claims.collect(keeper, self.step + 1)
        if not groups or self.stop_requested:  # claimed leases stay in pending.json for the next run
            return False
        wait_s = time.perf_counter() - wait_started
        batch = build_batch(
            groups,
            rules=data_rules(self.config),
            retokenize=self.retokenize,
            masker=self.masker,
            late=late_rule(self.config, current),
        )
        step = self.step + 1
        for lease in leases:
            take_step(lease, batch.trained, batch.skipped, batch.reasons)
        if not batch.samples:  # nothing to learn from: ack the skips, no step is taken
            self._skip(step, leases, batch.skipped)
            return True
        self.reporter.status(f"step {step}: training on {len(batch.samples)} samples")
        self.world.broadcast(batch.samples)  # the followers' cue: they train their share of this step
        stats = self.learner.step(batch.samples)
        slow_step()
        if not math.isfinite(stats.grad_norm):
            self._drop_nonfinite(step, leases, stats.grad_norm)
        elif lost := keeper.confirm():
            self._drop_lost(step, leases, lost)
        else:
            metrics = step_metrics(
                batch,
                groups,
                stats,
                current=current,
                stale=stale,
                wait_s=wait_s,
                pass_threshold=self.config.pass_threshold,
            )
            self._commit(step, leases, metrics, group_audits(batch, groups, stats.episode_gaps, step))
        return True

    # -- a step's end: committed, or dropped -------------------------------------------------------

    def _commit(
        self, step: int, leases: list[LeaseRecord], metrics: dict[str, Any], audits: dict[str, dict[str, EpisodeAudit]]
    ) -> None:
        """Checkpoint the step, then finish it: the groups are acked only once their update is on disk,
        each with its episodes' fidelity audits."""
        for lease in leases:
            lease.audits = {g: {e: a.model_dump() for e, a in audits[g].items()} for g in lease.trained if g in audits}
        metrics.update(self.counters)
        state = CheckpointState(step=step, version_base=self.version_base, leases=leases, metrics=finite(metrics))
        self.checkpoints.save(
            adapter=self.policy.adapter_state(), optimizer=self.learner.optimizer_state(), state=state
        )
        self.step = step
        fault("after_checkpoint", step)
        self.checkpoints.set_pending([])
        self._finish(state)

    def _finish(self, state: CheckpointState, *, publish: bool = False) -> None:
        """Ack, journal, publish (every ``publish_every`` steps, or when ``publish``) and report a
        checkpointed step; each is a no-op when repeated, so a restart finishes its last checkpoint's
        step again."""
        for lease in state.leases:
            self.leases.ack(lease, state.step)
        if state.step not in self.reporter.journal_steps():
            phase = state.metrics.get("phase")
            self.reporter.journal(
                {
                    "step": state.step,
                    **({"phase": phase} if phase else {}),
                    "trained": [g for lease in state.leases for g in lease.trained],
                    "skipped": [g for lease in state.leases for g in lease.skipped],
                    "leases": [lease.lease_id for lease in state.leases],
                }
            )
        metrics = dict(state.metrics)
        if publish or state.step % self.config.publish_every == 0:
            metrics.update(self._publish(state.step))
        try:
            self.client.report_step(state.step, finite(metrics))
        except ProxyError as exc:  # metrics are not worth a crash; they stay in TensorBoard and the checkpoint
            self.reporter.log(f"[warning] reporting step {state.step} failed: {exc}")
        self.reporter.step(state.step, metrics)

    # -- the warm start's steps (``warmstart.py``) -------------------------------------------------

    def report(self, step: int, metrics: dict[str, Any], record: dict[str, Any]) -> None:
        """Journal and report a step that leaves no checkpoint (a warm-start step before its last)."""
        if step not in self.reporter.journal_steps():
            self.reporter.journal(record)
        try:
            self.client.report_step(step, finite(metrics))
        except ProxyError as exc:
            self.reporter.log(f"[warning] reporting step {step} failed: {exc}")
        self.reporter.step(step, metrics)

    def commit_warm_start(self, step: int, metrics: dict[str, Any], record: dict[str, Any]) -> None:
        """Checkpoint the warm start's last step with GRPO's own optimizer state, fresh (``warmstart.py``
        says why), then journal, publish and report it: ``trainer run`` resumes GRPO from here."""
        metrics = {**metrics, **self.counters}
        state = CheckpointState(step=step, version_base=self.version_base, leases=[], metrics=finite(metrics))
        self.checkpoints.save(
            adapter=self.policy.adapter_state(), optimizer=self.learner.optimizer_state(), state=state
        )
        self.step = step
        if step not in self.reporter.journal_steps():
            self.reporter.journal(record)
        self._finish(state, publish=True)

    def _publish(self, step: int) -> dict[str, Any]:
        version = self.version_base + step
        metrics, ours = self.publisher.publish_step(self.policy, version, step, self.reporter.log)
        if (
            ours and step == self.step
        ):  # the weights in memory are this version's: engine mismatch is measured against it
            self.learner.remember(version)
        return metrics

    def _skip(self, step: int, leases: list[LeaseRecord], skipped: dict[str, str]) -> None:
        """No group had anything to learn from: ack them all skipped, take no step."""
        for lease in leases:
            self.leases.ack(lease, step)
        self.checkpoints.set_pending([])
        self.reporter.log(f"{len(skipped)} groups skipped ({'; '.join(sorted(set(skipped.values())))})")

    def _drop_nonfinite(self, step: int, leases: list[LeaseRecord], grad_norm: float) -> None:
        """A non-finite gradient: AdamW skipped the update, so nothing is checkpointed or published.
        The groups are acked ``skipped`` with the reason (released, they would poison the next step too)."""
        self.restore.roll_back(
            self.version_base + self.step
        )  # with num_iterations > 1 an earlier iteration may have updated
        reason = f"non-finite gradient (grad_norm={grad_norm})"
        for lease in leases:
            skip_trained(lease, "nonfinite", reason)
        self.counters["trainer/nonfinite_steps"] += 1
        self.reporter.log(
            f"[warning] step {step} dropped: {reason}; no update, nothing checkpointed or published; "
            f"{sum(len(lease.skipped) for lease in leases)} groups acked skipped "
            f"({self.counters['trainer/nonfinite_steps']} such steps so far)"
        )
        for lease in leases:
            self.leases.ack(lease, step)
        self.checkpoints.set_pending([])

    def _drop_lost(self, step: int, leases: list[LeaseRecord], lost: dict[str, str]) -> None:
        """A lease was lost while the step trained (another trainer holds a group now): roll back,
        checkpoint, ack and publish nothing, hand the still-held leases back."""
        self.restore.roll_back(self.version_base + self.step)
        self.counters["trainer/steps_rolled_back"] += 1
        why = "; ".join(f"{lease_id}: {reason}" for lease_id, reason in lost.items())
        self.reporter.log(
            f"[warning] step {step} rolled back: lease lost before commit ({why}); adapter and "
            f"optimizer are back at step {self.step}, nothing checkpointed, acked or published "
            f"({self.counters['trainer/steps_rolled_back']} rolled back so far)"
        )
        for lease in leases:
            if lease.lease_id not in lost:
                self.leases.release(lease)
        self.checkpoints.set_pending([])


def data_rules(config: TrainerConfig) -> Rules:
    """The config's data and credit fields, as ``build_batch`` takes them."""
    return Rules(
        max_seq_len=config.max_seq_len,
        long_samples=config.long_samples,
        scale_rewards=config.scale_rewards,
        turn_credit=config.turn_credit,
        turn_discount=config.turn_discount,
        shaping=config.shaping,
        abandoned=None if config.abandoned == "workflow" else config.abandoned,
        abandoned_reward=config.abandoned_reward,
        normalize_per_episode=config.normalize_per_episode,
    )


def _template(config: TrainerConfig) -> str | None:
    return Path(config.chat_template).read_text() if config.chat_template else None
