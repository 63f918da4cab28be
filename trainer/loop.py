"""The training loop: claim groups -> samples -> loss -> step -> checkpoint -> ack -> publish -> metrics.

Exactly once. A step's groups are acked only after the checkpoint that contains their update is
on disk, and the checkpoint names the leases and groups it trained. While a step trains, its
leases are renewed every ``lease_s / 3`` on a thread of their own (``LeaseKeeper``), and once more
just before the checkpoint: a step whose lease was lost (another trainer claimed a group after it
lapsed) is rolled back to the last checkpoint, never checkpointed, acked or published. A restart
loads the newest checkpoint and re-acks its groups (the proxy treats an ack of the same step as a
no-op; a lease that lapsed meanwhile is renewed first, which fails if anyone claimed the group),
so a kill -9 between checkpoint and ack loses nothing and trains nothing twice. Leases claimed
after the checkpoint are journalled (``pending.json``); a restart renews them and trains their
groups under the same lease, or hands them back if they were lost.

A step whose gradient is not finite changed nothing (AdamW was skipped): it is not checkpointed or
published, its groups are acked ``skipped`` with the reason (retrying a poisoned group would fail
the same way), and it is counted (``trainer/nonfinite_steps``).

Under torchrun only rank 0 (the leader) runs this loop; the other ranks run ``follow``: they
receive each step's samples from the leader and take their share of the step (``trainer.distributed``).

Sync mode claims with staleness 0 (only groups from the current policy version); async mode
accepts groups up to ``max_staleness`` versions old, and the truncated importance weights correct
for the lag.
"""

from __future__ import annotations

import copy
import math
import os
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract.client import Demand, Group, ProxyClient, ProxyError
from contract.schemas import EpisodeAudit
from contract.vocabulary import AckStatus
from trainer.audit import group_audits
from trainer.checkpoint import Checkpoints, CheckpointState, LeaseRecord
from trainer.config import TrainerConfig
from trainer.data import Batch, ChatRetokenizer, Rules, Sample, build_batch, staleness
from trainer.distributed import World
from trainer.grammar import masks_for, unmasked
from trainer.learner import Learner, StepStats
from trainer.lora import LoraPolicy
from trainer.publish import Publisher
from trainer.report import Reporter, finite

FAULT_ENV = "FLYWHEEL_TRAINER_FAULT"
"""Test hook: ``<point>:<step>`` (points: after_claim, after_checkpoint) makes the process kill -9
itself there, so crash recovery is tested at exact instants."""
SLOW_STEP_ENV = "FLYWHEEL_TRAINER_SLOW_STEP_S"
"""Test hook: seconds every step waits after its update and before its commit (a step longer than a lease)."""
COUNTERS = ("trainer/steps_rolled_back", "trainer/nonfinite_steps")
"""Steps that changed nothing, counted over the run (carried in every checkpoint, so across restarts too)."""
RESTORE = "restore"
"""The leader's message to followers: load this adapter and optimizer state (a step was rolled back)."""


