"""Each launcher refuses a gateway reachable beyond loopback without API keys, in one line, and
MOE_L2_ALLOW_OPEN=1 is the way out: compose (MOE_L2_BIND, the published port's address, handed to the
gateway as MOE_L2_PROXY_EXPOSED_HOST), the Kubernetes base (the gateway listens on 0.0.0.0 behind a
Service any pod reaches, its keys from the Secret), `moe-l2 up` (MOE_L2_PROXY_HOST, or MOE_L2_BIND).
The gateway itself decides (moe_l2_proxy.settings): these run it as each launcher configures it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from moe_l2_ops.supervisor import free_port
from tests.compose.loading import COMPOSE, interpolate, load_compose_text
from tests.compose.shapes import as_dict
from tests.kubernetes.rendering import containers, render

REFUSAL = (
    "moe_l2_proxy: invalid settings: the gateway would be reachable on 0.0.0.0 ({how}) without API keys: "
    "set MOE_L2_PROXY_API_KEYS (comma-separated keys), or MOE_L2_ALLOW_OPEN=1 to serve it open"
)


def _clean_env(**env: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MOE_L2_")}, **env}


def _gateway(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moe_l2_proxy"], env=env, capture_output=True, text=True, timeout=60)


def _serves(env: dict[str, str], tmp_path: Path) -> str:
    """Starts the gateway with `env` (its port moved to a free one), waits for /healthz, stops it; its log."""
    port = free_port()
    log = tmp_path / f"gateway-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moe_l2_proxy"],
            env={**env, "MOE_L2_PROXY_PORT": str(port)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise AssertionError(f"the gateway did not answer: {log.read_text()}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return log.read_text()


def test_compose_published_beyond_loopback_without_keys_refuses(tmp_path: Path) -> None:
    raw = load_compose_text(COMPOSE.read_text())

    def proxy_env(**user: str) -> dict[str, str]:
        return _clean_env(**as_dict(interpolate(raw, user)["services"]["proxy"]["environment"]))

    # the default: listening on 0.0.0.0 in its container, published on the host's loopback only
    assert "MOE_L2_ALLOW_OPEN" not in _serves(proxy_env(), tmp_path)
    done = _gateway(proxy_env(MOE_L2_BIND="0.0.0.0"))
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [REFUSAL.format(how="published")]
    assert "Traceback" not in done.stderr
    _serves(proxy_env(MOE_L2_BIND="0.0.0.0", MOE_L2_PROXY_API_KEYS="k1"), tmp_path)
    log = _serves(proxy_env(MOE_L2_BIND="0.0.0.0", MOE_L2_ALLOW_OPEN="1"), tmp_path)
    assert "MOE_L2_ALLOW_OPEN=1: the gateway would be reachable on 0.0.0.0 (published)" in log


def test_kubernetes_without_keys_refuses(tmp_path: Path) -> None:
    container, _ = containers(render("base"))["proxy"]
    [keys] = [e for e in container["env"] if e["name"] == "MOE_L2_PROXY_API_KEYS"]
    assert keys["valueFrom"]["secretKeyRef"]["key"] == "api-keys", "the keys come from the Secret"

    def proxy_env(api_keys: str, **patched: str) -> dict[str, str]:
        plain = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        return _clean_env(**{**plain, "MOE_L2_PROXY_API_KEYS": api_keys, **patched})

    done = _gateway(proxy_env(""))  # the Secret's api-keys left empty
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [REFUSAL.format(how="listening")]
    _serves(proxy_env("k1,k2"), tmp_path)
    log = _serves(proxy_env("", MOE_L2_ALLOW_OPEN="1"), tmp_path)  # a patch of the base
    assert "MOE_L2_ALLOW_OPEN=1: the gateway would be reachable on 0.0.0.0 (listening)" in log


def test_moe_l2_up_refuses_the_ram_tier_with_llama_replicas_before_building_anything(tmp_path: Path) -> None:
    """MOE_L2_RAM_BUDGET with --llama-replicas 2: the cache-manager's own line, before any build or start."""
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, "-m", "moe_l2_ops.cli", "up", "--llama-replicas", "2"],
        env=_clean_env(MOE_L2_STATE_DIR=str(state), MOE_L2_RAM_BUDGET="6GiB"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: moe_l2_cache: MOE_L2_RAM_BUDGET with 2 llama replicas: replicas on one host share the model "
        "file's page cache, which one RAM tier must manage alone (two page out each other's experts): run one "
        "llama replica with the tier (MOE_L2_LLAMA_REPLICAS=1), or one per host (docs/ram-tier.md)"
    )
    assert not (state / "models").exists() and not (state / "admin-token").exists(), "it got as far as the model"


@pytest.mark.parametrize("env", [{"MOE_L2_PROXY_HOST": "0.0.0.0"}, {"MOE_L2_BIND": "0.0.0.0"}], ids=["host", "bind"])
def test_moe_l2_up_refuses_before_building_or_starting_anything(env: dict[str, str], tmp_path: Path) -> None:
    state = tmp_path / "state"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "moe_l2_ops.cli", "up"],
        env=_clean_env(MOE_L2_STATE_DIR=str(state), **env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "error: " + REFUSAL.format(how="listening")
    assert not (state / "models").exists() and not (state / "admin-token").exists(), "it got as far as the model"
    assert time.monotonic() - started < 60, "no llama build before the refusal"
