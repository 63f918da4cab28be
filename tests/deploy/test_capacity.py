"""The capacity model's formulas (bench/capacity.py) on inputs small enough to check by hand."""

from __future__ import annotations

import pytest

from bench.capacity import Costs, Episode, calls_per_s, claim_bytes_per_group, plan, store_bytes_per_episode

COSTS = Costs(
    proxy_cpu_ms_per_call=2.0,
    proxy_cpu_us_per_prompt_token=20.0,
    store_bytes_per_call=100.0,
    store_bytes_per_prompt_token=2.0,
    store_bytes_per_completion_token=5.0,
    store_disk_factor=2.0,
    store_write_ms_per_call=10.0,
    claim_bytes_per_call=10.0,
    claim_bytes_per_prompt_token=1.0,
    claim_bytes_per_completion_token=3.0,
    whole_claim_bytes_per_call=10.0,
    whole_claim_bytes_per_prompt_token=1.0,
    whole_claim_bytes_per_completion_token=3.0,
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
    Claim (delta form: new prompt tokens): 2 episodes x (3 x 10 + 180 x 1 + 30 x 3) = 2 x 300 = 600
    per group; of whole calls (every prompt token sent): 2 x (3 x 10 + 450 x 1 + 30 x 3) = 1140."""
    assert store_bytes_per_episode(EP, COSTS) == pytest.approx(1620.0)
    assert claim_bytes_per_group(EP, COSTS) == pytest.approx(600.0)
    assert claim_bytes_per_group(EP, COSTS, whole=True) == pytest.approx(1140.0)


def test_plan() -> None:
    """30 calls/s of 3-call episodes: 10 episodes/s, 5 groups/s; CPU 2 ms + 20 µs x 150 mean prompt
    tokens = 5 ms a call, 30 x 5 ms = 0.15 cores -> 1 process (ceiling 1000 / 5 = 200 calls/s);
    540 B a call -> 0.0162 MB/s, 1.39968 GB/day; 30 x 10 ms = 0.3 connections busy; claims 5 x 600
    B = 0.003 MB/s (whole: 1140 B a group); trainer 10 x 210 = 2100 tokens/s."""
    p = plan(EP, 30.0, COSTS)
    assert (p.episodes_per_s, p.groups_per_s) == (pytest.approx(10.0), pytest.approx(5.0))
    assert EP.mean_prompt == pytest.approx(150.0)
    assert p.proxy_cpu_ms_per_call == pytest.approx(5.0)
    assert p.proxy_cores == pytest.approx(0.15)
    assert p.proxy_processes == 1
    assert p.proxy_calls_per_s_ceiling == pytest.approx(200.0)
    assert p.store_bytes_per_call == pytest.approx(540.0)
    assert p.store_mb_per_s == pytest.approx(0.0162)
    assert p.store_gb_per_day == pytest.approx(1.39968)
    assert p.store_busy_connections == pytest.approx(0.3)
    assert p.claim_mb_per_s == pytest.approx(0.003)
    assert p.whole_claim_bytes_per_group == pytest.approx(1140.0)
    assert p.trainer_tokens_per_s == pytest.approx(2100.0)


def test_processes_round_up_at_the_utilisation_target() -> None:
    """100 calls/s x 5 ms = 0.5 cores = exactly one process at 50%; 101 needs a second."""
    assert plan(EP, 100.0, COSTS).proxy_processes == 1
    assert plan(EP, 101.0, COSTS).proxy_processes == 2


def test_calls_from_gpu_throughput() -> None:
    """8 GPUs x 2500 tokens/s / 150 tokens a call = 133.3 calls/s."""
    assert calls_per_s(gpus=8, tokens_per_s_per_gpu=2500.0, completion=150) == pytest.approx(133.333, rel=1e-4)
