"""No key leaks: a short real run, then every log, store file and answer is searched for every key.

The stack: ``python -m proxy serve`` (debug logging, its admin key in a key file) on the real vLLM
and a SQLite store. The run: a group of two episodes making chat (plain and streamed), Responses
and Anthropic Messages calls (key in ``x-api-key``); errors (wrong keys, near misses of the admin
key, an episode key on a control route and on another episode, bad bodies, an unknown episode); a
wrong and a right dashboard login and its pages; rewards, a trainer's claim and ack; the admin key
rotated by SIGHUP mid-run, with calls under the retired key, its episode keys and the new ones;
the failed-key limit crossed (429s); ``/metrics``.

Then every key in play (both admin keys, every episode key and its signature alone, every session
cookie and its signature, every wrong key presented), and every run of 17 or more of a secret's
characters, is searched for in the proxy's log, the store's files (database, WAL) and every
answer's headers and body. Allowed, and only there: the episode keys
in the answers that hand them out (``POST /groups``) and the session cookie in the login's
``set-cookie``. A hit fails the test, naming where.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.auth import EPISODE_KEY_PREFIX
from tests.support.services import ProxyProcess

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "What is 2+2? Answer with a number."}]
WINDOW = 12


@dataclass
class Answer:
    label: str
    status: int
    headers: list[tuple[str, str]]
    body: str
    issues_keys: bool = False
    """The route's job is to hand out keys (``POST /groups``): its body may hold them."""


