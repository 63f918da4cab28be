"""The dashboard and the export on real recorded data: a proxy in front of the real vLLM, the calc
workflow's tool-calling episodes (agents venv), and one real trainer step running while a real
browser (Debian's Chromium driven by Playwright) watches the overview.

The browser test logs in through the form, waits for the overview's uPlot charts to appear while
the trainer is still training (live polling), checks how they are laid out at 1024 to 2560 pixels
wide (no two chart canvases intersect, each lies inside its grid cell, one column on a narrow
screen), opens an episode with tool calls and checks its conversation and token view in the DOM,
and saves screenshots (``data/screenshots/``, not committed; docs/images/ come from there). The
export test writes both formats with ``python -m proxy export`` from the same store, loads them
with Hugging Face ``datasets`` and compares them with the control API's records and with the
trainer's own merge of the same episodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.services import ADMIN_KEY, ROOT, ProxyProcess, serving_proxy
from tests.workflows.conftest import admin_get, run_workflow

pytestmark = pytest.mark.vllm

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS = ROOT / "data" / "screenshots"
CHART_BOXES = """() => [...document.querySelectorAll("#charts figure.chart")].map((cell) => {
  const box = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  return { title: cell.querySelector("h3").textContent, cell: box(cell), canvas: box(cell.querySelector("canvas")) };
})"""
"""Each chart's title, and the bounding boxes (left, top, right, bottom) of its grid cell and its canvas."""
TWO_FRAMES = "() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))"
"""Resolves once the page has laid out and painted twice: resize observers and redraws have run."""


@dataclass
class Recorded:
    proxy: ProxyProcess
    trainer: subprocess.Popen[bytes]
    trainer_log: Path
    group_ids: list[str]


def _trainer_done(recorded: Recorded, timeout: float = 600) -> None:
    code = recorded.trainer.wait(timeout=timeout)
    assert code == 0, recorded.trainer_log.read_text()[-4000:]


MAX_ROUNDS = 6
"""Rounds of two calc groups the fixture records at most before giving up on a trainable one."""


def _has_signal(proxy: ProxyProcess, group_id: str) -> bool:
    """Whether the group's episodes differ in reward or per-call rewards (so the trainer steps on it)."""
    episodes = admin_get(proxy, f"/groups/{group_id}")["episodes"]
    outcomes = {(e["reward"], tuple(sorted((e["call_rewards"] or {}).items()))) for e in episodes}
    return len(outcomes) > 1