class LeaseKeeper:
    """Keeps a step's leases alive: renews them every ``lease_s / 3`` on a thread of its own while
    the step collects and trains, and once more, synchronously, before the step is committed.

    A renewal refused with 409 marks the lease lost for good (the proxy gave a group to another
    trainer); one that fails otherwise (the proxy restarting) is retried at the next tick, and at
    the final check it counts as lost: a step whose leases cannot be confirmed is not committed.
    """

    def __init__(
        self, client: ProxyClient, lease_s: float, log: Callable[[str], None], *, trainer_id: str | None = None
    ) -> None:
        self.client = client
        self.trainer_id = trainer_id
        self.lease_s = lease_s
        self.interval_s = lease_s / 3
        self.log = log
        self.leases: list[LeaseRecord] = []
        self.lost: dict[str, str] = {}
        """Lease id -> why it is lost."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, lease: LeaseRecord) -> None:
        with self._lock:
            self.leases.append(lease)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flywheel-lease-keeper", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                leases = [lease for lease in self.leases if lease.lease_id not in self.lost]
            for lease in leases:
                if self._stop.is_set():
                    return
                self._renew(lease, final=False)

    def _renew(self, lease: LeaseRecord, *, final: bool) -> None:
        try:
            lease.expires_at = self.client.renew(
                lease_id=lease.lease_id, group_ids=lease.group_ids, lease_s=self.lease_s, trainer_id=self.trainer_id
            )
        except ProxyError as exc:
            if exc.status in (404, 409) or final:
                with self._lock:
                    self.lost.setdefault(lease.lease_id, f"{exc.code or exc.status}: {exc.message}")
            else:
                self.log(f"[warning] renewing lease {lease.lease_id} failed, retrying: {exc.message}")

    def confirm(self) -> dict[str, str]:
        """Renew every lease now: the check before a step is committed. Returns the lost ones (empty: all held)."""
        with self._lock:
            leases = [lease for lease in self.leases if lease.lease_id not in self.lost]
        for lease in leases:
            self._renew(lease, final=True)
        with self._lock:
            return dict(self.lost)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


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
        self.retokenize = ChatRetokenizer(policy.tokenizer, _template(config)) if config.retokenize_inexact else None
        vocab = int(policy.output_weight.shape[0])
        self.masker = masks_for(config.model_dir, policy.tokenizer, vocab) if config.grammar_mask else unmasked(vocab)
        self.step = 0
        self.version_base = 0
        self.stop_requested = False
        self._resumable: list[LeaseRecord] = []
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._initial: tuple[dict[str, Any], dict[str, Any]] | None = None
        """Adapter and optimizer state at a fresh start: what a rollback before the first checkpoint restores."""

    # -- start and resume --------------------------------------------------------------------------

    def resume(self) -> None:
        """Load the newest checkpoint and finish its step (ack, journal, publish, report) idempotently."""
        latest = self.checkpoints.latest()
        if latest is None:
            self.version_base = self.client.policy().version
            self.reporter.log(f"fresh start: publishing versions after the proxy's current v{self.version_base}")
            self._initial = (
                {k: v.clone() for k, v in self.policy.adapter_state().items()},
                copy.deepcopy(self.learner.optimizer.state_dict()),
            )
        else:
            directory, state = latest
            adapter, optimizer = self.checkpoints.load_tensors(directory)
            self.policy.load_adapter_state(adapter)
            self.learner.optimizer.load_state_dict(optimizer)
            self.step, self.version_base = state.step, state.version_base
            self.counters.update({k: int(state.metrics.get(k) or 0) for k in COUNTERS})
            self.reporter.log(f"resumed from {directory.name}: step {self.step}")
            self._finish(state)
        if self.world.distributed:  # followers start from the leader's adapter and optimizer state
            self.world.broadcast((self.policy.adapter_state(), _to_cpu(self.learner.optimizer.state_dict())))
        done = {lease.lease_id for lease in latest[1].leases} if latest else set()
        self._resumable = [
            lease for lease in self.checkpoints.pending() if lease.lease_id not in done and self._still_held(lease)
        ]

    def _still_held(self, lease: LeaseRecord) -> bool:
        """Renew a lease claimed before a restart; a lost one is handed back (what is left of it) and forgotten."""
        try:
            lease.expires_at = self.client.renew(
                lease_id=lease.lease_id, group_ids=lease.group_ids, lease_s=self.config.lease_s
            )
            return True
        except ProxyError as exc:
            if exc.status not in (404, 409):
                raise
            self.reporter.log(
                f"lease {lease.lease_id} from before the restart is lost ({exc.message}); its groups are offered again"
            )
            self._release(lease)
            return False

    def _release(self, lease: LeaseRecord) -> None:
        try:
            self.client.release(lease_id=lease.lease_id)
        except ProxyError as exc:  # the lease expires on its own
            self.reporter.log(f"[warning] releasing lease {lease.lease_id} failed: {exc.message}")

    def _finish(self, state: CheckpointState) -> None:
        for lease in state.leases:
            self._ack(lease, state.step)
        if state.step not in self.reporter.journal_steps():
            self.reporter.journal(
                {
                    "step": state.step,
                    "trained": [g for lease in state.leases for g in lease.trained],
                    "skipped": [g for lease in state.leases for g in lease.skipped],
                    "leases": [lease.lease_id for lease in state.leases],
                }
            )
        metrics = dict(state.metrics)
        if state.step % self.config.publish_every == 0:
            metrics.update(self._publish(state.step))
        try:
            self.client.report_step(state.step, finite(metrics))
        except ProxyError as exc:  # metrics are not worth a crash; they stay in TensorBoard and the checkpoint
            self.reporter.log(f"[warning] reporting step {state.step} failed: {exc}")
        self.reporter.step(state.step, metrics)

    def _ack(self, lease: LeaseRecord, step: int) -> None:
        """Ack a lease's groups for ``step``: the trained ones, then the skipped ones in one ack per
        reason, so each group's note is its own reason (not every reason of its lease). If the proxy
        refuses (409: a group was lost, its update may be trained twice) each group is acked alone, so
        the others still are, and the refusal is logged."""
        reasons: dict[str, list[str]] = {}
        for group_id, reason in lease.skipped.items():
            reasons.setdefault(reason, []).append(group_id)
        acks: list[tuple[AckStatus, list[str], str | None]] = [("trained", lease.trained, None)]
        acks += [("skipped", ids, reason[:4000]) for reason, ids in sorted(reasons.items())]
        for status, ids, note in acks:
            if not ids:
                continue
            try:
                self._ack_groups(lease.lease_id, ids, step, status, note, lease.audits)
            except ProxyError as exc:
                if exc.status == 404:
                    raise ProxyError(
                        404,
                        f"the proxy does not know the groups of step {step} ({exc.message}); "
                        "this output_dir belongs to another store: use a fresh output_dir",
                    ) from exc
                if exc.status != 409:
                    raise  # unacked groups would be offered again: stop, a restart re-acks from the checkpoint
                if len(ids) == 1:
                    self.reporter.log(
                        f"[warning] ack of group {ids[0]} ({status}) for step {step} refused: {exc.message}"
                    )
                    continue
                for group_id in ids:  # acks are all or nothing: the groups still held are acked one by one
                    try:
                        self._ack_groups(lease.lease_id, [group_id], step, status, note, lease.audits)
                    except ProxyError as one:
                        if one.status != 409:
                            raise
                        self.reporter.log(
                            f"[warning] ack of group {group_id} ({status}) for step {step} refused: {one.message}"
                        )

    def _ack_groups(
        self,
        lease_id: str,
        ids: list[str],
        step: int,
        status: AckStatus,
        note: str | None,
        audits: dict[str, dict[str, dict[str, Any]]],
    ) -> None:
        """One ack, with the fidelity audits of its groups' episodes. A lease that lapsed since the
        step was committed (a restart, a slow disk) is renewed and the ack retried: the renewal
        succeeds only if nobody claimed the groups meanwhile."""
        mine = {e: EpisodeAudit.model_validate(a) for g in ids for e, a in audits.get(g, {}).items()} or None
        try:
            self.client.ack(lease_id=lease_id, group_ids=ids, step=step, status=status, note=note, audits=mine)
        except ProxyError as exc:
            if exc.code != "lease_expired":
                raise
            self.client.renew(lease_id=lease_id, group_ids=ids, lease_s=self.config.lease_s)
            self.client.ack(lease_id=lease_id, group_ids=ids, step=step, status=status, note=note, audits=mine)

    def _publish(self, step: int) -> dict[str, Any]:
        version = self.version_base + step
        if self.client.policy().version >= version:  # published before a restart, or by someone else
            ours = str(self.publisher.path(version))
            if not any(v.version == version and v.adapter_path == ours for v in self.client.policy_versions()):
                # Another trainer took this version: its weights are not ours, so they are never
                # remembered as this trainer's (engine-mismatch and stale re-scoring would use them).
                self.reporter.log(f"[warning] v{version} on the proxy is another trainer's adapter; not publishing")
                return {"proxy/publish_conflicts": 1}
            if step == self.step:
                self.learner.remember(version)
            return {"proxy/published_version": version}
        try:
            record, seconds = self.publisher.publish(self.policy, version, {"step": step})
        except ProxyError as exc:
            if 400 <= exc.status < 500:
                raise  # the adapter or the request is wrong: every later publish would fail the same way
            self.reporter.log(f"[warning] publishing v{version} failed, the next publish retries: {exc}")
            return {"proxy/publish_failed": 1}
        if step == self.step:  # the weights in memory are this version's: engine mismatch is measured against it
            self.learner.remember(version)
        return {"proxy/published_version": record.version, "perf/publish_s": seconds}

    # -- claiming --------------------------------------------------------------------------------

    def collect(self, keeper: LeaseKeeper) -> tuple[list[Group], list[LeaseRecord], int, int]:
        """Groups for one step: (groups, leases, current policy version, groups marked stale).
        Each lease is handed to ``keeper`` as soon as it is held."""
        if self._resumable:
            resumed, self._resumable = self._resumable, []
            refetched = self._refetch(resumed)
            if refetched:  # else (all acked before a crash cleared pending.json) claim afresh
                for lease in resumed:
                    keeper.add(lease)
                return refetched, resumed, self.client.policy().version, 0
        groups: list[Group] = []
        leases: list[LeaseRecord] = []
        current, stale, first_at = 0, 0, None
        lease_id = str(uuid.uuid4())  # kept until a claim answers: a retried claim gets what the lost one leased
        while len(groups) < self.config.groups_per_step and not self.stop_requested:
            try:
                claim = self.client.claim(
                    trainer_id=self.config.trainer_id,
                    lease_s=self.config.lease_s,
                    max_groups=self.config.groups_per_step - len(groups),
                    max_staleness=self.config.staleness_bound,
                    lease_id=lease_id,
                    demand=Demand(self.config.groups_per_step, self.config.mode),
                )
            except ProxyError as exc:
                if exc.status not in (0, 502, 503, 504):
                    raise
                self.reporter.log(f"[warning] claim failed, retrying: {exc.message}")  # proxy or store restarting
                self._sleep(max(self.config.poll_interval_s, 5.0))
                continue
            lease_id = str(uuid.uuid4())
            current, stale = claim.current_version, stale + claim.stale
            if claim.stale:
                self.reporter.log(
                    f"{claim.stale} groups dropped as stale: older than {self.config.staleness_bound} "
                    f"versions behind v{current} (max_staleness / mode)"
                )
            if claim.groups:
                groups += claim.groups
                leases.append(LeaseRecord(claim.lease_id, [g.id for g in claim.groups], claim.lease_expires_at))
                keeper.add(leases[-1])
                self.checkpoints.set_pending(leases)
                first_at = first_at or time.monotonic()
                self._fault("after_claim", self.step + 1)
                continue
            if first_at is not None and time.monotonic() - first_at >= self.config.batch_wait_s:
                break
            self.reporter.status(f"step {self.step + 1}: {len(groups)}/{self.config.groups_per_step} groups, waiting")
            self._sleep(self.config.poll_interval_s)
        return groups, leases, current, stale

    def _refetch(self, leases: list[LeaseRecord]) -> list[Group]:
        groups = []
        for lease in leases:
            for group_id in lease.group_ids:
                group = self.client.group(group_id)
                if group.train_status == "pending":
                    group.episodes = [self.client.episode(e.id) for e in group.episodes or []]
                    groups.append(group)
        self.reporter.log(f"resuming {len(groups)} groups claimed before the restart")
        return groups

    # -- one step ----------------------------------------------------------------------------------

    def run_once(self) -> bool:
        """Claim, train, checkpoint, ack, publish, report. False when stopped before anything was claimed."""
        keeper = LeaseKeeper(self.client, self.config.lease_s, self.reporter.log, trainer_id=self.config.trainer_id)
        try:
            return self._run_once(keeper)
        finally:
            keeper.stop()

    def _run_once(self, keeper: LeaseKeeper) -> bool:
        wait_started = time.perf_counter()
        groups, leases, current, stale = self.collect(keeper)
        if not groups or self.stop_requested:  # claimed leases stay in pending.json for the next run
            return False
        wait_s = time.perf_counter() - wait_started
        cfg = self.config
        batch = build_batch(groups, rules=data_rules(cfg), retokenize=self.retokenize, masker=self.masker)
        step = self.step + 1
        for lease in leases:
            lease.trained = [g for g in lease.group_ids if g in batch.trained]
            lease.skipped = {g: batch.skipped[g] for g in lease.group_ids if g in batch.skipped}
        if not batch.samples:  # nothing to learn from: ack the skips, no step is taken
            for lease in leases:
                self._ack(lease, step)
            self.checkpoints.set_pending([])
            self.reporter.log(f"{len(batch.skipped)} groups skipped ({'; '.join(sorted(set(batch.skipped.values())))})")
            return True
        self.reporter.status(f"step {step}: training on {len(batch.samples)} samples")
        self.world.broadcast(batch.samples)  # the followers' cue: they train their share of this step
        stats = self.learner.step(batch.samples)
        if slow := float(os.environ.get(SLOW_STEP_ENV) or 0):
            time.sleep(slow)
        if not math.isfinite(stats.grad_norm):
            self._drop_nonfinite(step, leases, stats.grad_norm)
            return True
        lost = keeper.confirm()
        if lost:
            self._drop_lost(step, leases, lost)
            return True
        audits = group_audits(batch, groups, stats.episode_gaps, step)
        for lease in leases:
            lease.audits = {g: {e: a.model_dump() for e, a in audits[g].items()} for g in lease.trained if g in audits}
        metrics = step_metrics(
            batch, groups, stats, current=current, stale=stale, wait_s=wait_s, pass_threshold=cfg.pass_threshold
        )
        metrics.update(self.counters)
        state = CheckpointState(step=step, version_base=self.version_base, leases=leases, metrics=finite(metrics))
        self.checkpoints.save(
            adapter=self.policy.adapter_state(), optimizer=self.learner.optimizer.state_dict(), state=state
        )
        self.step = step
        self._fault("after_checkpoint", step)
        self.checkpoints.set_pending([])
        self._finish(state)
        return True

    # -- steps that change nothing ----------------------------------------------------------------

    def _roll_back(self) -> None:
        """Put the adapter and optimizer back to the last checkpoint (on every rank): the state before this step."""
        latest = self.checkpoints.latest()
        if latest is not None:
            adapter, optimizer = self.checkpoints.load_tensors(latest[0])
        else:
            assert self._initial is not None, "resume() runs before the first step"
            adapter, optimizer = self._initial[0], copy.deepcopy(self._initial[1])
        self.policy.load_adapter_state(adapter)
        self.learner.optimizer.load_state_dict(optimizer)
        if (version := self.version_base + self.step) in self.learner.snapshots:  # the weights are that served version
            self.learner.weights_version = version
        if self.world.distributed:
            self.world.broadcast((RESTORE, adapter, _to_cpu(optimizer)))

    def _drop_nonfinite(self, step: int, leases: list[LeaseRecord], grad_norm: float) -> None:
        """A non-finite gradient: AdamW skipped the update, so nothing is checkpointed or published.
        The groups are acked ``skipped`` with the reason (released, they would poison the next step too)."""
        self._roll_back()  # with num_iterations > 1 an earlier iteration may have updated
        reason = f"non-finite gradient (grad_norm={grad_norm})"
        for lease in leases:
            lease.skipped.update(dict.fromkeys(lease.trained, reason))
            lease.trained = []
        self.counters["trainer/nonfinite_steps"] += 1
        self.reporter.log(
            f"[warning] step {step} dropped: {reason}; no update, nothing checkpointed or published; "
            f"{sum(len(lease.skipped) for lease in leases)} groups acked skipped "
            f"({self.counters['trainer/nonfinite_steps']} such steps so far)"
        )
        for lease in leases:
            self._ack(lease, step)
        self.checkpoints.set_pending([])

    def _drop_lost(self, step: int, leases: list[LeaseRecord], lost: dict[str, str]) -> None:
        """A lease was lost while the step trained (another trainer holds a group now): roll back,
        checkpoint, ack and publish nothing, hand the still-held leases back."""
        self._roll_back()
        self.counters["trainer/steps_rolled_back"] += 1
        why = "; ".join(f"{lease_id}: {reason}" for lease_id, reason in lost.items())
        self.reporter.log(
            f"[warning] step {step} rolled back: lease lost before commit ({why}); adapter and "
            f"optimizer are back at step {self.step}, nothing checkpointed, acked or published "
            f"({self.counters['trainer/steps_rolled_back']} rolled back so far)"
        )
        for lease in leases:
            if lease.lease_id not in lost:
                self._release(lease)
        self.checkpoints.set_pending([])

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

    # -- signals and faults ----------------------------------------------------------------------

    def install_signals(self) -> None:
        def request_stop(signum: int, _frame: Any) -> None:
            if self.stop_requested:  # a second signal: stop now (the last checkpoint is consistent)
                raise SystemExit(128 + signum)
            self.stop_requested = True
            self.reporter.log(f"signal {signum}: stopping after the current step (again to stop at once)")

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stop_requested and time.monotonic() < deadline:
            time.sleep(max(0.0, min(0.2, deadline - time.monotonic())))  # the clock moves between the two reads

    @staticmethod
    def _fault(point: str, step: int) -> None:
        if os.environ.get(FAULT_ENV) == f"{point}:{step}":
            os.kill(os.getpid(), signal.SIGKILL)


def follow(config: TrainerConfig, policy: LoraPolicy, world: World) -> int:
    """A follower rank: load the leader's start state, then train its share of each step the leader sends.

    Signals are the leader's to act on (torchrun sends them to every rank): a first one is ignored
    here, so the step in flight completes on all ranks; a second stops at once.
    """

    def stop_now(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    def second_signal_stops(signum: int, _frame: Any) -> None:
        signal.signal(signum, stop_now)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, second_signal_stops)
    learner = Learner(policy, config, world)
    adapter, optimizer = world.broadcast(None)
    policy.load_adapter_state(adapter)
    learner.optimizer.load_state_dict(optimizer)
    steps = 0
    while (message := world.broadcast(None)) is not None:
        if isinstance(message, tuple) and message[0] == RESTORE:  # the leader rolled the step back
            policy.load_adapter_state(message[1])
            learner.optimizer.load_state_dict(message[2])
            continue
        assert isinstance(message, list) and all(isinstance(s, Sample) for s in message)
        learner.step(message)
        steps += 1
    return steps


def _to_cpu(value: Any) -> Any:
    """A state dict with every tensor on the CPU (so another rank does not unpickle it onto this GPU)."""
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value.cpu() if hasattr(value, "cpu") else value


def data_rules(config: TrainerConfig) -> Rules:
    """The config's data and credit fields, as ``build_batch`` takes them."""
    return Rules(
        max_seq_len=config.max_seq_len,
        min_rewarded=config.min_rewarded,
        scale_rewards=config.scale_rewards,
        turn_credit=config.turn_credit,
        turn_discount=config.turn_discount,
        abandoned=None if config.abandoned == "workflow" else config.abandoned,
        abandoned_reward=config.abandoned_reward,
        normalize_per_episode=config.normalize_per_episode,
    )


