"""Packing on hand-made samples (no tokenizer, no model): first-fit-decreasing bins under a token
budget, every sample whole in exactly one micro-batch, and the loss-token layout ``collate`` builds.

The layout of one multi-turn sample on real data is in tests/trainer/test_data.py
(``test_packing_places_loss_tokens_of_each_sample``); these tests pin the rules around it.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainer.data import Sample
from trainer.packing import collate, pack, plan

NAN = float("nan")


def sample(
    name: str,
    length: int,
    *,
    loss: list[int] | None = None,
    advantage: float = 1.0,
    **per_token: list[float] | list[int] | int,
) -> Sample:
    """``length`` tokens with ids 100·k + j; ``loss`` the positions the policy sampled (default: the
    second half); per-token fields (temperatures, top_k, ...) may be given as whole lists."""
    k = int(name[1:]) if name[1:].isdigit() else 0
    sampled = set(range(length // 2, length) if loss is None else loss)
    fields: dict[str, object] = {
        "group_id": "g",
        "episode_id": name,
        "input_ids": [100 * k + j for j in range(length)],
        "loss_mask": [int(j in sampled) for j in range(length)],
        "behaviour_logprobs": [-(j + 1) / 10 if j in sampled else NAN for j in range(length)],
        "temperatures": [1.0] * length,
        "advantage": advantage,
    }
    fields.update(per_token)
    return Sample(**fields)  # type: ignore[arg-type]


def names(bins: list[list[Sample]]) -> list[list[str]]:
    return [[s.episode_id for s in b] for b in bins]


# -- plan: which samples share a micro-batch ----------------------------------------------------------


def test_plan_is_first_fit_decreasing() -> None:
    samples = [sample(f"s{i}", n) for i, n in enumerate([3, 5, 2, 4, 3, 1, 2])]
    # longest first (ties in input order), each into the first bin with room: 5+3 | 4+3+1 | 2+2
    assert names(plan(samples, budget=8)) == [["s1", "s0"], ["s3", "s4", "s5"], ["s2", "s6"]]


def test_a_sample_that_exactly_fills_the_budget_shares_nothing_more() -> None:
    assert names(plan([sample("a", 4), sample("b", 4), sample("c", 1)], budget=8)) == [["a", "b"], ["c"]]


def test_a_sample_longer_than_the_budget_gets_a_bin_alone() -> None:
    bins = plan([sample("small", 2), sample("huge", 20), sample("mid", 6)], budget=8)
    assert names(bins) == [["huge"], ["mid", "small"]]


def test_nothing_to_plan_is_no_bins() -> None:
    assert plan([], budget=8) == [] and pack([], budget=8) == []


@pytest.mark.parametrize("seed", range(5))
def test_every_sample_lands_once_whole_and_within_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    budget = 64
    samples = [sample(f"s{i}", rng.randint(2, 80)) for i in range(40)]
    bins = plan(samples, budget)
    placed = [s for b in bins for s in b]
    assert sorted(map(id, placed)) == sorted(map(id, samples))  # each sample object exactly once
    for b in bins:
        assert sum(map(len, b)) <= budget or len(b) == 1
    oversized = [s for s in samples if len(s) > budget]
    assert len(bins) >= len(oversized) + math.ceil(sum(len(s) for s in samples if len(s) <= budget) / budget)
    for batch in pack(samples, budget):  # the packed rows hold the samples whole and in bin order
        bounds = batch.cu_seqlens.tolist()
        assert bounds[-1] == batch.num_tokens and (batch.num_tokens <= budget or len(batch.samples) == 1)
        for i, s in enumerate(batch.samples):
            assert batch.input_ids[0, bounds[i] : bounds[i + 1]].tolist() == s.input_ids
            assert batch.position_ids[0, bounds[i] : bounds[i + 1]].tolist() == list(range(len(s)))


# -- collate: where the loss tokens go ----------------------------------------------------------------


def test_each_loss_token_is_predicted_by_the_position_before_it() -> None:
    a, b = sample("s1", 6, loss=[2, 3, 5]), sample("s2", 4, loss=[1, 3])
    mb = collate([a, b])
    assert mb.select.tolist() == [1, 2, 4, 6 + 0, 6 + 2]
    assert mb.targets.tolist() == [102, 103, 105, 201, 203]
    assert (mb.rows.tolist(), mb.cols.tolist()) == ([0, 0, 0, 1, 1], [0, 1, 2, 0, 1])
    assert mb.mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert mb.num_loss_tokens == 5 and mb.num_tokens == 10


def test_a_loss_flag_on_the_first_token_is_ignored() -> None:
    """Nothing precedes a sample's first token, so nothing can be trained to predict it."""
    mb = collate([sample("s1", 4, loss=[0, 2])])
    assert mb.select.tolist() == [1] and mb.targets.tolist() == [102] and mb.mask.shape == (1, 1)


