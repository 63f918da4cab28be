"""The dashboard (``proxy/ui``) in-process on a real SQLite store seeded through the repository.

No vLLM and no browser: the fake upstream only answers the proxy's health checks.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from markupsafe import escape

from proxy.store.db import migrate_async
from proxy.store.records import NewCall
from proxy.store.repository import Repository
from proxy.ui.routes import TokenRate
from proxy.ui.session import COOKIE, SessionTokens
from tests.proxy.conftest import ADMIN, fake_upstream, make_settings, running_app
from tests.proxy.test_canary_routing import TEST, by_arm, publish, reward
from tests.support.records import chat_call
from tests.support.services import ADMIN_KEY

TOOL_ARGS = '{"expression": "17 * 23"}'


def _call(
    episode_id: str,
    messages: list[dict[str, Any]],
    *,
    text: str,
    tool_calls: list[dict[str, Any]] | None,
    token_ids: list[int],
    logprobs: list[float],
    version: int,
    mode: str = "sampled",
) -> NewCall:
    tokens = [{"token": f"<{t}>", "logprob": lp} for t, lp in zip(token_ids, logprobs, strict=True)]
    message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    return chat_call(
        episode_id,
        request={"model": "policy", "messages": messages},
        response={
            "id": "chatcmpl-1",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": tokens},
                    "finish_reason": "tool_calls" if tool_calls else "stop",
                }
            ],
        },
        prompt_token_ids=list(range(1, 12)),
        choices=[
            {
                "index": 0,
                "token_ids": token_ids,
                "logprobs": logprobs,
                "finish_reason": "stop",
                "text": text,
                "tool_calls": tool_calls,
            }
        ],
        model_served=f"policy-v{version}",
        policy_version=version,
        latency_ms=123.0,
        prompt_tokens=11,
        completion_tokens=len(token_ids),
        notes={"sampling": {"mode": mode, "temperature": 1.0 if mode == "sampled" else 0.0}},
    )


async def _tool_episode(repo: Repository, episode_id: str, answer: str) -> None:
    """Two calls: the agent calls the calculator, gets its result, then answers."""
    tool_call = {"id": "call_calc_1", "type": "function", "function": {"name": "calculator", "arguments": TOOL_ARGS}}
    first = [
        {"role": "system", "content": "You are a careful calculator agent."},
        {"role": "user", "content": "What is 17 * 23?"},
    ]
    second = [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "call_calc_1", "content": "RESULT-391"},
    ]
    outcome = await repo.calls.insert(
        [
            _call(
                episode_id,
                first,
                text="",
                tool_calls=[tool_call],
                token_ids=[501, 502, 503],
                logprobs=[-0.01, -2.5, -0.2],
                version=1,
            )
        ]
    )
    assert outcome == [None]
    outcome = await repo.calls.insert(
        [
            _call(
                episode_id,
                second,
                text=f"The answer is {answer}.",
                tool_calls=None,
                token_ids=[601, 602],
                logprobs=[-0.1, -4.0],
                version=1,
                mode="greedy",
            )
        ]
    )
    assert outcome == [None]


@pytest.fixture
async def ui(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Repository, list[str]]]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
    await migrate_async(url)
    async with running_app(make_settings(url), transport=fake_upstream()) as client:
        repo: Repository = client.app.state.services.repo  # type: ignore[attr-defined]
        group = await repo.episodes.create_group(task_id="calc-17x23", size=3, metadata={})
        ids = [e.id for e in group.episodes or []]
        await _tool_episode(repo, ids[0], "391")
        await _tool_episode(repo, ids[1], "390")
        await repo.episodes.set_reward(ids[0], reward=1.0, call_rewards={"0": 0.3}, metadata=None)
        await repo.episodes.set_reward(ids[1], reward=0.0, call_rewards=None, metadata=None)
        await repo.versions.add(version=1, name="policy-v1", adapter_path="/adapters/policy-v1", metadata={})
        for step in range(3):
            await repo.steps.add(step=step, metrics={"reward/mean": 0.1 * step, "loss/total": 1.0 - step / 10})
        yield client, repo, ids


async def _login(client: httpx.AsyncClient, key: str = ADMIN_KEY, next_path: str = "/ui/") -> httpx.Response:
    return await client.post(
        "/ui/login",
        content=f"key={key}&next={next_path}",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )


def _no_key(response: httpx.Response) -> None:
    assert ADMIN_KEY not in response.text
    assert ADMIN_KEY not in str(response.headers)


async def test_login_sets_a_signed_httponly_cookie_not_the_key(ui: Any) -> None:
    client, _, _ = ui
    response = await _login(client, next_path="/ui/episodes")
    assert response.status_code == 303
    assert response.headers["location"] == "/ui/episodes"
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    assert "httponly" in cookie.lower()
    assert "samesite=strict" in cookie.lower()
    assert "path=/ui" in cookie.lower()
    _no_key(response)
    token = client.cookies[COOKIE]
    assert SessionTokens(ADMIN_KEY).valid(token)
    assert not SessionTokens("another-admin-key-0123456789").valid(token)


async def test_wrong_key_and_other_keys_are_refused(ui: Any) -> None:
    client, _, ids = ui
    for key in ("wrong-key", "agent-key-0123456789abcdef", client.app.state.services.keys.episode_key(ids[0])):
        response = await _login(client, key=key)
        assert response.status_code == 401
        assert COOKIE not in response.headers.get("set-cookie", "")
        assert "not the admin key" in response.text
    assert COOKIE not in client.cookies


@pytest.mark.parametrize("path", ["/ui/", "/ui/groups", "/ui/episodes", "/ui/api/overview"])
async def test_pages_redirect_to_login_without_a_session(ui: Any, path: str) -> None:
    client, _, _ = ui
    response = await client.get(path)
    assert response.status_code == 303
    assert response.headers["location"] == f"/ui/login?next={path}"
    client.cookies.set(COOKIE, "v1.9999999999.nonce.forged")
    assert (await client.get(path)).status_code == 303
    client.cookies.clear()
    wrong_bearer = await client.get(path, headers={"authorization": "Bearer agent-key-0123456789abcdef"})
    assert wrong_bearer.status_code == 303


async def test_expired_session_is_refused() -> None:
    now = [1000.0]
    tokens = SessionTokens(ADMIN_KEY, ttl_s=60, clock=lambda: now[0])
    token = tokens.issue()
    assert tokens.valid(token)
    now[0] += 61
    assert not tokens.valid(token)
    body, _, _ = token.rpartition(".")
    assert not tokens.valid(f"{body}.{'A' * 43}")


async def test_every_page_answers_with_a_session_and_never_shows_the_key(ui: Any) -> None:
    client, _, ids = ui
    group_id = (await client.get(f"/episodes/{ids[0]}", headers=ADMIN)).json()["group_id"]
    await _login(client)
    for path in (
        "/ui/",
        "/ui/groups",
        "/ui/episodes",
        f"/ui/episodes/{ids[0]}",
        f"/ui/groups/{group_id}",
        "/ui/login",
        f"/ui/episodes?group={group_id}&status=rewarded&task=17x",
    ):
        response = await client.get(path)
        assert response.status_code == 200, path
        assert "text/html" in response.headers["content-type"]
        assert "script-src 'self'" in response.headers["content-security-policy"]
        _no_key(response)
    feed = await client.get("/ui/api/overview")
    assert feed.status_code == 200
    _no_key(feed)
    assert [s["step"] for s in feed.json()["steps"]] == [0, 1, 2]
    assert feed.json()["episodes"] == {"rewarded": 2, "open": 1}
    newer = await client.get("/ui/api/overview", params={"since_step": 1})
    assert [s["step"] for s in newer.json()["steps"]] == [2]


async def test_tokens_per_second_is_a_number_from_the_first_page_load_and_counts_the_calls(ui: Any) -> None:
    """The overview's "Tokens/s through this proxy": rendered with the page (it once showed "…" until
    two polls had compared counters), then in every poll of the feed, over the span it names."""
    client, _, ids = ui
    await _login(client)
    page = (await client.get("/ui/")).text
    assert re.search(r'<dd id="proxy-rate" data-count="proxy-rate">0\.0</dd>', page)
    key = client.app.state.services.keys.episode_key(ids[2])
    body = {"model": "policy", "messages": [{"role": "user", "content": "17 * 23?"}], "max_tokens": 4}
    answer = await client.post(
        f"/episodes/{ids[2]}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    )
    assert answer.status_code == 200, answer.text
    used = answer.json()["usage"]
    tokens = used["prompt_tokens"] + used["completion_tokens"]
    proxy = (await client.get("/ui/api/overview")).json()["proxy"]
    assert proxy["prompt_tokens"] + proxy["completion_tokens"] == tokens > 0
    assert proxy["tokens_per_s"] > 0 and proxy["tokens_per_s_over_s"] > 0
    assert proxy["tokens_per_s"] == pytest.approx(tokens / proxy["tokens_per_s_over_s"], rel=0.05)
    shown = re.search(r'<dd id="proxy-rate" data-count="proxy-rate">([0-9.]+)</dd>', (await client.get("/ui/")).text)
    assert shown and float(shown.group(1)) > 0


def test_token_rate_runs_over_the_last_window_of_readings() -> None:
    now = [100.0]
    rate = TokenRate(window_s=60, clock=lambda: now[0])  # made at 100 s, when the counters are 0
    now[0] = 110.0
    assert rate.update(500.0) == (50.0, 10.0)  # since the start: 500 tokens in 10 s
    for t, total in ((140.0, 800.0), (170.0, 800.0), (200.0, 1400.0)):
        now[0] = t
        last = rate.update(total)
    assert last == (10.0, 60.0)  # from the reading at 140 s (800) to 200 s (1400): the last minute
    now[0] = 1000.0
    assert rate.update(1400.0) == (0.0, 800.0)  # nothing read for a long while: the span says so


async def test_bearer_header_is_an_alternative_to_the_cookie(ui: Any) -> None:
    client, _, ids = ui
    response = await client.get(f"/ui/episodes/{ids[0]}", headers=ADMIN)
    assert response.status_code == 200
    _no_key(response)


async def test_logout_deletes_the_cookie(ui: Any) -> None:
    client, _, _ = ui
    await _login(client)
    assert (await client.get("/ui/")).status_code == 200
    response = await client.post("/ui/logout")
    assert response.status_code == 303
    assert COOKIE not in client.cookies
    assert (await client.get("/ui/")).status_code == 303


async def test_static_files_need_no_session(ui: Any) -> None:
    client, _, _ = ui
    for path in ("/ui/static/ui.css", "/ui/static/overview.js", "/ui/static/vendor/uPlot.iife.min.js"):
        response = await client.get(path)
        assert response.status_code == 200, path
    vendored = (await client.get("/ui/static/vendor/uPlot.iife.min.js")).text
    assert vendored.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.31)")


async def test_episode_page_shows_the_conversation_tools_tokens_and_rewards(ui: Any) -> None:
    client, _, ids = ui
    await _login(client)
    page = (await client.get(f"/ui/episodes/{ids[0]}")).text
    assert "You are a careful calculator agent." in page
    assert "What is 17 * 23?" in page
    assert '<strong class="tool-name">calculator</strong>' in page
    assert "&#34;expression&#34;: &#34;17 * 23&#34;" in page  # the arguments, pretty-printed and escaped
    assert "RESULT-391" in page
    assert "result of <code>call_calc_1</code>" in page
    assert "The answer is 391." in page
    assert re.search(r'<dd class="reward">1(\.0)?</dd>', page)
    assert "call 0: 0.3" in page and "call reward 0.3" in page
    assert "advantage (group-normalised)" in page
    assert "policy-v1" in page and "vllm-0" in page and "123 ms" in page
    # The token view: 11 masked prompt ids, the sampled tokens with their text, tinted by logprob;
    # the greedy answer's tokens are in the sequence but struck through (the trainer masks them).
    assert 'Tokens: 11 prompt (loss-masked); 3 sampled, <span class="trained-count">3</span> of them trained' in page
    token = r'<span class="tok" style="--shade: 0\.918" title="id 502 · logprob -2\.5">&lt;502&gt;</span>'
    assert re.search(token, page)
    assert '2 sampled, <span class="trained-count">0</span> of them trained' in page
    masked = r'<span class="tok masked" style="--shade: 0\.982" title="id 602 · logprob -4 · not trained">'
    assert re.search(masked, page)
    # The tool result appears once: the second call shows only what was new since the first.
    assert page.count("RESULT-391") == 1
    assert page.count("What is 17 * 23?") == 1


async def test_compare_page_puts_the_group_side_by_side(ui: Any) -> None:
    client, _, ids = ui
    await _login(client)
    group_id = (await client.get(f"/episodes/{ids[0]}", headers=ADMIN)).json()["group_id"]
    page = (await client.get(f"/ui/groups/{group_id}")).text
    assert page.count('<article class="member"') == 3
    assert "The answer is 391." in page and "The answer is 390." in page
    assert "advantage 1" in page and "advantage -1" in page
    missing = await client.get("/ui/groups/00000000-0000-0000-0000-000000000000")
    assert missing.status_code == 404


async def test_episode_pages_are_disjoint_and_in_order(ui: Any) -> None:
    client, repo, _ = ui
    for _ in range(40):  # 120 more episodes; a group's episodes share created_at, so the id breaks ties
        await repo.episodes.create_group(task_id="paging", size=3, metadata={})
    await _login(client)
    seen: list[str] = []
    path = "/ui/episodes?task=paging"
    pages = 0
    while path:
        page = (await client.get(path)).text
        seen += re.findall(r'<a href="/ui/episodes/([0-9a-f-]{36})">', page)
        following = re.search(r'<a rel="next" href="([^"]+)"', page)
        path = "/ui/episodes" + following.group(1).replace("&amp;", "&") if following else ""
        pages += 1
    assert pages == 3  # 50 + 50 + 20
    assert len(seen) == 120 == len(set(seen))
    rows = await repo.browse.episodes(task="paging", limit=1000)
    assert seen == [r.episode.id for r in rows]
    created = [(r.episode.created_at, r.episode.id) for r in rows]
    assert created == sorted(created, reverse=True)


async def test_filters_narrow_the_tables(ui: Any) -> None:
    client, _, ids = ui
    await _login(client)
    rewarded = (await client.get("/ui/episodes", params={"status": "rewarded"})).text
    assert set(re.findall(r'<a href="/ui/episodes/([0-9a-f-]{36})">', rewarded)) == set(ids[:2])
    none = (await client.get("/ui/episodes", params={"task": "no-such-task"})).text
    assert "No episodes." in none
    groups = (await client.get("/ui/groups", params={"task": "17x2"})).text
    assert groups.count('<a href="/ui/groups/') == 1
    assert (
        orjson.dumps(ids[0]).decode().strip('"')
        in (
            await client.get(
                "/ui/episodes",
                params={"group": (await client.get(f"/episodes/{ids[0]}", headers=ADMIN)).json()["group_id"]},
            )
        ).text
    )


async def test_login_leads_only_to_dashboard_paths(ui: Any) -> None:
    client, _, _ = ui
    for target in ("https://evil.example/", "//evil.example/ui/", "/episodes", ""):
        response = await _login(client, next_path=target)
        assert response.status_code == 303
        assert response.headers["location"] == "/ui/", target
    client.cookies.clear()
    bare = await client.get("/ui", follow_redirects=True)
    assert bare.status_code == 200
    assert 'name="key" type="password"' in bare.text


async def test_a_judged_reward_shows_the_judges_verdict_on_the_episode_and_compare_pages(ui: Any) -> None:
    """The audit ``workflows/judge`` keeps in the reward's metadata is shown, not only as raw JSON."""
    client, repo, ids = ui
    audit = {
        "score": 0.25,
        "reason": "The product is off by one <b>unit</b>.",
        "label": "trajectory_2",
        "clipped": False,
        "model": "judge-model-x",
        "latency_s": 1.5,
        "attempts": 2,
        "failures": ["not JSON"],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5},
        "prompt": [{"role": "user", "content": "score these"}],
        "answer": '{"trajectory_2": {"reason": "...", "score": 0.25}}',
    }
    metadata = {"reward_mode": "mix", "judge_weight": 0.5, "verifier_reward": 0.0, "judge": audit}
    await repo.episodes.set_reward(ids[2], reward=0.125, call_rewards=None, metadata=metadata)
    await _login(client)
    page = (await client.get(f"/ui/episodes/{ids[2]}")).text
    assert "judge <code>judge-model-x</code>: score 0.25" in page
    assert "mix (judge weight 0.5, verifier 0" in page and "2 attempts" in page
    assert '<blockquote class="judge-reason">The product is off by one &lt;b&gt;unit&lt;/b&gt;.</blockquote>' in page
    assert "the judge's prompt and answer (trajectory_2)" in page
    unjudged = (await client.get(f"/ui/episodes/{ids[0]}")).text
    assert 'class="judge"' not in unjudged
    group_id = (await client.get(f"/episodes/{ids[0]}", headers=ADMIN)).json()["group_id"]
    compare = (await client.get(f"/ui/groups/{group_id}")).text
    assert compare.count('<div class="judge">') == 1 and "judge-model-x" in compare


