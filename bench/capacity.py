"""The capacity model: what a workload of agent episodes costs the proxies, the store and the trainer.

Pure arithmetic on per-call costs measured by the other benchmarks, so that ``docs/design/capacity-model.md``'s
table and ``bench/fleet.py``'s prediction come from the same formulas. An episode is T calls; call i
(0-based) sends a prompt of ``P0 + i * (A + E)`` tokens (the first prompt, then each turn the
model's A completion tokens and E tokens the environment adds) and samples A tokens. With the
compact store (issue 17) a call stores only what is new: P0 prompt tokens for the first call, E for
the others, and its A sampled tokens; the trainer's claims ship the calls in the same delta form
(``calls: "delta"``), so they grow linearly too. A claim of whole calls (``calls: "whole"``, every
trainer before) ships every call's whole prompt: its bytes grow with the square of the turns.

    calls/s          = GPUs x generated tokens/s per GPU / A
    episodes/s       = calls/s / T;  groups/s = episodes/s / G
    proxy CPU/call   = c0 + c1 x mean prompt tokens per call  (the proxy parses, digests and relays the
                       whole message list of every call: its cost grows with the context)
    proxy cores      = calls/s x proxy CPU per call;  processes = ceil(cores / utilisation)
    store bytes/call = disk factor x (F + b_prompt x new prompt tokens + b_completion x A)
    store busy conns = calls/s x write time per call   (connections writing at any moment)
    claim bytes/grp  = G x (T x F_claim + c_prompt x new prompt tokens + c_completion x T x A)
                       (whole calls: G x sum over calls of (F_whole + w_prompt x prompt_i + w_completion x A))
    trainer tokens/s = episodes/s x C, C = P0 + (T - 1)(A + E) + A (one merged sequence per episode)

Run ``python -m bench.capacity`` for the worked table of ``docs/design/capacity-model.md``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Costs:
    """Measured per-call costs. Defaults: this repository's benchmarks on a shared 2-core x86 VM
    (2026-11-23); see docs/design/capacity-model.md for each source."""

    proxy_cpu_ms_per_call: float = 5.92
    """c0: proxy CPU per recorded call whatever its size (ms): least squares over three bench.fleet
    runs (PostgreSQL, 2 proxies, 16 agents, mean prompts of 328, 2,353 and 6,053 tokens: 6.75, 7.31
    and 11.85 ms per call, R² 0.94). It includes the groups, rewards and claims the same processes
    serve, and the contention of a 2-core machine running the agents and PostgreSQL too. A plain
    two-message call recorded into SQLite costs 1.15 ms (bench.proxy_overhead, c=64)."""
    proxy_cpu_us_per_prompt_token: float = 0.93
    """c1: proxy CPU per prompt token a call sends (µs), from the same fit."""
    store_bytes_per_call: float = 1193.0
    """F: a stored call's fixed bytes on PostgreSQL (columns after TOAST; fitted on bench.store_growth)."""
    store_bytes_per_prompt_token: float = 4.59
    """b_prompt: per new prompt token (its id, its share of the new messages' text)."""
    store_bytes_per_completion_token: float = 11.5
    """b_completion: per sampled token (id, log-prob, text, and the next request's copy of the message)."""
    store_disk_factor: float = 1.53
    """pg_total_relation_size('calls') over the stored column bytes (indexes, page and TOAST overhead)."""
    store_write_ms_per_call: float = 11.1
    """Wall time of one call's insert and commit on PostgreSQL (bench.store_growth, one call per commit)."""
    claim_bytes_per_call: float = 1600.0
    """F_claim: a call's fixed JSON bytes in a delta claim, solved exactly from the claim bytes per
    group of the same three bench.fleet runs (T = 10; A = 20, 100, 100; E = 40, 310, 910)."""
    claim_bytes_per_prompt_token: float = 11.2
    """c_prompt: per new prompt token shipped (id as JSON, the new messages' text)."""
    claim_bytes_per_completion_token: float = 20.8
    """c_completion: per sampled token shipped (id, log-prob as JSON, text)."""
    whole_claim_bytes_per_call: float = 618.0
    """F_whole, w_prompt, w_completion: the same for a claim of whole calls (every prompt token
    shipped), solved from bench.store_growth's whole-claim payloads (math, 10 and 50 turns)."""
    whole_claim_bytes_per_prompt_token: float = 10.36
    whole_claim_bytes_per_completion_token: float = 30.7
    proxy_utilisation: float = 0.5
    """Target load of one proxy process (one core): headroom for bursts and for the slow long calls."""


