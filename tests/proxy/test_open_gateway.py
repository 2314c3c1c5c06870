"""A gateway reachable beyond loopback without API keys refuses to start, with one line; MOE_L2_ALLOW_OPEN=1
serves it open and says so in its log. What counts is where clients reach it: MOE_L2_PROXY_EXPOSED_HOST
(compose's MOE_L2_BIND: the published port's host address) when set, else MOE_L2_PROXY_HOST."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from moe_l2_ops.supervisor import free_port
from moe_l2_proxy.settings import ProxySettings, is_loopback
from tests.proxy.support import GatewayProc

REFUSAL = "without API keys: set MOE_L2_PROXY_API_KEYS"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost", " localhost "])
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "10.0.0.1", "gateway.example.com", ""])
def test_addresses_beyond_loopback(host: str) -> None:
    assert not is_loopback(host)


@pytest.mark.parametrize(
    ("settings", "open_on"),
    [
        ({}, ""),
        ({"host": "0.0.0.0"}, "0.0.0.0 (listening)"),
        ({"host": "192.168.1.10"}, "192.168.1.10 (listening)"),
        # in a container: listening everywhere, published on the host's loopback only (compose's default)
        ({"host": "0.0.0.0", "exposed_host": "127.0.0.1"}, ""),
        # published on every interface of the host, whatever the container listens on
        ({"host": "0.0.0.0", "exposed_host": "0.0.0.0"}, "0.0.0.0 (published)"),
        ({"exposed_host": "0.0.0.0"}, "0.0.0.0 (published)"),
    ],
)
def test_which_gateways_are_open(settings: dict[str, str], open_on: str) -> None:
    if open_on:
        with pytest.raises(ValueError, match=f"reachable on {open_on.replace('(', '.').replace(')', '.')} {REFUSAL}"):
            ProxySettings(**settings)
        assert ProxySettings(**settings, allow_open=True).open_exposure().endswith(open_on)
    else:
        assert ProxySettings(**settings).open_exposure() == ""
    # with a key it is never open
    assert ProxySettings(**settings, api_keys="k1,k2").open_exposure() == ""


def test_blank_keys_are_no_keys() -> None:
    with pytest.raises(ValueError, match=REFUSAL):
        ProxySettings(host="0.0.0.0", api_keys=" , ")


def _gateway_env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MOE_L2_")}
    return {**base, "MOE_L2_PROXY_PORT": str(free_port()), "MOE_L2_PREDICTOR_URLS": "", "MOE_L2_CACHE_URL": "", **env}


@pytest.mark.parametrize(
    "env",
    [{"MOE_L2_PROXY_HOST": "0.0.0.0"}, {"MOE_L2_PROXY_EXPOSED_HOST": "0.0.0.0"}],
    ids=["listening", "published"],
)
def test_the_gateway_refuses_to_start_open_with_one_line(env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "moe_l2_proxy"], env=_gateway_env(**env), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("moe_l2_proxy: invalid settings: the gateway would be reachable on 0.0.0.0")
    assert REFUSAL in lines[0] and "MOE_L2_ALLOW_OPEN=1" in lines[0]


def test_allow_open_serves_and_is_logged(start_gateway: Callable[..., GatewayProc]) -> None:
    gw = start_gateway("http://127.0.0.1:1", MOE_L2_PROXY_HOST="0.0.0.0", MOE_L2_ALLOW_OPEN="1")
    assert gw.client.get("/healthz").status_code == 200
    assert gw.client.get("/v1/models").status_code != 401, "an open gateway asks for no key"
    log = gw.log_text()
    assert "WARNING moe_l2_proxy: MOE_L2_ALLOW_OPEN=1: the gateway would be reachable on 0.0.0.0" in log


def test_a_key_makes_an_exposed_gateway_start_and_ask_for_it(start_gateway: Callable[..., GatewayProc]) -> None:
    gw = start_gateway("http://127.0.0.1:1", MOE_L2_PROXY_HOST="0.0.0.0", MOE_L2_PROXY_API_KEYS="s3cret")
    assert gw.client.get("/v1/models").status_code == 401
    assert gw.client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code != 401
    assert "MOE_L2_ALLOW_OPEN" not in gw.log_text()
