"""Loss values against references computed by hand on two tiny sequences.

The fixture: sequence 0 has 3 loss tokens and advantage +2, sequence 1 has 2 (and one padding
slot) and advantage -1; epsilon 0.2, epsilon_high 0.28, so ratios clip to [0.8, 1.28].

    log-ratio   seq0: [0.4, 0.0, -0.1]      seq1: [0.2, -0.5]
    ratio       seq0: [1.4918, 1, 0.9048]   seq1: [1.2214, 0.6065]
    per token   seq0: -min(r*2, clip(r)*2) = [-2.56 (clipped high), -2.0, -1.8096748]
                seq1: -min(-r, -clip(r))   = [1.2214028, 0.8 (clipped low)]
    sums        seq0 -6.3696748, seq1 2.0214028, all -4.3482720
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import Totals, group_advantages, grpo_loss, per_token_kl

NAN = float("nan")
LOGPS = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, 0.0]])
OLD = torch.tensor([[-1.4, -2.0, -0.4], [-0.5, -1.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([2.0, -1.0])
FULL = Totals(sequences=2, tokens=5, micro_batches=1, max_completion_length=4)
# As if this micro-batch were one of two in a step of 4 sequences and 12 loss tokens.
PART = Totals(sequences=4, tokens=12, micro_batches=2, max_completion_length=4)


def loss(**kwargs: object) -> float:
    args = {"totals": FULL, "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28} | kwargs
    return float(grpo_loss(LOGPS, OLD, ADV, MASK, **args).loss)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("loss_type", "totals", "expected"),
    [
        ("grpo", FULL, -0.5562618),  # (-6.3696748/3 + 2.0214028/2) / 2
        ("bnpo", FULL, -0.8696544),  # -4.3482720 / 5
        ("dr_grpo", FULL, -0.5435340),  # -4.3482720 / (2 * 4)
        ("dapo", FULL, -0.8696544),  # -4.3482720 / 5
        ("grpo", PART, -0.2781309),  # (-2.1232249 + 1.0107014) / 4 sequences
        ("bnpo", PART, -0.4348272),  # -4.3482720 / 5 tokens here / 2 micro-batches
        ("dr_grpo", PART, -0.2717670),  # -4.3482720 / (4 * 4)
        ("dapo", PART, -0.3623560),  # -4.3482720 / 12 tokens in the step
    ],
)
def test_token_level_losses(loss_type: str, totals: Totals, expected: float) -> None:
    assert loss(loss_type=loss_type, totals=totals) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        # GSPO: one ratio per sequence, exp(mean log-ratio): seq0 exp(0.1) = 1.1051709, seq1 exp(-0.15) = 0.8607080;
        # neither clips. Per token: seq0 -2 * 1.1051709 (x3), seq1 +0.8607080 (x2).
        ("grpo", -0.6748169),  # (-2.2103418 + 0.8607080) / 2
        ("dapo", -0.9819219),  # (3 * -2.2103418 + 2 * 0.8607080) / 5
    ],
)
def test_sequence_level_losses(loss_type: str, expected: float) -> None:
    assert loss(loss_type=loss_type, level="sequence") == pytest.approx(expected, abs=1e-6)


# Engine log-probs: old - engine = seq0 [0.1, unknown, 0.0], seq1 [0.0, 1.5]; the cap is 3.
BEHAVIOUR = torch.tensor([[-1.5, NAN, -0.4], [-0.5, -2.5, NAN]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # token weights [1.1051709, 1 (unknown), 1], [1, exp(1.5) = 4.48 -> 3]
        ("token_truncate", -0.6035019),  # (-2.56*1.1051709 - 2 - 1.8096748 + 1.2214028 + 0.8*3) / 5
        ("token_mask", -1.0835019),  # the capped token's weight is 0 instead of 3
        # sequence weights exp(0.1) and exp(1.5) -> 3 (truncate) or 0 (mask)
        ("sequence_truncate", -0.1950742),  # (-6.3696748*1.1051709 + 2.0214028*3) / 5
        ("sequence_mask", -1.4079159),  # (-6.3696748*1.1051709 + 0) / 5
    ],
)
def test_truncated_importance_sampling(mode: str, expected: float) -> None:
    out = grpo_loss(
        LOGPS,
        OLD,
        ADV,
        MASK,
        totals=FULL,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        behaviour_logps=BEHAVIOUR,
        is_cap=3.0,
        is_mode=mode,
    )
    assert float(out.loss) == pytest.approx(expected, abs=1e-6)
    assert int(out.is_capped) == (1 if mode.startswith("token") else 2)  # capped tokens among the 5


def test_kl_term_and_clip_counts() -> None:
    ref = torch.tensor([[-1.2, -2.0, -0.7], [-0.3, -1.0, 0.0]])
    kl = per_token_kl(LOGPS, ref)
    # exp(d) - d - 1 with d = ref - logp: exp(-0.2) + 0.2 - 1 = 0.0187308; exp(0.5) - 1.5 = 0.1487213
    assert kl[0].tolist() == pytest.approx([0.0187308, 0.0, 0.0187308], abs=1e-6)
    assert kl[1, :2].tolist() == pytest.approx([0.0, 0.1487213], abs=1e-6)
    out = grpo_loss(
        LOGPS, OLD, ADV, MASK, totals=FULL, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.1, ref_logps=ref
    )
    assert float(out.loss) == pytest.approx(-0.8659308, abs=1e-6)  # (-4.3482720 + 0.1 * 0.1861828) / 5
    assert float(out.policy_loss) == pytest.approx(-0.8696544, abs=1e-6)
    assert (int(out.clipped_high), int(out.clipped_low)) == (1, 1)
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(LOGPS, OLD, ADV, MASK, totals=FULL, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.1)


def test_gradient_is_cut_where_the_clip_binds() -> None:
    logps = LOGPS.clone().requires_grad_(True)
    grpo_loss(logps, OLD, ADV, MASK, totals=FULL, loss_type="dapo", epsilon=0.2, epsilon_high=0.28).loss.backward()
    assert logps.grad is not None
    grad = logps.grad
    # clipped tokens (seq0 t0 high with A>0, seq1 t1 low with A<0) and padding get no gradient
    assert grad[0, 0] == 0 and grad[1, 1] == 0 and grad[1, 2] == 0
    # d/dlogp of -r*A/5 = -r*A/5: seq0 t1 -> -2/5; seq1 t0 -> +1.2214028/5
    assert float(grad[0, 1]) == pytest.approx(-0.4, abs=1e-6)
    assert float(grad[1, 0]) == pytest.approx(0.2442806, abs=1e-6)


def test_advantages_by_scale() -> None:
    groups = [torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([3.0, 1.0])]
    # group: std([1,0,0,1]) = 0.5773503 (unbiased) -> 0.5 / 0.5774503; std([3,1]) = 1.4142136 -> 1 / 1.4143136
    group = group_advantages(groups, "group")
    assert group[0].tolist() == pytest.approx([0.8658754, -0.8658754, -0.8658754, 0.8658754], abs=1e-6)
    assert group[1].tolist() == pytest.approx([0.7070568, -0.7070568], abs=1e-6)
    # batch: one std over all six rewards, sqrt(6 / 5) = 1.0954451; means stay per group (0.5 and 2)
    batch = group_advantages(groups, "batch")
    assert batch[0].tolist() == pytest.approx([0.4563938, -0.4563938, -0.4563938, 0.4563938], abs=1e-6)
    assert batch[1].tolist() == pytest.approx([0.9127876, -0.9127876], abs=1e-6)
    none = group_advantages(groups, "none")
    assert none[0].tolist() == [0.5, -0.5, -0.5, 0.5] and none[1].tolist() == [1.0, -1.0]
    assert not any(math.isnan(x) for g in group for x in g.tolist())
