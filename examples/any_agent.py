"""Any OpenAI-SDK agent becomes a Flywheel data source: give it a base URL, then post a reward.

    FLYWHEEL_ADMIN_KEY=... PYTHONPATH=. python examples/any_agent.py --proxy http://127.0.0.1:8100
    ... python examples/any_agent.py --proxy URL --reward judge      # or: --reward mix --judge-weight 0.5

The agent below is ordinary OpenAI-SDK code and knows nothing about Flywheel: it only gets a
``base_url`` and an ``api_key``, the ones the proxy hands out for each episode. The proxy records
every call it makes (exact token ids, logprobs, policy version); afterwards whoever can judge the
result posts the episode's reward with the admin key. A group of episodes on one task is what
GRPO trains on. Needed: openai, and the control API's client ``contract.client`` from this repository
(httpx and pydantic only; ``AsyncProxyClient`` is the same for async code).

No checker at hand? ``--reward judge`` holds the rewards until every episode of the group has run,
then ``workflows.judge`` has an LLM score the group's episodes side by side (read back from the
store) and posts its scores; ``mix`` weighs them with the check below. The judge is the proxy's
``/passthrough/v1`` unless ``FLYWHEEL_JUDGE_BASE_URL``/``_API_KEY``/``_MODEL`` name another.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from openai import OpenAI

from contract.client import AsyncProxyClient, ProxyClient
from workflows.base import Endpoint
from workflows.judge import REWARD_MODES, Judge, JudgeConfig, RewardMode, Settled, reward_group

QUESTION = "What is the capital of France? Answer in one word."


def my_agent(base_url: str, api_key: str) -> str:
    """Stands for any agent: a framework, a CLI tool, a script. It just needs an OpenAI base URL."""
    client = OpenAI(base_url=base_url, api_key=api_key)
    reply = client.chat.completions.create(
        model="policy", max_tokens=16, temperature=1.0, messages=[{"role": "user", "content": QUESTION}]
    )
    return reply.choices[0].message.content or ""


async def judge_group(
    proxy: str, admin_key: str, group_id: str, checks: dict[str, float], mode: RewardMode, weight: float
) -> list[Settled]:
    """Score the group's finished episodes with the judge and post the rewards (or abandon them)."""
    judge = Judge(JudgeConfig.from_env(Endpoint(f"{proxy}/passthrough/v1", admin_key)))
    try:
        async with AsyncProxyClient(proxy, admin_key, timeout_s=300) as client:
            judged = await reward_group(
                client,
                judge,
                group_id=group_id,
                task=QUESTION,
                episode_ids=list(checks),
                mode=mode,
                weight=weight,
                verifier=checks,
            )
            return judged.episodes
    finally:
        await judge.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxy", default="http://127.0.0.1:8100")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--reward", choices=REWARD_MODES, default="verifier", help="the check, an LLM judge, or a mix")
    parser.add_argument("--judge-weight", type=float, default=0.5, help="the judge's share with --reward mix")
    args = parser.parse_args()
    admin_key = os.environ["FLYWHEEL_ADMIN_KEY"]
    with ProxyClient(args.proxy, admin_key, timeout_s=300) as admin:
        group = admin.create_group("capital-of-france", args.group_size)
        checks: dict[str, float] = {}
        for key in group.episode_keys:
            answer = my_agent(key.base_url, key.api_key)  # 1. the agent runs on the episode's base URL
            reward = float("paris" in answer.lower())  # 2. judge the result however you like
            if args.reward == "verifier":
                admin.reward(key.id, reward)  # 3. post it (a ProxyError if the proxy refuses it)
                print(f"episode {key.id}: reward {reward} for {answer!r}")
            else:
                checks[key.id] = reward  # 3'. or wait for the whole group and let the judge score it
        if checks:
            for s in asyncio.run(judge_group(args.proxy, admin_key, group.id, checks, args.reward, args.judge_weight)):
                print(f"episode {s.episode_id}: {s.status} reward {s.reward} ({s.error or 'judged'})")
        print("group", group.id, "is", admin.group(group.id).status)


if __name__ == "__main__":
    main()