@pytest.fixture(scope="module")
def recorded(smol_vllm_url: str, smol_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    """Two calc groups recorded through the proxy, then the trainer started on them (one step). On
    SmolLM2: the trainer steps only on a group whose returns differ, which takes a model that
    sometimes does the task (the plumbing model's episodes all earn 0)."""
    vllm_url, vllm_model_dir = smol_vllm_url, smol_dir
    workdir = tmp_path_factory.mktemp("dashboard")
    prefix = f"ui-{uuid.uuid4().hex[:6]}-v"
    with serving_proxy(vllm_url, workdir, FLYWHEEL_POLICY__ADAPTER_PREFIX=prefix) as proxy:
        # The trainer steps only on a group whose members' returns differ; which seed's episodes do
        # depends on the machine's numerics (bf16 or float32 samples other ids), so groups are
        # recorded, two at a time, until one does.
        for seed in range(5, 5 + MAX_ROUNDS):
            run_workflow(
                proxy,
                "run",
                "calc",
                groups=2,
                group_size=2,
                concurrency=2,
                seed=seed,
                options={"mix": "two_step", "useful_call_reward": 0.3},
            )
            listed = admin_get(proxy, "/groups", limit=100)["data"]
            groups = [g["id"] for g in listed if g["status"] == "complete"]
            if any(_has_signal(proxy, g) for g in groups):
                break
        else:
            pytest.fail(f"no group with unequal returns in {MAX_ROUNDS} rounds of 2: {listed}")
        log = workdir / "trainer.log"
        overrides = {
            "proxy_url": proxy.url,
            "output_dir": str(workdir / "trainer"),
            "model": vllm_model_dir,
            "max_steps": 1,
            "groups_per_step": 1,
            "batch_wait_s": 1,
            "turn_credit": "discounted",  # per-call rewards: turns differ even where episode rewards tie
            # ...and the trainer steps on such a group only when told to (its default gates shaping to
            # groups whose outcomes differ): this test watches the dashboard through one step
            "shaping": "always",
        }
        env = dict(os.environ, FLYWHEEL_ADMIN_KEY=ADMIN_KEY, PYTHONPATH=str(ROOT), FLYWHEEL_MODEL_DIR=vllm_model_dir)
        with log.open("wb") as out:
            trainer = subprocess.Popen(
                [sys.executable, "-m", "trainer", "run", "--config", "configs/trainer-local.yaml"]
                + [f"{k}={v}" for k, v in overrides.items()],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            yield Recorded(proxy, trainer, log, groups)
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()


def _tool_episode(proxy: ProxyProcess, group_ids: list[str]) -> dict[str, Any]:
    """A recorded episode whose calls made tool calls, with its calls."""
    for gid in group_ids:
        for listed in admin_get(proxy, "/episodes", group_id=gid)["data"]:
            raw = admin_get(proxy, f"/episodes/{listed['id']}", calls="true")
            if raw["status"] == "rewarded" and any(
                (c["response"] or {}).get("choices", [{}])[0].get("message", {}).get("tool_calls") for c in raw["calls"]
            ):
                return dict(raw)
    raise AssertionError("no rewarded episode with tool calls")


Box = list[float]


def _intersect(a: Box, b: Box) -> bool:
    return a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5


def _inside(inner: Box, outer: Box) -> bool:
    return (
        inner[0] >= outer[0] - 0.5
        and inner[1] >= outer[1] - 0.5
        and inner[2] <= outer[2] + 0.5
        and inner[3] <= outer[3] + 0.5
    )


def _chart_layout(page: Any, width: int) -> list[dict[str, Any]]:
    """The overview at ``width`` pixels: every chart apart from every other and inside its cell."""
    page.set_viewport_size({"width": width, "height": 900})
    page.evaluate(TWO_FRAMES)
    charts: list[dict[str, Any]] = page.evaluate(CHART_BOXES)
    assert len(charts) >= 3
    for i, one in enumerate(charts):
        assert _inside(one["canvas"], one["cell"]), f"{width}px: {one['title']!r} drawn outside its cell: {one}"
        for other in charts[i + 1 :]:
            assert not _intersect(one["canvas"], other["canvas"]), (
                f"{width}px: {one['title']!r} drawn over {other['title']!r}: {one['canvas']} {other['canvas']}"
            )
    return charts


def _proxy_rate(page: Any) -> float:
    """The overview's "Tokens/s through this proxy" figure: a number, never a placeholder."""
    text = page.locator("#proxy-rate").inner_text()
    try:
        return float(text)
    except ValueError:
        raise AssertionError(f"tokens/s through this proxy shows {text!r}, not a number") from None


def test_browser_logs_in_watches_the_overview_live_and_reads_an_episode(recorded: Recorded) -> None:
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (make setup installs it where apt-get works)")
    from playwright.sync_api import expect, sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    proxy = recorded.proxy
    episode = _tool_episode(proxy, recorded.group_ids)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{proxy.url}/ui/")
            assert page.url.startswith(f"{proxy.url}/ui/login")  # no session: the login form
            page.fill("input[name=key]", "not-the-key")
            page.click("button[type=submit]")
            expect(page.locator("body")).to_contain_text("not the admin key")
            page.fill("input[name=key]", ADMIN_KEY)
            page.click("button[type=submit]")
            page.wait_for_url(f"{proxy.url}/ui/")
            assert ADMIN_KEY not in page.content()
            cookie = next(c for c in page.context.cookies() if c["name"] == "fw_ui_session")
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and ADMIN_KEY not in cookie["value"]
            expect(page.locator("h1")).to_have_text("Overview")
            rewarded = len(admin_get(proxy, "/episodes", status="rewarded", limit=100)["data"])
            expect(page.locator('[data-count="episodes.rewarded"]')).to_have_text(str(rewarded))
            assert _proxy_rate(page) > 0  # the calc groups' calls went through this proxy before the page opened
            # The trainer is still loading or training: the charts appear once its step is posted,
            # without reloading the page (the overview polls every 5 s).
            running_when_opened = recorded.trainer.poll() is None
            assert page.locator("#charts canvas").count() == 0
            deadline = time.monotonic() + 900
            while page.locator("#charts canvas").count() == 0:
                code = recorded.trainer.poll()
                assert code in (None, 0), recorded.trainer_log.read_text()[-4000:]
                assert time.monotonic() < deadline, "no chart 15 minutes after the overview opened"
                page.wait_for_timeout(2000)
            assert running_when_opened, "the trainer had ended before the overview was open"
            charts = page.locator("#charts figure.chart")
            assert charts.count() >= 3
            titles = charts.locator("h3").all_inner_texts()
            assert "Reward" in titles and "Loss" in titles
            box = page.locator("#charts canvas").first.bounding_box()
            assert box is not None and box["width"] > 300 and box["height"] > 100
            expect(page.locator("#live")).to_contain_text("1 steps")
            _proxy_rate(page)  # still a number after the polls
            # Engine mismatch: grammar-constrained tokens never share a chart with the others.
            for chart in page.locator("#charts figure.chart").filter(has_text="Engine mismatch").all():
                title = chart.locator("h3").inner_text()
                labels = [x for x in chart.locator(".u-legend .u-label").all_inner_texts() if x != "step"]
                if title.endswith("grammar-constrained tokens"):
                    assert labels == ["constrained"], labels
                else:
                    assert labels and "constrained" not in labels, (title, labels)
            # Laid out apart at every width, and still after resizing (each chart follows its cell).
            for width in (1280, 1920):
                _chart_layout(page, width)
                page.screenshot(path=str(SCREENSHOTS / f"overview-{width}.png"), full_page=True)
            for width in (1024, 2560, 1440):
                _chart_layout(page, width)
            narrow = _chart_layout(page, 760)
            assert len({round(c["cell"][0]) for c in narrow}) == 1  # one column
            page.set_viewport_size({"width": 1280, "height": 900})

            page.goto(f"{proxy.url}/ui/groups")
            expect(page.locator("table tbody tr")).to_have_count(len(admin_get(proxy, "/groups", limit=100)["data"]))
            page.screenshot(path=str(SCREENSHOTS / "groups.png"), full_page=True)

            page.goto(f"{proxy.url}/ui/episodes/{episode['id']}")
            calls = page.locator("section.call")
            expect(calls).to_have_count(len(episode["calls"]))
            names = page.locator(".tool-call .tool-name").all_inner_texts()
            assert "calculator" in names and "submit_answer" in names
            assert page.locator(".msg.role-tool").count() >= 2  # tool results went back to the agent
            assert page.locator(".msg.role-system").count() == 1
            # The token view: one span per sampled token, tinted by its log-prob.
            first = episode["calls"][0]["choices"][0]
            details = page.locator("details.tokens").first
            details.locator("summary").click()
            tokens = details.locator(".tok")
            expect(tokens).to_have_count(len(first["token_ids"]))
            assert tokens.first.is_visible()
            title = tokens.first.get_attribute("title") or ""
            assert title.startswith(f"id {first['token_ids'][0]} ")
            shades = {s.get_attribute("style") for s in tokens.all()}
            assert len(shades) > 1  # different log-probs, different tints
            page.screenshot(path=str(SCREENSHOTS / "episode.png"), full_page=True)

            page.goto(f"{proxy.url}/ui/groups/{episode['group_id']}")
            expect(page.locator("h1")).to_contain_text("Group")
            page.screenshot(path=str(SCREENSHOTS / "compare.png"), full_page=True)
        finally:
            browser.close()
    _trainer_done(recorded)
    for name in ("overview-1280", "overview-1920", "groups", "episode", "compare"):
        assert (SCREENSHOTS / f"{name}.png").stat().st_size > 10_000


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_of_real_episodes_loads_in_datasets_and_matches_the_records(
    recorded: Recorded, tmp_path: Path, fmt: str, vllm_model_dir: str
) -> None:
    from datasets import load_dataset
    from transformers import AutoTokenizer

    from contract.client import Episode
    from trainer.data import DataStats, episode_samples
    from trainer.grammar import masks_for

    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    masker = masks_for(Path(vllm_model_dir), tokenizer, len(tokenizer))  # the calc calls are constrained

    proxy = recorded.proxy
    out = tmp_path / f"episodes.{fmt}"
    env = dict(os.environ, FLYWHEEL_STORE__URL=proxy.store_url, PYTHONPATH=str(ROOT), HF_DATASETS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "export", "--format", fmt, "--status", "rewarded", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    data = load_dataset(
        "parquet" if fmt == "parquet" else "json", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf")
    )
    listed = admin_get(proxy, "/episodes", status="rewarded", limit=100)["data"]
    assert data.num_rows == len(listed) >= 4
    tool_calls = 0
    for row in data:
        raw = admin_get(proxy, f"/episodes/{row['episode_id']}", calls="true")
        calls = sorted(raw["calls"], key=lambda c: c["ordinal"])
        assert row["reward"] == raw["reward"] and row["group_id"] == raw["group_id"]
        assert row["task_id"] == raw["task_id"] and row["status"] == "rewarded"
        assert len(row["calls"]) == len(calls)
        for exported, call in zip(row["calls"], calls, strict=True):
            assert exported["prompt_token_ids"] == call["prompt_token_ids"]
            assert exported["policy_version"] == call["policy_version"]
            assert exported["sampling_mode"] == call["notes"]["sampling"]["mode"]
            for choice, stored in zip(exported["choices"], call["choices"], strict=True):
                assert choice["token_ids"] == stored["token_ids"]
                assert choice["logprobs"] == pytest.approx(stored["logprobs"])
                assert len(choice["loss_mask"]) == len(choice["token_ids"])
        # The conversation: the last call's messages plus its answer, tool calls and results included.
        last = calls[-1]
        assert [m["role"] for m in row["messages"][:-1]] == [m["role"] for m in last["request"]["messages"]]
        assert row["messages"][-1]["role"] == "assistant"
        tool_calls += sum(len(m["tool_calls"]) for m in row["messages"])
        assert any(m["role"] == "tool" and m["tool_call_id"] for m in row["messages"])
        assert json.loads(row["tools"]) == last["request"]["tools"]
        # The loss mask is the trainer's: as many trained tokens as its own merge of this episode.
        (sample,) = episode_samples(
            Episode.model_validate(raw), group_id=raw["group_id"], max_seq_len=8192, stats=DataStats(), masker=masker
        )
        exported_mask = [m for call in row["calls"] for m in call["choices"][0]["loss_mask"]]
        assert sum(exported_mask) == sum(sample.loss_mask) > 0
        trained = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
        assert trained == [
            t
            for call in row["calls"]
            for t, m in zip(call["choices"][0]["token_ids"], call["choices"][0]["loss_mask"], strict=True)
            if m
        ]
    assert tool_calls >= 2 * data.num_rows
    rewards = {}
    for row in data:
        rewards.setdefault(row["group_id"], []).append(row)
    for members in rewards.values():
        if len({m["reward"] for m in members}) > 1:
            assert sum(m["advantage"] for m in members) == pytest.approx(0.0, abs=1e-9)


def test_the_download_button_serves_the_same_rows(recorded: Recorded, tmp_path: Path) -> None:
    proxy = recorded.proxy
    response = httpx.get(
        f"{proxy.url}/ui/export",
        params={"format": "jsonl", "status": "rewarded"},
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    rows = [json.loads(line) for line in response.text.splitlines()]
    listed = admin_get(proxy, "/episodes", status="rewarded", limit=100)["data"]
    assert sorted(r["episode_id"] for r in rows) == sorted(e["id"] for e in listed)
