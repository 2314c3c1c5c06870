"""Three predictor processes behind the gateway's multi-URL setting; one is killed mid-run.

Every chat must still succeed, answered with a predictor's domain, and the requests must spread
over the live replicas: read from each predictor's own /metrics. Needs the gateway package.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from moe_l2_ops.supervisor import RunningService, ServiceSpec, Supervisor, free_port, http_ok
from tests.metrics import sample_sum
from tests.predictor.conftest import HELDOUT

pytestmark = [pytest.mark.slow, pytest.mark.llama]

REPLICAS = 3
CHATS = 36
KILL_AFTER = 12


def served(text: str) -> float:
    """Successful /v1/predict requests in one predictor's Prometheus exposition."""
    return sample_sum(text, "moe_l2_predictor_requests_total", endpoint="/v1/predict", status="200")


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path / "logs")
    yield sup
    sup.stop()


def start_predictor(supervisor: Supervisor, name: str, cache: Path) -> tuple[str, RunningService]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    running = supervisor.start(
        ServiceSpec(
            name=name,
            argv=[sys.executable, "-m", "moe_l2_predictor"],
            # keyword + TF-IDF: three real replicas that start in seconds on a small machine
            env={
                "MOE_L2_PREDICTOR_PORT": str(port),
                "MOE_L2_PREDICTOR_CACHE_DIR": str(cache),
                "MOE_L2_PREDICTOR_TIERS": "keyword,tfidf",
            },
            health=http_ok(f"{url}/healthz"),
            url=url,
            start_timeout_s=300,
        )
    )
    return url, running


def test_a_replica_dies_mid_run(llama, supervisor: Supervisor, predictor_cache: Path) -> None:
    replicas = [start_predictor(supervisor, f"predictor-{i}", predictor_cache) for i in range(REPLICAS)]
    urls = [url for url, _ in replicas]
    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    supervisor.start(
        ServiceSpec(
            name="gateway",
            argv=[sys.executable, "-m", "moe_l2_proxy"],
            env={
                "MOE_L2_PROXY_PORT": str(port),
                "MOE_L2_LLAMA_URL": llama.url,
                "MOE_L2_PREDICTOR_URLS": ",".join(urls),
                "MOE_L2_CACHE_URL": "",
                # generous on a shared 2-core machine: this test is about failover, not speed
                "MOE_L2_PROXY_PREDICT_BUDGET_MS": "5000",
                "MOE_L2_PROXY_PREDICTOR_COOLDOWN_S": "60",
            },
            health=http_ok(f"{gateway}/healthz"),
            url=gateway,
            start_timeout_s=120,
        )
    )
    prompts = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    prompts = [p["text"] for p in prompts if "text" in p][:CHATS]
    victim_url, victim = replicas[1]

    with httpx.Client(base_url=gateway, timeout=300) as client:

        def chat(text: str) -> httpx.Response:
            body = {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
            return client.post("/v1/chat/completions", json=body)

        with ThreadPoolExecutor(max_workers=3) as pool:
            before = list(pool.map(chat, prompts[:KILL_AFTER]))
        at_kill = {url: served(httpx.get(f"{url}/metrics", timeout=60).text) for url in urls}
        victim.proc.kill()
        victim.proc.wait(timeout=10)
        with ThreadPoolExecutor(max_workers=3) as pool:
            after = list(pool.map(chat, prompts[KILL_AFTER:]))

        for resp in before + after:
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"], resp.text
            assert resp.headers["x-moe-domain"]
        # the domain still came from a predictor (a live one), never from the gateway's fallback
        assert {r.headers["x-moe-domain-source"] for r in after} == {"predictor"}

    survivors = [url for url in urls if url != victim_url]
    at_end = {url: served(httpx.get(f"{url}/metrics", timeout=60).text) for url in survivors}
    assert all(count > 0 for count in at_kill.values()), at_kill  # spread before the kill
    for url in survivors:
        assert at_end[url] > at_kill[url], (url, at_kill, at_end)  # and over the live ones after it
    assert sum(at_end.values()) - sum(at_kill[u] for u in survivors) >= CHATS - KILL_AFTER