async def test_the_fork_tree_shows_the_source_its_fork_point_and_the_siblings_rewards(ui: Any) -> None:
    client, repo, ids = ui
    await _login(client)
    fork = await repo.forks.create(ids[0], at=1, size=2, rule="sample", metadata={})
    siblings = [e.id for e in fork.episodes or []]
    replayed = _call(siblings[0], [{"role": "user", "content": "What is 17 * 23?"}], text="", tool_calls=None,
                     token_ids=[501, 502, 503], logprobs=[-0.01, -2.5, -0.2], version=1)  # fmt: skip
    replayed.notes = {
        **(replayed.notes or {}),
        "replay": {"source_episode_id": ids[0], "source_ordinal": 0, "index": 0},
    }
    assert await repo.calls.insert([replayed]) == [None]
    assert await repo.forks.diverge(siblings[1], at=0, divergence={"fields": ["messages[1]"], "rule": "sample"})
    assert not await repo.forks.diverge(siblings[1], at=3, divergence={"fields": ["tools"], "rule": "sample"})
    await repo.episodes.set_reward(siblings[0], reward=0.75, call_rewards=None, metadata=None)
    await repo.episodes.abandon(siblings[1], reason="agent failed", cause="agent")

    source = (await client.get(f"/ui/episodes/{ids[0]}")).text
    assert "<h2>Forks</h2>" in source and "after call 1" in source
    assert f'<a href="/ui/episodes/{siblings[0]}">#0</a>: 0.75' in source
    assert f'<a href="/ui/episodes/{siblings[1]}">#1</a>: abandoned (diverged at 0)' in source
    page = (await client.get(f"/ui/episodes/{siblings[0]}")).text
    assert f'fork of</dt><dd><a href="/ui/episodes/{ids[0]}">' in page
    assert "its first 1 answered call replayed" in page
    assert "never sent to the engine, context only" in page
    assert '3 sampled, <span class="trained-count">0</span> of them trained' in page  # context only
    assert "1 calls answered from the source" in page
    diverged = (await client.get(f"/ui/episodes/{siblings[1]}")).text
    assert "diverged at call 0" in diverged and "messages[1] differed; sample" in diverged
    compare = (await client.get(f"/ui/groups/{fork.id}")).text
    assert "Fork group of episode" in compare
    overview = (await client.get("/ui/")).text  # per workflow (the source group has none: "?")
    assert re.search(r"<td>\?</td><td class=\"num\">2</td><td class=\"num\">50%</td><td class=\"num\">1</td>", overview)


