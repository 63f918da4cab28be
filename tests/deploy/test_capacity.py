"""The capacity model's formulas (bench/capacity.py) on inputs small enough to check by hand."""

from __future__ import annotations

import pytest

from bench.capacity import Costs, Episode, calls_per_s, claim_bytes_per_group, plan, store_bytes_per_episode

COSTS = Costs(
    proxy_cpu_ms_per_call=2.0,
    store_bytes_per_call=100.0,
    store_bytes_per_prompt_token=2.0,
    store_bytes_per_completion_token=5.0,
    store_disk_factor=2.0,
    store_write_ms_per_call=10.0,
    claim_bytes_per_call=10.0,
    claim_bytes_per_prompt_token=1.0,
    claim_bytes_per_completion_token=3.0,
    proxy_utilisation=0.5,
)
EP = Episode(turns=3, first_prompt=100, completion=10, added=40, group_size=2)


def test_episode_shape() -> None:
    """Prompts 100, 150, 200 (each turn adds A + E = 50); C = 200 + 10; sent 450; stored new 100 + 2 x 40."""
    assert [EP.prompt(i) for i in range(3)] == [100, 150, 200]
    assert EP.context == 210
    assert EP.prompt_tokens_sent == 450
    assert EP.new_prompt_tokens == 180


def test_bytes() -> None:
    """Store: 2 x (3 x 100 + 180 x 2 + 30 x 5) = 2 x 810 = 1620 per episode.
    Claim: 2 episodes x (3 x 10 + 450 x 1 + 30 x 3) = 2 x 570 = 1140 per group (whole prompts: quadratic)."""
    assert store_bytes_per_episode(EP, COSTS) == pytest.approx(1620.0)
    assert claim_bytes_per_group(EP, COSTS) == pytest.approx(1140.0)


def test_plan() -> None:
    """30 calls/s of 3-call episodes: 10 episodes/s, 5 groups/s; 30 x 2 ms = 0.06 cores -> 1 process
    (ceiling 1000 / 2 = 500 calls/s); 540 B a call -> 0.0162 MB/s, 1.39968 GB/day; 30 x 10 ms = 0.3
    connections busy; claims 5 x 1140 B = 0.0057 MB/s; trainer 10 x 210 = 2100 tokens/s."""
    p = plan(EP, 30.0, COSTS)
    assert (p.episodes_per_s, p.groups_per_s) == (pytest.approx(10.0), pytest.approx(5.0))
    assert p.proxy_cores == pytest.approx(0.06)
    assert p.proxy_processes == 1
    assert p.proxy_calls_per_s_ceiling == pytest.approx(500.0)
    assert p.store_bytes_per_call == pytest.approx(540.0)
    assert p.store_mb_per_s == pytest.approx(0.0162)
    assert p.store_gb_per_day == pytest.approx(1.39968)
    assert p.store_busy_connections == pytest.approx(0.3)
    assert p.claim_mb_per_s == pytest.approx(0.0057)
    assert p.trainer_tokens_per_s == pytest.approx(2100.0)


def test_processes_round_up_at_the_utilisation_target() -> None:
    """250 calls/s x 2 ms = 0.5 cores = exactly one process at 50%; 251 needs a second."""
    assert plan(EP, 250.0, COSTS).proxy_processes == 1
    assert plan(EP, 251.0, COSTS).proxy_processes == 2


def test_calls_from_gpu_throughput() -> None:
    """8 GPUs x 2500 tokens/s / 150 tokens a call = 133.3 calls/s."""
    assert calls_per_s(gpus=8, tokens_per_s_per_gpu=2500.0, completion=150) == pytest.approx(133.333, rel=1e-4)
