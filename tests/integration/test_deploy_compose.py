"""deploy/docker-compose.yml, read by the real Docker Compose v2 parser (no Docker engine here).

Each test renders the file the way ``docker compose up`` would (``config``: interpolation from an
env file, override files merged, every key checked against the Compose Specification) and checks
the wiring Flywheel depends on: start order, health checks, the volumes two containers must see at
the same path, secrets only from ``.env``, and vLLM flags equal to the local launcher's
(deploy/vllm.py) and accepted by vLLM's own argument parser. The GPU configs are loaded with the
proxy's and the trainer's own loaders, with the environment and overrides compose gives them.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.compose_check import COMPOSE_FILE, ComposeError, dockerfile_parser, engine_env, render
from deploy.vllm import VLLMServer
from tests.support.services import ROOT, engine_python

DEPLOY = ROOT / "deploy"
ENV_EXAMPLE = DEPLOY / ".env.example"
SCALE_FILE = DEPLOY / "docker-compose.scale.yml"
GPU_CONFIGS = sorted((ROOT / "configs").glob("gpu-*.yaml"))
DEFAULT_CONFIG = ROOT / "configs" / "gpu-qwen2.5-1.5b.yaml"
ADMIN_SENTINEL = "admin-sentinel-5f0c2a9e7d31"
PG_SENTINEL = "pgpass-sentinel-8b41d6c3"
SECRETS = {"FLYWHEEL_ADMIN_KEY": ADMIN_SENTINEL, "POSTGRES_PASSWORD": PG_SENTINEL}
SECRET_VARS = ("FLYWHEEL_ADMIN_KEY", "POSTGRES_PASSWORD", "HF_TOKEN", "OPENAI_API_KEY")


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return {key: value for key, value in pairs}


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """The stack as a user gets it: .env.example with the two secrets filled in."""
    return render(env_file=ENV_EXAMPLE, env=SECRETS)


def mounts(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Named-volume mounts of a service, by volume name."""
    return {m["source"]: m for m in service.get("volumes", []) if m["type"] == "volume"}


def test_compose_refuses_to_start_until_the_secrets_are_set() -> None:
    with pytest.raises(ComposeError) as no_key:
        render(env_file=ENV_EXAMPLE)
    assert re.search(
        r"required variable (FLYWHEEL_ADMIN_KEY|POSTGRES_PASSWORD) is missing a value: "
        r"set \1 in deploy/\.env \(see \.env\.example\)",
        str(no_key.value),
    ), no_key.value
    with pytest.raises(ComposeError, match="required variable POSTGRES_PASSWORD is missing a value"):
        render(env_file=ENV_EXAMPLE, env={"FLYWHEEL_ADMIN_KEY": ADMIN_SENTINEL})
    with pytest.raises(ComposeError, match="required variable FLYWHEEL_ADMIN_KEY is missing a value"):
        render(env_file=ENV_EXAMPLE, env={"POSTGRES_PASSWORD": PG_SENTINEL})


def test_services_start_in_order(config: dict[str, Any]) -> None:
    order = {
        name: {dep: spec["condition"] for dep, spec in (svc.get("depends_on") or {}).items()}
        for name, svc in config["services"].items()
    }
    assert order == {
        "postgres": {},
        "migrate": {"postgres": "service_healthy"},
        "model": {},
        "vllm-0": {"model": "service_completed_successfully"},
        "proxy": {"migrate": "service_completed_successfully", "vllm-0": "service_healthy"},
        "trainer": {"proxy": "service_healthy", "model": "service_completed_successfully"},
        "worker": {"proxy": "service_healthy"},
    }
    services = config["services"]
    assert services["migrate"]["command"] == ["python", "-m", "proxy", "migrate"]
    assert services["migrate"]["restart"] == "no" and services["model"]["restart"] == "no"
    # Only `migrate` touches the schema: proxy replicas must never race on it.
    assert services["proxy"]["command"][:5] == ["python", "-m", "proxy", "serve", "--no-migrate"]