@dataclass
class Run:
    """Talks to the proxy and keeps every answer, and every key that was in play."""

    url: str
    answers: list[Answer] = field(default_factory=list)
    secrets: dict[str, str] = field(default_factory=dict)
    """name -> a secret string that must appear nowhere it is not meant to."""

    def send(
        self,
        label: str,
        method: str,
        path: str,
        *,
        key: str | None = None,
        headers: dict[str, str] | None = None,
        issues_keys: bool = False,
        **kwargs: Any,
    ) -> httpx.Response:
        headers = dict(headers or {})
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        response = httpx.request(method, self.url + path, headers=headers, timeout=120.0, **kwargs)
        self.keep(label, response, issues_keys=issues_keys)
        return response

    def keep(self, label: str, response: httpx.Response, *, issues_keys: bool = False) -> None:
        self.answers.append(
            Answer(label, response.status_code, list(response.headers.multi_items()), response.text, issues_keys)
        )

    def expect(self, label: str, status: int, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self.send(label, method, path, **kwargs)
        assert response.status_code == status, f"{label}: {response.status_code} {response.text[:300]}"
        return response

    def stream(self, label: str, path: str, key: str, body: dict[str, Any]) -> None:
        with httpx.stream(
            "POST", self.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=120.0
        ) as response:
            response.read()
        self.keep(label, response)
        assert response.status_code == 200 and "[DONE]" in response.text, label

    def secret(self, name: str, value: str, *, pieces: bool = True) -> str:
        """Remember ``value`` as a secret; with ``pieces``, also every run of 17 or more of its
        characters (windows of 12 every 6), so a key cut short or embedded is found too."""
        assert len(value) >= 16, f"{name}: {len(value)} characters would match by chance"
        self.secrets[name] = value
        if pieces and len(value) >= 24:
            for start in range(0, len(value) - WINDOW + 1, WINDOW // 2):
                self.secrets[f"{name} (characters {start}-{start + WINDOW})"] = value[start : start + WINDOW]
        return value

    def episode_keys(self, label: str, answer: httpx.Response) -> list[dict[str, str]]:
        keys: list[dict[str, str]] = answer.json()["episode_keys"]
        for i, ep in enumerate(keys):
            self.secret(f"{label} episode {i} key", ep["api_key"], pieces=False)  # it holds the (public) id
            self.secret(f"{label} episode {i} key's signature", signature_of(ep["api_key"]))
        return keys


def signature_of(episode_key: str) -> str:
    """The signature of ``fw-ep-<uuid>-<signature>``: urlsafe base64, which may itself hold a ``-``."""
    return episode_key[len(EPISODE_KEY_PREFIX) + 36 + 1 :]


def write_key(path: Path, key: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(key + "\n")
    os.replace(tmp, path)


def calls(run: Run, label: str, ep: dict[str, str], *, every_api: bool) -> None:
    """One episode's model calls: chat, or every API (chat plain and streamed, Responses, Messages)."""
    base = f"/episodes/{ep['id']}/v1"
    chat = {"model": "policy", "messages": MESSAGES, "max_tokens": 8, "temperature": 0.7}
    run.expect(f"{label}: chat", 200, "POST", f"{base}/chat/completions", key=ep["api_key"], json=chat)
    if not every_api:
        return
    run.stream(f"{label}: chat streamed", f"{base}/chat/completions", ep["api_key"], {**chat, "stream": True})
    responses = {"model": "policy", "input": "What is 3+3?", "max_output_tokens": 8}
    run.expect(f"{label}: responses", 200, "POST", f"{base}/responses", key=ep["api_key"], json=responses)
    messages = {"model": "policy", "max_tokens": 8, "messages": MESSAGES}
    run.expect(
        f"{label}: messages (x-api-key)",
        200,
        "POST",
        f"{base}/messages",
        headers={"x-api-key": ep["api_key"], "anthropic-version": "2023-06-01"},
        json=messages,
    )


def errors(run: Run, admin: str, eps: list[dict[str, str]]) -> None:
    """Wrong keys and bad requests, each answered with an error that must not hold a key."""
    wrong = run.secret("a wrong key", "fw-wrong-" + secrets.token_urlsafe(24))
    near = run.secret("the admin key, one character changed", admin[:-1] + ("A" if admin[-1] != "A" else "B"))
    longer = run.secret("the admin key with a character added", admin + "x")
    forged = run.secret("a forged episode key", eps[0]["api_key"][:-2] + "AA", pieces=False)
    run.secret("a forged episode key's signature", signature_of(forged))
    run.expect("wrong key on /groups", 401, "GET", "/groups", key=wrong)
    run.expect("near-miss admin key", 401, "GET", "/episodes", key=near)
    run.expect("admin key plus a character", 401, "POST", "/episodes", key=longer, json={"task_id": "x"})
    run.expect("episode key on a control route", 403, "GET", "/groups", key=eps[0]["api_key"])
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": 4}
    other = f"/episodes/{eps[1]['id']}/v1/chat/completions"
    run.expect("episode key on another episode", 403, "POST", other, key=eps[0]["api_key"], json=body)
    own = f"/episodes/{eps[0]['id']}/v1/chat/completions"
    run.expect("forged episode key", 401, "POST", own, key=forged, json=body)
    run.expect("bad chat body", 400, "POST", own, key=eps[0]["api_key"], json={"model": "policy", "messages": 3})
    run.expect(
        "wrong x-api-key on messages",
        401,
        "POST",
        f"/episodes/{eps[0]['id']}/v1/messages",
        headers={"x-api-key": wrong},
        json={"model": "policy", "max_tokens": 4, "messages": MESSAGES},
    )
    run.expect("bad reward", 400, "POST", f"/episodes/{eps[0]['id']}/reward", key=admin, json={"reward": "high"})
    run.expect("unknown episode", 404, "GET", f"/episodes/{'0' * 8}-0000-4000-8000-{'0' * 12}", key=admin)
    run.expect("wrong dashboard login", 401, "POST", "/ui/login", data={"key": near, "next": "/ui/"})


def dashboard(run: Run, admin: str, label: str, group_id: str, episode_id: str) -> None:
    login = run.expect(f"{label}: dashboard login", 303, "POST", "/ui/login", data={"key": admin, "next": "/ui/"})
    cookie = login.cookies["fw_ui_session"]
    run.secret(f"{label}: session cookie", cookie, pieces=False)  # it starts with its expiry time
    run.secret(f"{label}: session cookie's nonce", cookie.split(".")[2])
    run.secret(f"{label}: session cookie's signature", cookie.rsplit(".", 1)[1])
    jar = {"cookie": f"fw_ui_session={cookie}"}
    for page in ("/ui/", "/ui/api/overview", "/ui/groups", "/ui/episodes", f"/ui/groups/{group_id}"):
        run.expect(f"{label}: {page}", 200, "GET", page, headers=jar)
    run.expect(f"{label}: an episode's page", 200, "GET", f"/ui/episodes/{episode_id}", headers=jar)
    run.expect(f"{label}: export", 200, "GET", "/ui/export?format=jsonl", headers=jar)


def trainer(run: Run, admin: str) -> None:
    claim = run.expect(
        "trainer claim", 200, "POST", "/trainer/claim", key=admin, json={"trainer_id": "leak-test", "max_groups": 4}
    ).json()
    assert claim["groups"], "the rewarded group should be claimable"
    ack = {"lease_id": claim["lease_id"], "group_ids": [g["id"] for g in claim["groups"]], "step": 1}
    run.expect("trainer ack", 200, "POST", "/trainer/ack", key=admin, json=ack)


def rotate(run: Run, proxy: ProxyProcess, key_file: Path, old: str) -> str:
    """A new admin key in the file and SIGHUP; returns once the proxy accepts it."""
    new = run.secret("the rotated admin key", secrets.token_urlsafe(32))
    write_key(key_file, new)
    assert proxy.proc is not None
    os.kill(proxy.proc.pid, signal.SIGHUP)
    rotated = 'flywheel_admin_key_reloads_total{outcome="rotated"} 1.0'
    for _ in range(300):  # watched on /metrics (no key): a wrong key tried early would count as a guess
        if rotated in httpx.get(f"{run.url}/metrics").text:
            break
        time.sleep(0.05)
    run.expect("new key", 200, "GET", "/policy", key=new)
    run.expect("old key in its grace window", 200, "GET", "/policy", key=old)
    return new


def hits(run: Run, files: list[Path]) -> Iterator[str]:
    """Where each secret appears outside the places meant to hold it."""
    for path in files:
        data = path.read_bytes()
        for name, value in run.secrets.items():
            if value.encode() in data:
                yield f"{name} in {path.name}"
    for answer in run.answers:
        for header, value in answer.headers:
            allowed = header.lower() == "set-cookie" and answer.label.endswith("dashboard login")
            for name, secret in run.secrets.items():
                if secret in value and not allowed:
                    yield f"{name} in the {header} header of '{answer.label}' ({answer.status})"
        for name, secret in run.secrets.items():
            if secret in answer.body and not (answer.issues_keys and "episode" in name):
                yield f"{name} in the body of '{answer.label}' ({answer.status})"


def test_no_key_reaches_a_log_a_store_file_or_an_answer(vllm_url: str, tmp_path: Path) -> None:
    key_file = tmp_path / "admin.key"
    admin = secrets.token_urlsafe(32)
    write_key(key_file, admin)
    proxy = ProxyProcess(
        upstream_url=vllm_url,
        store_url=f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}",
        workdir=tmp_path,
        extra_env={
            "FLYWHEEL_ADMIN_KEY": "",  # the key comes from the file, as `serve` does by default
            "FLYWHEEL_ADMIN_KEY_FILE": str(key_file),
            "FLYWHEEL_LOG_LEVEL": "debug",
            "FLYWHEEL_AUTH__FAILED_LIMIT": "12",
            "FLYWHEEL_AUTH__KEY_RELOAD_S": "0",  # SIGHUP only: the rotation happens when the test says
        },
    )
    run = Run(proxy.url)
    run.secret("the admin key", admin)
    proxy.start()
    try:
        created = run.expect(
            "create group", 201, "POST", "/groups", key=admin, json={"task_id": "leaks", "size": 2}, issues_keys=True
        )
        group, eps = created.json()["id"], run.episode_keys("first group", created)
        for i, ep in enumerate(eps):
            calls(run, f"episode {i}", ep, every_api=i == 0)
        errors(run, admin, eps)
        dashboard(run, admin, "first key", group, eps[0]["id"])
        for i, ep in enumerate(eps):
            run.expect(f"reward {i}", 200, "POST", f"/episodes/{ep['id']}/reward", key=admin, json={"reward": i})
        run.expect("the group", 200, "GET", f"/groups/{group}", key=admin)
        run.expect("an episode with its calls", 200, "GET", f"/episodes/{eps[0]['id']}", key=admin)
        trainer(run, admin)

        new = rotate(run, proxy, key_file, admin)
        later = run.expect(
            "create group, new key",
            201,
            "POST",
            "/groups",
            key=new,
            json={"task_id": "leaks", "size": 1},
            issues_keys=True,
        )
        fresh = run.episode_keys("second group", later)[0]
        body = {"model": "policy", "messages": MESSAGES, "max_tokens": 8}
        run.expect(
            "new episode key",
            200,
            "POST",
            f"/episodes/{fresh['id']}/v1/chat/completions",
            key=fresh["api_key"],
            json=body,
        )
        run.expect("abandon", 200, "POST", f"/episodes/{fresh['id']}/abandon", key=admin, json={"reason": "test"})
        dashboard(run, new, "rotated key", later.json()["id"], fresh["id"])

        throttled = 0
        for _ in range(14):  # past auth.failed_limit: 429 with Retry-After
            refused = run.send("wrong key, again", "GET", "/groups", key=run.secrets["a wrong key"])
            throttled += refused.status_code == 429
        assert throttled >= 2
        metrics = run.expect("/metrics", 200, "GET", "/metrics")
        assert 'flywheel_auth_retiring_used_total{role="admin"}' in metrics.text
        run.expect("/healthz", 200, "GET", "/healthz")
    finally:
        proxy.stop()

    assert "admin key file changed" in proxy.log_path.read_text(errors="replace")  # the log was written
    files = [proxy.log_path, *sorted(tmp_path.glob("flywheel.db*"))]
    found = sorted(set(hits(run, files)))
    assert not found, "keys leaked:\n" + "\n".join(found)
    assert len(run.answers) >= 55 and len(run.secrets) >= 60  # the search covered the whole run
