"""Bad replica lists: an empty one, a name that does not resolve, every replica down, cache-managers that
do not pair up. Each is a clear error (503 in the API's own error JSON, or a refusal to start), never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest

from moe_l2_ops.supervisor import free_port
from tests.proxy.support import GatewayProc

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def both_apis(gw: GatewayProc) -> tuple[httpx.Response, httpx.Response]:
    with httpx.Client(base_url=gw.url, timeout=30) as client:  # a hang fails the test
        openai = client.post("/v1/chat/completions", json=CHAT)
        ollama = client.post("/api/chat", json={"model": "m", "messages": CHAT["messages"], "stream": False})
    return openai, ollama


def test_an_empty_replica_list_answers_503_in_each_apis_json(start_gateway: Callable[..., GatewayProc]) -> None:
    gw = start_gateway("", MOE_L2_LLAMA_URLS="")
    openai, ollama = both_apis(gw)
    assert openai.status_code == ollama.status_code == 503
    assert "MOE_L2_LLAMA_URLS" in openai.json()["error"]["message"]
    assert openai.json()["error"]["code"] == "no_replicas"
    assert "MOE_L2_LLAMA_URLS" in ollama.json()["error"]
    ready = gw.client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["reason"] == "no llama replica is configured"


def test_a_name_that_does_not_resolve_answers_503(start_gateway: Callable[..., GatewayProc]) -> None:
    gw = start_gateway("", MOE_L2_LLAMA_URLS="http://no-such-replica.invalid:11436")
    openai, ollama = both_apis(gw)
    assert openai.status_code == ollama.status_code == 503
    assert "unavailable" in openai.json()["error"]["message"]
    assert gw.client.get("/readyz").status_code == 503


def test_every_replica_down_answers_503_naming_them_all(start_gateway: Callable[..., GatewayProc]) -> None:
    down = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    gw = start_gateway("", MOE_L2_LLAMA_URLS=",".join(down), MOE_L2_PROXY_LLAMA_COOLDOWN_S="30")
    for _ in range(2):  # the second time every replica rests: still tried, still a clear answer
        openai, ollama = both_apis(gw)
        assert openai.status_code == ollama.status_code == 503
        assert openai.json()["error"]["message"].startswith("all 3 llama replicas failed")
    stats = gw.client.get("/moe/stats").json()
    assert [r["healthy"] for r in stats["replicas"]] == [False] * 3
    assert gw.client.get("/readyz").json()["replicas"][0]["ready"] is False


@pytest.mark.parametrize("cache_urls", ["http://a:1,http://b:2", "http://a:1,http://b:2,http://c:3,http://d:4"])
def test_cache_managers_that_do_not_pair_with_the_replicas_refuse_to_start(cache_urls: str) -> None:
    env = {
        **os.environ,
        "MOE_L2_PROXY_PORT": str(free_port()),
        "MOE_L2_LLAMA_URLS": "http://127.0.0.1:1,http://127.0.0.1:2,http://127.0.0.1:3",
        "MOE_L2_CACHE_URLS": cache_urls,
    }
    done = subprocess.run([sys.executable, "-m", "moe_l2_proxy"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "MOE_L2_CACHE_URLS lists" in done.stderr and "one per entry" in done.stderr
    assert "Traceback" not in done.stderr