@dataclass(frozen=True)
class Episode:
    """The shape of an agent episode (tokens)."""

    turns: int
    """T: calls per episode."""
    first_prompt: int
    """P0: the first call's prompt (system prompt, task)."""
    completion: int
    """A: tokens sampled per call."""
    added: int
    """E: tokens the environment adds per turn (tool output, user reply, template tokens)."""
    group_size: int = 8
    """G: episodes per GRPO group."""

    def prompt(self, i: int) -> int:
        """Prompt tokens of call ``i`` (0-based)."""
        return self.first_prompt + i * (self.completion + self.added)

    @property
    def context(self) -> int:
        """C: the final context, the last prompt plus its completion (the merged sequence trained on)."""
        return self.prompt(self.turns - 1) + self.completion

    @property
    def prompt_tokens_sent(self) -> int:
        """Prompt tokens over all calls: T x P0 + (A + E) x T(T-1)/2."""
        return self.turns * self.first_prompt + (self.completion + self.added) * self.turns * (self.turns - 1) // 2

    @property
    def mean_prompt(self) -> float:
        """Prompt tokens of the average call."""
        return self.prompt_tokens_sent / self.turns

    @property
    def new_prompt_tokens(self) -> int:
        """Prompt tokens stored by the compact layout: P0 + (T - 1) x E."""
        return self.first_prompt + (self.turns - 1) * self.added


def store_bytes_per_episode(ep: Episode, costs: Costs) -> float:
    raw = (
        ep.turns * costs.store_bytes_per_call
        + ep.new_prompt_tokens * costs.store_bytes_per_prompt_token
        + ep.turns * ep.completion * costs.store_bytes_per_completion_token
    )
    return costs.store_disk_factor * raw


def claim_bytes_per_group(ep: Episode, costs: Costs, *, whole: bool = False) -> float:
    """What one group's claim downloads: delta form (the trainer's), or whole calls."""
    if whole:
        per_episode = (
            ep.turns * costs.whole_claim_bytes_per_call
            + ep.prompt_tokens_sent * costs.whole_claim_bytes_per_prompt_token
            + ep.turns * ep.completion * costs.whole_claim_bytes_per_completion_token
        )
    else:
        per_episode = (
            ep.turns * costs.claim_bytes_per_call
            + ep.new_prompt_tokens * costs.claim_bytes_per_prompt_token
            + ep.turns * ep.completion * costs.claim_bytes_per_completion_token
        )
    return ep.group_size * per_episode


def proxy_cpu_ms_per_call(ep: Episode, costs: Costs) -> float:
    return costs.proxy_cpu_ms_per_call + costs.proxy_cpu_us_per_prompt_token * ep.mean_prompt / 1000


def calls_per_s(*, gpus: int, tokens_per_s_per_gpu: float, completion: int) -> float:
    """Calls the engines finish per second when generation is the bottleneck."""
    return gpus * tokens_per_s_per_gpu / completion


@dataclass(frozen=True)
class Plan:
    calls_per_s: float
    episodes_per_s: float
    groups_per_s: float
    proxy_cores: float
    proxy_processes: int
    store_writes_per_s: float
    """Call rows inserted per second (plus one reward update per episode: ``episodes_per_s``)."""
    store_busy_connections: float
    store_bytes_per_call: float
    store_mb_per_s: float
    store_gb_per_day: float
    claim_bytes_per_group: float
    claim_mb_per_s: float
    whole_claim_bytes_per_group: float
    trainer_tokens_per_s: float
    proxy_calls_per_s_ceiling: float
    """What the planned processes sustain at 100% CPU each (the proxy's own limit)."""
    proxy_cpu_ms_per_call: float