def test_a_sample_without_loss_tokens_keeps_an_empty_row() -> None:
    mb = collate([sample("s1", 3, loss=[]), sample("s2", 4, loss=[2, 3])])
    assert mb.mask.tolist() == [[0, 0], [1, 1]]
    assert mb.seq_tokens.tolist() == [0.0, 2.0]
    assert torch.isnan(mb.behaviour_logps[0]).all()  # no token: unknown, never a fake 0


def test_per_token_fields_default_to_untruncated_sampling() -> None:
    mb = collate([sample("s1", 4, loss=[2, 3])])
    assert mb.top_k.tolist() == [0, 0] and mb.top_p.tolist() == [1.0, 1.0] and mb.min_p.tolist() == [0.0, 0.0]
    assert mb.versions.tolist() == [-1, -1] and mb.modes.tolist() == [0, 0]
    assert not mb.truncated
    assert mb.top_k.dtype == mb.versions.dtype == mb.modes.dtype == mb.targets.dtype == torch.long


def test_per_token_fields_are_taken_at_the_loss_positions() -> None:
    s = sample(
        "s1",
        5,
        loss=[3, 4],
        temperatures=[1.0, 1.0, 1.0, 0.7, 0.5],
        top_k=[0, 0, 0, 50, 0],
        top_p=[1.0, 1.0, 1.0, 0.9, 0.8],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.05],
        versions=[-1, -1, -1, 3, 4],
        modes=[-1, -1, -1, 1, 2],
    )
    mb = collate([s])
    assert mb.temperatures.tolist() == pytest.approx([0.7, 0.5])
    assert mb.top_k.tolist() == [50, 0] and mb.top_p.tolist() == pytest.approx([0.9, 0.8])
    assert mb.min_p.tolist() == pytest.approx([0.0, 0.05])
    assert mb.versions.tolist() == [3, 4] and mb.modes.tolist() == [1, 2]
    assert mb.behaviour_logps[0].tolist() == pytest.approx([-0.4, -0.5])
    assert mb.truncated


def test_advantages_per_token_override_the_samples_own() -> None:
    plain = sample("s1", 4, loss=[2, 3], advantage=0.5)
    credited = sample("s2", 4, loss=[1, 3], advantage=0.5, advantages=[0.0, 2.0, 0.0, -1.0])
    mb = collate([plain, credited])
    assert mb.advantages.tolist() == [[0.5, 0.5], [2.0, -1.0]]


def test_the_per_sequence_normaliser_is_the_members_when_given() -> None:
    """A multi-turn episode split into samples divides by all its loss tokens, not each part's."""
    own = sample("s1", 6, loss=[3, 4, 5])
    part = sample("s2", 6, loss=[4, 5], member_loss_tokens=7)
    assert collate([own, part]).seq_tokens.tolist() == [3.0, 7.0]


def test_table_scatters_per_token_values_into_the_loss_table() -> None:
    mb = collate([sample("s1", 5, loss=[2, 3, 4]), sample("s2", 3, loss=[2])])
    table = mb.table(mb.targets.float())
    assert table.tolist() == [[102.0, 103.0, 104.0], [202.0, 0.0, 0.0]]
    assert torch.equal(table * mb.mask, table)  # nothing outside the mask


