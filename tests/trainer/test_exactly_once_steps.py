"""Steps that must change nothing, and claims that must not strand groups, on the real proxy and model.

A step whose gradient is not finite, and a step whose lease another trainer took while it trained,
leave the adapter and the optimizer as they were: no checkpoint, no ack ``trained``, no publish,
and a counter in the next reported step. A claim whose answer was lost is retried under the same
lease id, so it gets the groups the lost answer leased instead of stranding them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from contract.client import ProxyClient
from tests.support.services import ADMIN_KEY
from tests.trainer.conftest import ADMIN, TrainerProxy
from trainer.config import TrainerConfig
from trainer.distributed import World
from trainer.loop import Trainer
from trainer.lora import LoraPolicy
from trainer.report import Reporter

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def policy(vllm_model_dir: str) -> Iterator[LoraPolicy]:
    yield LoraPolicy(TrainerConfig(model=vllm_model_dir))


@dataclass(frozen=True)
class Hooked(World):
    """One process, with ``hook`` run on the step's finished gradients, before clipping and AdamW."""

    hook: Callable[[list[torch.nn.Parameter]], None] = lambda _params: None

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.hook(list(params))


def make_trainer(
    proxy: TrainerProxy,
    out: Path,
    model: str,
    policy: LoraPolicy,
    client: ProxyClient,
    hook: Callable[[list[torch.nn.Parameter]], None],
) -> Trainer:
    config = TrainerConfig(
        model=model,
        proxy_url=proxy.url,
        output_dir=str(out),
        groups_per_step=1,
        batch_wait_s=0,
        poll_interval_s=0.2,
        learning_rate=1e-2,
        lease_s=60,
        progress=False,
        tensorboard=False,
    )
    reporter = Reporter(config.out, tensorboard=False, progress=False, max_steps=None, start_step=0)
    trainer = Trainer(config, client, policy, reporter, world=Hooked(hook=hook))
    trainer.resume()
    return trainer


def snapshot(policy: LoraPolicy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in policy.adapter_state().items()}


def assert_unchanged(trainer: Trainer, before: dict[str, torch.Tensor], proxy: TrainerProxy) -> None:
    """Nothing of the step survived: weights, optimizer, checkpoint, published version, reported steps."""
    after = trainer.policy.adapter_state()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.step == 0 and len(trainer.learner.optimizer.state) == 0
    assert trainer.checkpoints.latest() is None
    assert proxy.get("/policy")["version"] == 0
    assert proxy.get("/trainer/steps")["data"] == []


def test_a_non_finite_gradient_changes_nothing_and_its_groups_are_acked_skipped(
    trainer_proxy: TrainerProxy, tmp_path: Path, policy: LoraPolicy, vllm_model_dir: str
) -> None:
    poisoned = trainer_proxy.record_group([1.0, 0.0], question="What is 1+1?")
    hooked = {"steps": 0}

    def nan_in_first_step(params: list[torch.nn.Parameter]) -> None:
        hooked["steps"] += 1
        if hooked["steps"] == 1:
            grad = next(p.grad for p in params if p.grad is not None)
            grad.view(-1)[0] = math.nan

    with ProxyClient(trainer_proxy.url, ADMIN_KEY) as client:
        trainer = make_trainer(trainer_proxy, tmp_path / "run", vllm_model_dir, policy, client, nan_in_first_step)
        before = snapshot(policy)
        assert trainer.run_once()
        assert_unchanged(trainer, before, trainer_proxy)
        group = trainer_proxy.get(f"/groups/{poisoned}")
        assert (group["train_status"], group["train_reason"], group["trained_step"]) == ("skipped", "nonfinite", 1)
        assert "non-finite gradient (grad_norm=nan)" in group["train_note"]

        fresh = trainer_proxy.record_group([1.0, 0.0], question="What is 2+2?")
        assert trainer.run_once() and trainer.step == 1
    assert trainer_proxy.get(f"/groups/{fresh}")["train_status"] == "trained"
    [reported] = trainer_proxy.get("/trainer/steps")["data"]
    assert reported["step"] == 1 and reported["metrics"]["trainer/nonfinite_steps"] == 1
    assert reported["metrics"]["trainer/steps_rolled_back"] == 0
    assert trainer_proxy.get("/policy")["version"] == 1


