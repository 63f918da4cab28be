"""Any OpenAI-SDK agent becomes a Flywheel data source: give it a base URL, then post a reward.

    FLYWHEEL_ADMIN_KEY=... PYTHONPATH=. python examples/any_agent.py --proxy http://127.0.0.1:8100

The agent below is ordinary OpenAI-SDK code and knows nothing about Flywheel: it only gets a
``base_url`` and an ``api_key``, the ones the proxy hands out for each episode. The proxy records
every call it makes (exact token ids, logprobs, policy version); afterwards whoever can judge the
result posts the episode's reward with the admin key. A group of episodes on one task is what
GRPO trains on. Needed: openai, and the control API's client ``proxy.client`` from this repository
(httpx and pydantic only; ``AsyncProxyClient`` is the same for async code).
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI

from proxy.client import ProxyClient

QUESTION = "What is the capital of France? Answer in one word."


def my_agent(base_url: str, api_key: str) -> str:
    """Stands for any agent: a framework, a CLI tool, a script. It just needs an OpenAI base URL."""
    client = OpenAI(base_url=base_url, api_key=api_key)
    reply = client.chat.completions.create(
        model="policy", max_tokens=16, temperature=1.0, messages=[{"role": "user", "content": QUESTION}]
    )
    return reply.choices[0].message.content or ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxy", default="http://127.0.0.1:8100")
    parser.add_argument("--group-size", type=int, default=2)
    args = parser.parse_args()
    with ProxyClient(args.proxy, os.environ["FLYWHEEL_ADMIN_KEY"], timeout_s=300) as admin:
        group = admin.create_group("capital-of-france", args.group_size)
        for key in group.episode_keys:
            answer = my_agent(key.base_url, key.api_key)  # 1. the agent runs on the episode's base URL
            reward = float("paris" in answer.lower())  # 2. judge the result however you like
            admin.reward(key.id, reward)  # 3. post it (a ProxyError if the proxy refuses it)
            print(f"episode {key.id}: reward {reward} for {answer!r}")
        print("group", group.id, "is", admin.group(group.id).status)


if __name__ == "__main__":
    main()
