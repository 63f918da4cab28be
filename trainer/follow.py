"""A follower rank under torchrun (rank > 0): it trains its share of each step the leader sends.

Only the leader (rank 0) talks to the proxy and writes; a follower loads the leader's start state,
then for each step receives its samples and takes its share of the update (``trainer.distributed``),
or loads the state the leader rolled a step back to (``restore.RESTORE``). Under FSDP its share
is a shard of every weight and its passes run in lockstep with the leader's (``trainer.distributed``).
"""

from __future__ import annotations

import signal
from typing import Any

from trainer.config import TrainerConfig
from trainer.distributed import World
from trainer.learner import Learner
from trainer.lora import LoraPolicy
from trainer.restore import RESTORE
from trainer.sample import Sample


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
    learner.load_optimizer_state(optimizer)
    steps = 0
    while (message := world.broadcast(None)) is not None:
        if isinstance(message, tuple) and message[0] == RESTORE:  # the leader rolled the step back
            policy.load_adapter_state(message[1])
            learner.load_optimizer_state(message[2])
            continue
        assert isinstance(message, list) and all(isinstance(s, Sample) for s in message)
        learner.step(message)
        steps += 1
    return steps