def test_a_step_whose_lease_was_taken_is_rolled_back_never_checkpointed_or_acked(
    trainer_proxy: TrainerProxy, tmp_path: Path, policy: LoraPolicy, vllm_model_dir: str
) -> None:
    """While the step trains, its lease is released and the group claimed by another trainer (as
    after an expiry): the update is undone, the group stays the other trainer's, and once handed
    back it is trained exactly once."""
    group_id = trainer_proxy.record_group([1.0, 0.0], question="What is 5+1?")
    stolen: dict[str, Any] = {}

    def steal_mid_step(_params: list[torch.nn.Parameter]) -> None:
        if stolen:
            return
        [lease] = trainer.checkpoints.pending()
        released = httpx.post(f"{trainer_proxy.url}/trainer/release", headers=ADMIN, json={"lease_id": lease.lease_id})
        assert released.json() == {"released": 1}
        claim = httpx.post(
            f"{trainer_proxy.url}/trainer/claim",
            headers=ADMIN,
            json={"trainer_id": "other", "max_groups": 1, "lease_s": 600},
        )
        stolen.update(claim.json())

    with ProxyClient(trainer_proxy.url, ADMIN_KEY) as client:
        trainer = make_trainer(trainer_proxy, tmp_path / "run", vllm_model_dir, policy, client, steal_mid_step)
        before = snapshot(policy)
        assert trainer.run_once()
        assert [g["id"] for g in stolen["groups"]] == [group_id]
        assert_unchanged(trainer, before, trainer_proxy)
        assert trainer_proxy.get(f"/groups/{group_id}")["train_status"] == "pending"
        assert not (trainer.config.out / "steps.jsonl").exists()

        released = httpx.post(
            f"{trainer_proxy.url}/trainer/release", headers=ADMIN, json={"lease_id": stolen["lease_id"]}
        )
        assert released.json() == {"released": 1}
        assert trainer.run_once() and trainer.step == 1
    assert trainer_proxy.get(f"/groups/{group_id}")["trained_step"] == 1
    [reported] = trainer_proxy.get("/trainer/steps")["data"]
    assert reported["metrics"]["trainer/steps_rolled_back"] == 1


class LoseFirstClaimAnswer(httpx.BaseTransport):
    """The real proxy handles every request, but the answer to the first claim is lost on the way back."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.claims: list[bytes] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.url.path == "/trainer/claim":
            self.claims.append(request.read())
            if len(self.claims) == 1:
                response.read()
                response.close()
                raise httpx.ReadError("connection reset while reading the answer", request=request)
        return response


def test_a_claim_whose_answer_was_lost_is_retried_under_the_same_lease(trainer_proxy: TrainerProxy) -> None:
    first = trainer_proxy.record_group([1.0, 0.0], question="What is 3+3?")
    second = trainer_proxy.record_group([1.0, 0.0], question="What is 4+4?")
    transport = LoseFirstClaimAnswer()
    with ProxyClient(trainer_proxy.url, ADMIN_KEY, transport=transport) as client:
        claim = client.claim(trainer_id="t", max_groups=1, lease_s=600, max_staleness=None)
    assert len(transport.claims) == 2 and transport.claims[0] == transport.claims[1]  # one lease id, sent twice
    assert [g.id for g in claim.groups] == [first]
    rest = httpx.post(
        f"{trainer_proxy.url}/trainer/claim", headers=ADMIN, json={"trainer_id": "u", "max_groups": 5, "lease_s": 600}
    ).json()
    assert [g["id"] for g in rest["groups"]] == [second]  # the lost answer's lease holds nothing else