def _template(config: TrainerConfig) -> str | None:
    return Path(config.chat_template).read_text() if config.chat_template else None


def _stats(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    return statistics.fmean(values), statistics.pstdev(values)


def step_metrics(
    batch: Batch,
    groups: list[Group],
    stats: StepStats,
    *,
    current: int,
    stale: int,
    wait_s: float,
    pass_threshold: float,
) -> dict[str, Any]:
    """The step's metrics, keyed like cleanrl's charts (reward/, loss/, policy/, data/, perf/, proxy/)."""
    rewards = [
        float(e.reward) for g in groups for e in g.episodes or [] if e.status == "rewarded" and e.reward is not None
    ]
    reward_mean, reward_std = _stats(rewards)
    adv_mean, adv_std = _stats(batch.advantages)
    lags = staleness(batch.samples, current)
    trained = {s.episode_id for s in batch.samples}  # the report's calls per trained episode: these only
    trained_calls = sum(len(e.calls or []) for g in groups for e in g.episodes or [] if e.id in trained)
    metrics: dict[str, Any] = {
        "reward/mean": reward_mean,
        "reward/std": reward_std,
        "reward/episodes": len(rewards),
        "reward/pass_rate": sum(r >= pass_threshold for r in rewards) / len(rewards) if rewards else 0.0,
        "advantage/mean": adv_mean,
        "advantage/std": adv_std,
        "advantage/abs_mean": statistics.fmean(abs(a) for a in batch.advantages) if batch.advantages else 0.0,
        "loss/total": stats.loss,
        "loss/policy": stats.policy_loss,
        "loss/kl": stats.kl,
        "policy/entropy": stats.entropy,
        "policy/clip_fraction": stats.clip_low + stats.clip_high,
        "policy/clip_low": stats.clip_low,
        "policy/clip_high": stats.clip_high,
        "policy/ratio_mean": stats.ratio,
        "policy/is_weight_mean": stats.is_weight,
        "policy/is_capped_fraction": stats.is_capped,
        "policy/grad_norm": stats.grad_norm,
        "data/tokens_outside_truncation": stats.outside,
        "data/tokens": stats.tokens,
        "data/loss_tokens": stats.loss_tokens,
        "data/samples": len(batch.samples),
        "data/members": batch.members,
        "data/episodes_trained": len(trained),
        "data/calls_trained": trained_calls,
        "data/micro_batches": stats.micro_batches,
        "data/groups_trained": len(batch.trained),
        "data/groups_skipped_equal": batch.skipped_equal,
        "data/groups_skipped_few": batch.skipped_few,
        "data/groups_skipped_empty": batch.skipped_empty,
        "staleness/mean": statistics.fmean(lags) if lags else 0.0,
        "staleness/max": max(lags, default=0),
        "proxy/policy_version": current,
        "proxy/stale_groups": stale,
        "perf/step_s": stats.seconds,
        "perf/tokens_per_s": stats.tokens_per_s,
        "perf/wait_s": wait_s,
    }
    metrics.update({f"data/{k}": v for k, v in batch.stats.as_dict().items()})
    metrics.update(stats.engine)
    metrics.update(collapse_signals(groups))
    return metrics


def collapse_signals(groups: list[Group]) -> dict[str, float | None]:
    """What a collapsing policy shows first in its own samples (issue 28: whitespace-filled tool calls
    cut at ``max_tokens``), over the answered choices of the step's groups; None: nothing to count.

    ``signals/cut_fraction``: choices that ended at the token limit (``finish_reason: length``);
    ``signals/tool_call_missing``: choices of calls that required a tool call (``tool_choice``
    required or named) and carry none, the agent's call validity as the proxy sees it.
    """
    choices = cut = required = missing = 0
    for group in groups:
        for episode in group.episodes or []:
            for call in episode.calls or []:
                if call.status_code != 200:
                    continue
                forced = call.request.get("tool_choice") == "required" or isinstance(
                    call.request.get("tool_choice"), dict
                )
                for choice in call.choices:
                    choices += 1
                    cut += choice.get("finish_reason") == "length"
                    required += forced
                    missing += forced and not choice.get("tool_calls")
    return {
        "signals/cut_fraction": cut / choices if choices else None,
        "signals/tool_call_missing": missing / required if required else None,
    }