async def test_an_episode_whose_calls_are_all_greedy_says_it_trains_nothing_and_why(ui: Any) -> None:
    client, repo, ids = ui
    await _login(client)
    greedy = [{"role": "user", "content": "What is 2 + 2?"}]
    call = _call(ids[2], greedy, text="4", tool_calls=None, token_ids=[7], logprobs=[-0.1], version=1, mode="greedy")
    assert await repo.calls.insert([call]) == [None]
    page = (await client.get(f"/ui/episodes/{ids[2]}")).text
    assert "Nothing in this episode can be trained (greedy)" in page and "temperature 0" in page
    trainable = (await client.get(f"/ui/episodes/{ids[0]}")).text  # one sampled call is enough
    assert "Nothing in this episode can be trained" not in trainable


@asynccontextmanager
async def _canary_ui(tmp_path: Path, share: float) -> AsyncIterator[httpx.AsyncClient]:
    """A signed-in dashboard on an empty store whose publishes start canaries at ``share``."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'canary.db'}"
    await migrate_async(url)
    settings = make_settings(url, policy={"canary": {"share": share, **TEST}})
    async with running_app(settings, transport=fake_upstream()) as client:
        await _login(client)
        yield client


def _panel(page: str) -> str:
    """The overview's canary section alone, so an assertion cannot match another panel's text."""
    match = re.search(r'<section aria-labelledby="canary-h" id="canary">(.*?)</section>', page, re.DOTALL)
    assert match, "no canary panel on the overview"
    return match.group(1)


def _field(panel: str, attribute: str, name: str) -> str:
    match = re.search(rf'{attribute}="{name}">([^<]*)<', panel)
    assert match, f"{attribute}={name} is not in the canary panel"
    return match.group(1)


async def test_the_canary_panel_says_canaries_are_off_or_none_has_run(ui: Any, tmp_path: Path) -> None:
    client, _, _ = ui
    await _login(client)
    panel = _panel((await client.get("/ui/")).text)
    assert 'data-canary="off"' in panel and "<code>policy.canary.share</code> is 0" in panel
    assert "data-decision" not in panel and 'data-canary="running"' not in panel
    async with _canary_ui(tmp_path, 0.5) as fresh:
        panel = _panel((await fresh.get("/ui/")).text)
        assert 'data-canary="none"' in panel and "No canary has run yet" in panel and "50%" in panel
        assert 'data-canary="off"' not in panel


async def test_the_canary_panel_shows_the_running_canary_its_arms_and_the_verdict(tmp_path: Path) -> None:
    async with _canary_ui(tmp_path, 0.5) as client:
        await publish(client, "/a/1")
        await publish(client, "/a/2")
        split = await by_arm(client, 3)
        for episode, value in zip(split["canary"][:3], (1.0, 0.0, 1.0), strict=True):
            assert (await reward(client, episode["id"], value)).status_code == 200
        assert (await reward(client, split["baseline"][0]["id"], 0.25)).status_code == 200
        api = (await client.get("/policy/canary", headers=ADMIN)).json()["evidence"]
        panel = _panel((await client.get("/ui/")).text)
        assert _field(panel, "data-canary", "version") == "v2"
        assert _field(panel, "data-canary", "baseline") == "v1"
        assert _field(panel, "data-canary", "share") == "50%"
        assert _field(panel, "data-canary", "verdict") == "continue"
        assert _field(panel, "data-arm", "canary-n") == "3"
        assert _field(panel, "data-arm", "baseline-n") == "1"
        assert _field(panel, "data-arm", "canary-mean") == "0.667"
        assert _field(panel, "data-arm", "baseline-mean") == "0.25"
        assert _field(panel, "data-canary", "margin") == "0.1"
        assert _field(panel, "data-canary", "pairs") == "1"
        # The same evidence as the control API's, not a second computation of it.
        assert (api["canary"]["n"], api["baseline"]["n"], api["verdict"]) == (3, 1, "continue")
        bounds = f"[{api['lower']:.3g}, {api['upper']:.3g}]"
        assert _field(panel, "data-canary", "bounds") == bounds
        assert _field(panel, "data-canary", "reason") == api["reason"]
        assert "data-decision" not in panel
        # Worse canary rewards until the test itself rolls it back: listed as the test's decision.
        more = await by_arm(client, 14)
        for canary, baseline in zip(more["canary"], more["baseline"], strict=False):
            assert (await reward(client, canary["id"], 0.0)).status_code == 200
            assert (await reward(client, baseline["id"], 1.0)).status_code == 200
            if (await client.get("/policy/canary", headers=ADMIN)).json()["running"] is None:
                break
        [decision] = (await client.get("/policy/canary", headers=ADMIN)).json()["decisions"]
        panel = _panel((await client.get("/ui/")).text)
        row = re.search(r'<tr data-decision="2">(.*?)</tr>', panel, re.DOTALL)
        assert row and 'data-canary="running"' not in panel
        assert _field(row.group(1), "data-field", "verdict") == decision["verdict"] == "rollback"
        assert _field(row.group(1), "data-field", "by") == "test"
        assert str(escape(decision["reason"])) in row.group(1)  # its "<" escaped by the template
        assert "&lt; 0" in row.group(1)


async def test_the_canary_panel_lists_decisions_newest_first_with_who_decided(tmp_path: Path) -> None:
    async with _canary_ui(tmp_path, 0.5) as client:
        await publish(client, "/a/1")
        await publish(client, "/a/2")
        split = await by_arm(client, 1)
        assert (await reward(client, split["canary"][0]["id"], 0.0)).status_code == 200
        rolled = await client.post("/policy/canary/rollback", headers=ADMIN)
        assert rolled.status_code == 200, rolled.text
        panel = _panel((await client.get("/ui/")).text)
        assert 'data-canary="running"' not in panel and "No canary is running" in panel
        row = re.search(r'<tr data-decision="2">(.*?)</tr>', panel, re.DOTALL)
        assert row, panel
        assert _field(row.group(1), "data-field", "verdict") == "rollback"
        assert _field(row.group(1), "data-field", "by") == "manual"
        assert "1 / 0<" in row.group(1)  # the canary arm's one reward, from the stored evidence
        await publish(client, "/a/3")
        assert (await client.post("/policy/canary/promote", headers=ADMIN)).status_code == 200
        panel = _panel((await client.get("/ui/")).text)
        assert re.findall(r'<tr data-decision="(\d+)">', panel) == ["3", "2"]
        promoted = re.search(r'<tr data-decision="3">(.*?)</tr>', panel, re.DOTALL)
        assert promoted and _field(promoted.group(1), "data-field", "verdict") == "promote"