def test_health_checks_probe_the_right_endpoints(config: dict[str, Any]) -> None:
    services = config["services"]
    assert services["postgres"]["healthcheck"]["test"][0] == "CMD-SHELL"
    assert "pg_isready" in services["postgres"]["healthcheck"]["test"][1]
    vllm_check = services["vllm-0"]["healthcheck"]["test"]
    assert vllm_check[:3] == ["CMD", "python3", "-c"] and "'http://127.0.0.1:8000/health'" in vllm_check[3]
    assert "--port" in services["vllm-0"]["command"]
    assert services["vllm-0"]["command"][services["vllm-0"]["command"].index("--port") + 1] == "8000"
    proxy_check = services["proxy"]["healthcheck"]["test"]
    assert proxy_check[:3] == ["CMD", "python", "-c"] and "'http://127.0.0.1:8100/healthz'" in proxy_check[3]
    assert services["proxy"]["environment"]["FLYWHEEL_PORT"] == "8100"
    assert services["proxy"]["environment"]["FLYWHEEL_HOST"] == "0.0.0.0"
    assert services["proxy"]["ports"] == [
        {"mode": "ingress", "host_ip": "127.0.0.1", "target": 8100, "published": "8100", "protocol": "tcp"}
    ]


def test_model_and_adapters_are_the_same_paths_in_vllm_and_the_trainer(config: dict[str, Any]) -> None:
    vllm, trainer, model = (config["services"][n] for n in ("vllm-0", "trainer", "model"))
    assert mounts(vllm)["adapters"]["target"] == mounts(trainer)["adapters"]["target"] == "/adapters"
    assert mounts(vllm)["adapters"]["read_only"] is True and not mounts(trainer)["adapters"].get("read_only")
    assert mounts(vllm)["models"]["target"] == mounts(trainer)["models"]["target"] == "/models"
    assert mounts(model)["models"]["target"] == "/models" and not mounts(model)["models"].get("read_only")
    # The trainer writes (and publishes) adapters under the shared mount; vLLM serves the fetched model dir.
    assert "output_dir=/adapters/trainer" in trainer["command"]
    served = vllm["command"][vllm["command"].index("--model") + 1]
    assert served == trainer["environment"]["FLYWHEEL_MODEL_DIR"] == model["command"][1]
    assert served == "/models/Qwen/Qwen2.5-1.5B-Instruct" and model["command"][0] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert {"pgdata", "models", "adapters"} <= set(config["volumes"])
    assert mounts(config["services"]["postgres"])["pgdata"]["target"] == "/var/lib/postgresql/data"


