"""A client that leaves before its answer: the call is kept as not delivered (499), never trained.

Real proxy process, real vLLM. An SDK whose read timeout fires closes the connection and sends the
request again; vLLM still finishes the first generation and the proxy still has it. Recorded as a
200, it would be a second answer to the same prompt that nobody read, and if the retry committed
first the trainer's retry rule could keep the unread one (issue: fidelity, the retry rule).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from contract.client import Episode
from tests.support.services import ProxyProcess, episode_record, new_episode, serving_proxy
from trainer.data import episode_samples

pytestmark = pytest.mark.vllm

QUESTION = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
LONG = {"model": "policy", "messages": QUESTION, "max_tokens": 1024, "ignore_eos": True, "temperature": 0.8}
"""1,024 tokens take seconds on the plumbing model as SmolLM2's 256 did: long enough that the
client's retry commits while vLLM still generates the answer it left."""


@pytest.fixture
def proxy(vllm_url: str, tmp_path: Path) -> Any:
    with serving_proxy(vllm_url, tmp_path) as process:
        yield process


def _calls_settled(proxy: ProxyProcess, episode_id: str, n: int) -> list[dict[str, Any]]:
    """The episode's calls once ``n`` are recorded (a left call is recorded when vLLM finishes it)."""
    deadline = time.monotonic() + 120
    while True:
        calls = list(episode_record(proxy, episode_id)["calls"])
        if len(calls) >= n or time.monotonic() > deadline:
            return calls
        time.sleep(0.5)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_an_answer_the_client_left_before_is_recorded_as_not_delivered(proxy: ProxyProcess, stream: bool) -> None:
    episode = new_episode(proxy, "disconnect")
    url = f"{episode['base_url']}/chat/completions"
    auth = {"authorization": f"Bearer {episode['api_key']}"}
    # the answer takes seconds; the client gives up early, as an SDK's read timeout
    # does (a stream: after its first event), and retries with a short answer it does read.
    if stream:
        with httpx.stream("POST", url, json={**LONG, "stream": True}, headers=auth, timeout=120) as response:
            assert response.status_code == 200
            next(line for line in response.iter_lines() if line.startswith("data: {"))
        # leaving the block closes the connection with the rest unread
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=LONG, headers=auth, timeout=0.5)
    retried = httpx.post(url, json={**LONG, "max_tokens": 8, "ignore_eos": False}, headers=auth, timeout=120)
    assert retried.status_code == 200, retried.text

    calls = _calls_settled(proxy, episode["id"], 2)
    by_status = {c["status_code"]: c for c in calls}
    assert sorted(by_status) == [200, 499], [(c["status_code"], c.get("error")) for c in calls]
    left = by_status[499]
    assert left["error"]["type"] == "client_disconnected", left["error"]
    expected = "client disconnected mid-stream" if stream else "client disconnected before the answer"
    assert left["error"]["message"] == expected
    if not stream:  # what vLLM generated is kept for the audit: the whole answer, nobody read it
        assert left["response"] is not None and len(left["choices"][0]["token_ids"]) == LONG["max_tokens"]
    # Ordinals follow commit order: the retry usually commits first (vLLM is still generating the
    # left call), but on a loaded machine the left call can commit first; in either order only the
    # answer the client read becomes a sample (below).
    record = {**episode_record(proxy, episode["id"]), "status": "rewarded", "reward": 1.0}
    (sample,) = episode_samples(Episode.model_validate(record), group_id="g", max_seq_len=4096)
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    assert trained == by_status[200]["choices"][0]["token_ids"]