def plan(ep: Episode, rate: float, costs: Costs = Costs()) -> Plan:
    """The resources ``rate`` calls/s of episodes shaped like ``ep`` need."""
    episodes = rate / ep.turns
    groups = episodes / ep.group_size
    cpu_ms = proxy_cpu_ms_per_call(ep, costs)
    cores = rate * cpu_ms / 1000
    processes = max(1, math.ceil(cores / costs.proxy_utilisation - 1e-9))
    per_call = store_bytes_per_episode(ep, costs) / ep.turns
    claim = claim_bytes_per_group(ep, costs)
    return Plan(
        calls_per_s=rate,
        episodes_per_s=episodes,
        groups_per_s=groups,
        proxy_cores=cores,
        proxy_processes=processes,
        store_writes_per_s=rate,
        store_busy_connections=rate * costs.store_write_ms_per_call / 1000,
        store_bytes_per_call=per_call,
        store_mb_per_s=rate * per_call / 1e6,
        store_gb_per_day=rate * per_call * 86_400 / 1e9,
        claim_bytes_per_group=claim,
        claim_mb_per_s=groups * claim / 1e6,
        whole_claim_bytes_per_group=claim_bytes_per_group(ep, costs, whole=True),
        trainer_tokens_per_s=episodes * ep.context,
        proxy_calls_per_s_ceiling=processes * 1000 / cpu_ms,
        proxy_cpu_ms_per_call=cpu_ms,
    )


def table(ep: Episode, rate: float, costs: Costs = Costs()) -> str:
    """The plan as Markdown rows (the table in docs/design/capacity-model.md)."""
    p = plan(ep, rate, costs)
    rows = [
        ("calls/s", f"{p.calls_per_s:,.1f}"),
        ("episodes/s (groups/s)", f"{p.episodes_per_s:,.2f} ({p.groups_per_s:,.3f})"),
        ("proxy CPU per call", f"{p.proxy_cpu_ms_per_call:,.1f} ms"),
        ("proxy CPU (cores)", f"{p.proxy_cores:,.2f}"),
        ("proxy processes", f"{p.proxy_processes} (ceiling {p.proxy_calls_per_s_ceiling:,.0f} calls/s)"),
        ("store writes/s (rows; + reward updates)", f"{p.store_writes_per_s:,.1f} (+ {p.episodes_per_s:,.2f})"),
        ("store connections busy writing", f"{p.store_busy_connections:,.2f}"),
        ("store bytes per call", f"{p.store_bytes_per_call / 1e3:,.1f} KB"),
        ("store growth", f"{p.store_mb_per_s:,.2f} MB/s, {p.store_gb_per_day:,.0f} GB/day"),
        ("claim bytes per group", f"{p.claim_bytes_per_group / 1e6:,.1f} MB"),
        ("claim bandwidth", f"{p.claim_mb_per_s:,.2f} MB/s"),
        (
            "claim of whole calls (older trainers)",
            f"{p.whole_claim_bytes_per_group / 1e6:,.1f} MB per group, "
            f"{p.groups_per_s * p.whole_claim_bytes_per_group / 1e6:,.2f} MB/s",
        ),
        ("trainer throughput needed", f"{p.trainer_tokens_per_s:,.0f} tokens/s"),
    ]
    return "\n".join(["| quantity | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--tokens-per-s", type=float, default=2500.0, help="generated tokens/s per GPU")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--first-prompt", type=int, default=2000)
    parser.add_argument("--completion", type=int, default=150)
    parser.add_argument("--added", type=int, default=450)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--proxy-cpu-ms", type=float, default=Costs.proxy_cpu_ms_per_call, help="c0, per call")
    parser.add_argument(
        "--proxy-cpu-us-per-token", type=float, default=Costs.proxy_cpu_us_per_prompt_token, help="c1, per prompt token"
    )
    args = parser.parse_args()
    costs = Costs(proxy_cpu_ms_per_call=args.proxy_cpu_ms, proxy_cpu_us_per_prompt_token=args.proxy_cpu_us_per_token)
    ep = Episode(args.turns, args.first_prompt, args.completion, args.added, args.group_size)
    rate = calls_per_s(gpus=args.gpus, tokens_per_s_per_gpu=args.tokens_per_s, completion=args.completion)
    print(f"episode: T={ep.turns}, P0={ep.first_prompt}, A={ep.completion}, E={ep.added}, C={ep.context} tokens")
    print(table(ep, rate, costs))


if __name__ == "__main__":
    main()