def _token_by_token(samples: list[Sample]) -> dict[str, list[object]]:
    """What collate must give, read one token at a time (the definition the tensor code replaces)."""
    out: dict[str, list[object]] = {k: [] for k in ("select", "rows", "cols", "targets", "temps", "behaviour")}
    out.update({k: [] for k in ("advantages", "top_k", "top_p", "min_p", "versions", "modes", "allowed")})
    offset = 0
    for b, s in enumerate(samples):
        slot = 0
        for j in range(1, len(s)):
            if not s.loss_mask[j]:
                continue
            out["select"].append(offset + j - 1)
            out["rows"].append(b)
            out["cols"].append(slot)
            out["targets"].append(s.input_ids[j])
            out["temps"].append(s.temperatures[j])
            out["behaviour"].append(s.behaviour_logprobs[j])
            out["advantages"].append(s.advantage if s.advantages is None else s.advantages[j])
            for key, default in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("versions", -1), ("modes", 0)):
                values = getattr(s, key)
                out[key].append(default if values is None else values[j])
            out["allowed"].append(s.allowed[j].tolist() if j in s.allowed else None)
            slot += 1
        offset += len(s)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_collate_agrees_with_reading_token_by_token(seed: int) -> None:
    """Random samples (per-token fields set or not, grammar masks on some loss tokens, a sample with
    no loss token): every per-loss-token field lands where the plain per-token definition puts it."""
    rng = random.Random(seed)
    samples = []
    for k in range(rng.randint(1, 5)):
        n = rng.randint(1, 40)
        loss = [j for j in range(n) if rng.random() < (0.0 if k == 1 else 0.6)]
        extra: dict[str, object] = {}
        if rng.random() < 0.5:
            extra["top_k"] = [rng.choice([0, 5, 50]) for _ in range(n)]
            extra["top_p"] = [rng.choice([1.0, 0.9]) for _ in range(n)]
            extra["versions"] = [rng.randint(-1, 4) for _ in range(n)]
        if rng.random() < 0.5:
            extra["advantages"] = [rng.uniform(-2, 2) for _ in range(n)]
        if rng.random() < 0.5 and loss:
            extra["allowed"] = {j: torch.randint(-(2**31), 2**31 - 1, (3,), dtype=torch.int32) for j in loss[::2]}
        extra["temperatures"] = [rng.choice([1.0, 0.7]) for _ in range(n)]
        samples.append(sample(f"s{k}", n, loss=loss, advantage=rng.uniform(-1, 1), **extra))  # type: ignore[arg-type]
    mb = collate(samples)
    want = _token_by_token(samples)
    assert mb.select.tolist() == want["select"]
    assert mb.rows.tolist() == want["rows"] and mb.cols.tolist() == want["cols"]
    assert mb.targets.tolist() == want["targets"]
    assert mb.temperatures.tolist() == pytest.approx(want["temps"])
    for key in ("top_k", "versions", "modes"):
        assert getattr(mb, key).tolist() == want[key], key
    for key in ("top_p", "min_p"):
        assert getattr(mb, key).tolist() == pytest.approx(want[key]), key
    assert mb.behaviour_logps[mb.rows, mb.cols].tolist() == pytest.approx(want["behaviour"], nan_ok=True)
    assert mb.advantages[mb.rows, mb.cols].tolist() == pytest.approx(want["advantages"])
    assert int(mb.mask.sum()) == len(want["select"])
    if any(a is not None for a in want["allowed"]):
        assert mb.allowed is not None
        assert [row if row != [-1, -1, -1] else None for row in mb.allowed.tolist()] == want["allowed"]
    else:
        assert mb.allowed is None
    ids = [i for s in samples for i in s.input_ids]
    assert mb.input_ids.tolist() == [ids]
    assert mb.position_ids.tolist() == [[j for s in samples for j in range(len(s))]]