def test_secrets_come_only_from_the_env_file(config: dict[str, Any]) -> None:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    for name, service in raw["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if key in SECRET_VARS:
                assert re.fullmatch(r"\$\{" + key + r"(:[?-][^}]*)?\}", str(value)), (name, key, value)
    assert read_env_file(ENV_EXAMPLE).keys() >= set(SECRET_VARS)
    assert all(read_env_file(ENV_EXAMPLE)[k] == "" for k in SECRET_VARS)
    # Each secret reaches exactly the services that need it, and only through their environment.
    holders = {}
    for sentinel in (ADMIN_SENTINEL, PG_SENTINEL):
        holders[sentinel] = sorted(
            name for name, svc in config["services"].items() if sentinel in json.dumps(svc.get("environment", {}))
        )
        outside = {
            name: {k: v for k, v in svc.items() if k != "environment"} for name, svc in config["services"].items()
        }
        assert sentinel not in json.dumps(outside)
    assert holders == {ADMIN_SENTINEL: ["proxy", "trainer", "worker"], PG_SENTINEL: ["migrate", "postgres", "proxy"]}
    ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/.env"], cwd=ROOT)
    assert ignored.returncode == 0, "deploy/.env must be git-ignored"
    assert "**/.env" in (DEPLOY / "Dockerfile.dockerignore").read_text().split()


def engine_of(path: Path) -> dict[str, Any]:
    engine: dict[str, Any] = yaml.safe_load(path.read_text())["engine"]
    return engine


@pytest.mark.parametrize("gpu_config", GPU_CONFIGS, ids=lambda p: p.stem)
def test_vllm_gets_the_launcher_flags_for_each_gpu_config(gpu_config: Path) -> None:
    """Compose with `compose_check env <config>` starts vLLM exactly as deploy/vllm.py would on a GPU."""
    config = render(env_file=ENV_EXAMPLE, env={**SECRETS, **engine_env(gpu_config)})
    vllm = config["services"]["vllm-0"]
    engine = engine_of(gpu_config)
    launcher = VLLMServer(
        model=f"/models/{engine['model']}",
        served_name=engine["served_name"],
        host="0.0.0.0",
        port=8000,
        device="gpu",
        max_lora_rank=engine["max_lora_rank"],
        max_loras=engine["max_loras"],
        max_model_len=engine["max_model_len"],
        chat_template=engine["chat_template"] or None,
        tool_call_parser=engine["tool_call_parser"],
        gpu_memory_utilization=engine["gpu_memory_utilization"],
        python="python3",
    )
    assert vllm["entrypoint"] + vllm["command"] == launcher.command()
    assert vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == launcher.env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    placement = yaml.safe_load(gpu_config.read_text())["compose"]
    for service, key in (("vllm-0", "vllm_gpu"), ("trainer", "trainer_gpu")):
        [device] = config["services"][service]["deploy"]["resources"]["reservations"]["devices"]
        assert (device["driver"], device["device_ids"], device["capabilities"]) == ("nvidia", [placement[key]], ["gpu"])


def test_vllm_own_parser_accepts_the_compose_command() -> None:
    """vLLM 0.32.0 (the engine venv; the compose image is the same release) parses every flag and value."""
    commands = [
        render(env_file=ENV_EXAMPLE, env={**SECRETS, **engine_env(c)})["services"]["vllm-0"]["command"]
        for c in GPU_CONFIGS
    ]
    script = (
        "import json, sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)\n"
        "    validate_parsed_serve_args(args)\n"
        "    out.append([args.model, args.served_model_name, args.enable_lora, args.max_lora_rank, args.max_loras,\n"
        "                args.logprobs_mode, args.enable_auto_tool_choice, args.tool_call_parser,\n"
        "                args.gpu_memory_utilization, args.max_model_len])\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [engine_python(), "-c", script, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "VLLM_NO_USAGE_STATS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    expected = [
        [
            f"/models/{e['model']}",
            ["policy-base"],
            True,
            e["max_lora_rank"],
            e["max_loras"],
            "processed_logprobs",
            True,
            "hermes",
            e["gpu_memory_utilization"],
            e["max_model_len"],
        ]
        for e in map(engine_of, GPU_CONFIGS)
    ]
    assert parsed == expected


def test_compose_defaults_and_env_example_equal_the_default_gpu_config() -> None:
    """A user who only fills in the secrets runs configs/gpu-qwen2.5-1.5b.yaml, consistently everywhere."""
    example = read_env_file(ENV_EXAMPLE)
    derived = engine_env(DEFAULT_CONFIG)
    assert {k: example[k] for k in derived} == derived
    assert render(env=SECRETS) == render(env={**SECRETS, **derived})


@pytest.mark.parametrize("gpu_config", GPU_CONFIGS, ids=lambda p: p.stem)
def test_gpu_config_loads_in_the_proxy_and_trainer_as_compose_runs_them(gpu_config: Path) -> None:
    from proxy.settings import load_settings
    from trainer.config import load_config

    services = render(env_file=ENV_EXAMPLE, env={**SECRETS, **engine_env(gpu_config)})["services"]
    proxy_cmd = services["proxy"]["command"]
    config_arg = ROOT / proxy_cmd[proxy_cmd.index("--config") + 1]
    assert config_arg == gpu_config
    settings = load_settings(config_arg, environ=services["proxy"]["environment"])
    assert [(u.name, u.url, u.seed_rule) for u in settings.upstreams] == [("vllm-0", "http://vllm-0:8000", "pass")]
    assert settings.store.url == f"postgresql+asyncpg://flywheel:{PG_SENTINEL}@postgres:5432/flywheel"
    assert (settings.host, settings.port, settings.public_url) == ("0.0.0.0", 8100, "http://proxy:8100")
    assert settings.auth.admin_key.get_secret_value() == ADMIN_SENTINEL

    trainer_cmd = services["trainer"]["command"]
    assert trainer_cmd[:6] == ["python", "-m", "trainer", "run", "--config", proxy_cmd[proxy_cmd.index("--config") + 1]]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FLYWHEEL_MODEL_DIR", services["trainer"]["environment"]["FLYWHEEL_MODEL_DIR"])
        trainer = load_config(config_arg, trainer_cmd[6:])
    engine = engine_of(gpu_config)
    assert trainer.model == f"/models/{engine['model']}"
    assert (trainer.proxy_url, trainer.output_dir) == ("http://proxy:8100", "/adapters/trainer")
    assert trainer.max_lora_rank == engine["max_lora_rank"] and trainer.lora_r <= engine["max_lora_rank"]
    # Every version the proxy keeps loaded has a LoRA slot on vLLM and an adapter directory on disk.
    assert settings.policy.keep_versions <= engine["max_loras"]
    assert settings.policy.keep_versions <= trainer.keep_adapters
    assert trainer.max_seq_len <= engine["max_model_len"]
    # The agent's requests fit the served context (vLLM refuses prompt + max_tokens beyond it).
    options = dict(
        o.split("=", 1) for o in services["worker"]["environment"]["FLYWHEEL_WORKFLOW_ARGS"].split() if "=" in o
    )
    output = options.get("max_output_tokens", options.get("max_tokens", 0))
    asked = int(options.get("max_input_tokens", 0)) + int(output)
    assert 0 < asked <= engine["max_model_len"], options


def test_scale_override_adds_a_replica_and_proxy_replicas() -> None:
    config = render([COMPOSE_FILE, SCALE_FILE], env_file=ENV_EXAMPLE, env=SECRETS)
    services = config["services"]
    first, second = services["vllm-0"], services["vllm-1"]
    assert second["entrypoint"] + second["command"] == first["entrypoint"] + first["command"]
    assert mounts(second) == mounts(first) and mounts(second)["adapters"]["target"] == "/adapters"
    assert second["environment"] == first["environment"] and second["healthcheck"] == first["healthcheck"]
    gpus = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in (first, second)]
    assert gpus == [["0"], ["1"]]
    proxy = services["proxy"]
    assert proxy["deploy"]["replicas"] == 2
    assert json.loads(proxy["environment"]["FLYWHEEL_UPSTREAMS"]) == [
        {"name": "vllm-0", "url": "http://vllm-0:8000", "seed_rule": "pass"},
        {"name": "vllm-1", "url": "http://vllm-1:8000", "seed_rule": "pass"},
    ]
    assert {d: s["condition"] for d, s in proxy["depends_on"].items()} == {
        "migrate": "service_completed_successfully",
        "vllm-0": "service_healthy",
        "vllm-1": "service_healthy",
    }
    assert [p["published"] for p in proxy["ports"]] == ["8100-8101"]


def test_dockerfile_parses_and_builds_the_targets_compose_uses(config: dict[str, Any]) -> None:
    """BuildKit's own parser reads the Dockerfile; every COPY source exists; the install lists are pyproject's."""
    from deploy.requirements import requirements

    instructions = dockerfile_parser().parse_file(str(DEPLOY / "Dockerfile"))
    stages = [i.value[-1] for i in instructions if i.cmd == "FROM" and len(i.value) == 3 and i.value[1] == "AS"]
    targets = {s["build"]["target"] for s in config["services"].values() if "build" in s}
    assert stages == ["app", "trainer"] and targets == {"app", "trainer"}
    for copy in (i for i in instructions if i.cmd == "COPY"):
        for source in copy.value[:-1]:
            assert list(ROOT.glob(source)), f"COPY {source}: nothing in the repository matches"
    runs = " ".join(i.value[0] for i in instructions if i.cmd == "RUN")
    assert "deploy/requirements.py postgres agents >" in runs
    assert "deploy/requirements.py postgres agents train >" in runs
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    from deploy.bootstrap import pins as lock_pins

    pins = lock_pins(DEPLOY / "locks" / "agents.txt")
    assert "deploy/locks/agents.txt" in runs
    for line in requirements(["postgres", "agents", "train"]):
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, f"{name} is not pinned in deploy/locks/agents.txt (make lock)"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} violates {req}"
