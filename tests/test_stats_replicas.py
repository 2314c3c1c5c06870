"""`moe-l2 stats` over several llama replicas (issue 16): a section per replica from the gateway's
moe_l2_replica_* series and each llama's own hot-set counters; the one-replica screen unchanged."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from moe_l2_ops import stats
from moe_l2_ops.stats import OpsSettings, parse_metrics, render, scrape, scrape_replicas, summarize

R1, R2, R3 = "127.0.0.1:11436", "127.0.0.1:11536", "127.0.0.1:11636"


def gateway_metrics(
    requests: dict[str, dict[str, int]],
    in_flight: dict[str, int],
    healthy: dict[str, int],
    failures: dict[str, int] | None = None,
) -> str:
    """The gateway's /metrics with the scale-out spec's per-replica series (and its request counter)."""
    registry = CollectorRegistry()
    routed = Counter("moe_l2_replica_requests", "routed", ["replica", "domain"], registry=registry)
    flight = Gauge("moe_l2_replica_in_flight", "in flight", ["replica"], registry=registry)
    up = Gauge("moe_l2_replica_healthy", "in rotation", ["replica"], registry=registry)
    failed = Counter("moe_l2_replica_failures", "failures", ["replica", "reason"], registry=registry)
    total = Counter("moe_l2_requests", "requests", ["route", "status"], registry=registry)
    for replica, domains in requests.items():
        for domain, n in domains.items():
            routed.labels(replica=replica, domain=domain).inc(n)
            total.labels(route="/v1/chat/completions", status="200").inc(n)
    for replica, n in in_flight.items():
        flight.labels(replica=replica).set(n)
    for replica, ok in healthy.items():
        up.labels(replica=replica).set(ok)
    for replica, n in (failures or {}).items():
        failed.labels(replica=replica, reason="connect").inc(n)
    return generate_latest(registry).decode()


def llama_metrics(hits: dict[str, int], misses: dict[str, int], predicted: int = 0) -> str:
    lines = ["# TYPE llamacpp:moe_hot_hits_total counter", "# TYPE llamacpp:moe_hot_misses_total counter"]
    lines += [f'llamacpp:moe_hot_hits_total{{domain="{d}"}} {n}' for d, n in hits.items()]
    lines += [f'llamacpp:moe_hot_misses_total{{domain="{d}"}} {n}' for d, n in misses.items()]
    lines += ["# TYPE llamacpp:tokens_predicted_total counter", f"llamacpp:tokens_predicted_total {predicted}"]
    return "\n".join(lines) + "\n"


GATEWAY = gateway_metrics(
    requests={
        R1: {"math": 60, "code": 30, "legal": 6, "medical": 4},
        R2: {"chat": 10, "translation": 30},
    },
    in_flight={R1: 3, R2: 1},
    healthy={R1: 1, R2: 0},
    failures={R2: 2},
)
LLAMA_1 = llama_metrics({"math": 700, "code": 200}, {"math": 50, "code": 50}, predicted=400)  # 900 / 1000
LLAMA_2 = llama_metrics({"chat": 150}, {"chat": 50, "translation": 100}, predicted=100)  # 150 / 300


@pytest.fixture
def no_replica_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (
        *("MOE_L2_LLAMA_URLS", "MOE_L2_CACHE_URLS", "MOE_L2_LLAMA_URL", "MOE_L2_CACHE_URL"),
        *("MOE_L2_LLAMA_PORT", "MOE_L2_CACHE_PORT", "MOE_L2_LLAMA_REPLICAS"),
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MOE_L2_STATE_DIR", str(tmp_path / "state"))  # no `moe-l2 up` running


def serving(pages: dict[str, str]) -> Callable[..., httpx.Client]:
    """An httpx.Client factory answering GET <url>/metrics from `pages` (base URL -> text), 503 else."""

    def handler(request: httpx.Request) -> httpx.Response:
        base = str(request.url).removesuffix("/metrics")
        if base in pages:
            return httpx.Response(200, text=pages[base])
        raise httpx.ConnectError("connection refused", request=request)

    real = httpx.Client

    def factory(**kwargs: Any) -> httpx.Client:
        return real(transport=httpx.MockTransport(handler), **kwargs)

    return factory


def test_two_configured_replicas_each_get_a_line(no_replica_env: None) -> None:
    settings = OpsSettings(llama_urls=f"http://{R1}, http://{R2}/")
    assert settings.llama_replica_urls() == [f"http://{R1}", f"http://{R2}"]
    assert [n for n in settings.services() if n.startswith("llama")] == ["llama-1", "llama-2"]
    scraped = {"proxy": parse_metrics(GATEWAY), "llama-1": parse_metrics(LLAMA_1), "llama-2": parse_metrics(LLAMA_2)}
    summary = summarize(scraped, scrape_replicas(settings, scraped))
    one, two = summary["replicas"]
    assert one == {
        "replica": R1,
        "reported_by_gateway": True,
        "in_rotation": True,
        "in_flight": 3.0,
        "requests": 100.0,
        "failures": 0.0,
        "domains": {"math": 60.0, "code": 30.0, "legal": 6.0, "medical": 4.0},
        "top_domains": [["math", 0.6], ["code", 0.3], ["legal", 0.06]],
        "reachable": True,
        "hot_hits": 900.0,
        "hot_misses": 100.0,
        "hit_rate": 0.9,
    }
    assert (two["in_rotation"], two["in_flight"], two["requests"], two["failures"]) == (False, 1.0, 40.0, 2.0)
    assert two["top_domains"] == [["translation", 0.75], ["chat", 0.25]]
    assert two["hit_rate"] == 0.5
    # the screen's totals add both llamas up: 1050 hits of 1300
    assert summary["experts"]["hit_rate"] == 0.8077
    assert summary["tokens"]["llama_predicted_total"] == 500.0

    summary["problems"] = {}
    text = render(summary).splitlines()
    start = text.index("replicas    2 llama replicas")
    assert text[start + 1] == (
        f"  {R1}  in rotation, in flight 3, requests 100 (math 60%, code 30%, legal 6%), hot-set hit rate 90.0%"
    )
    assert text[start + 2] == (
        f"  {R2}  OUT (cooling down), in flight 1, requests 40 (translation 75%, chat 25%), "
        "hot-set hit rate 50.0%, failures 2"
    )


def test_one_replica_keeps_the_screen_as_it_was(no_replica_env: None) -> None:
    settings = OpsSettings()
    assert [n for n in settings.services() if n.startswith("llama")] == ["llama"]
    one_gateway = gateway_metrics({R1: {"math": 5}}, {R1: 0}, {R1: 1})
    for proxy in (None, parse_metrics(one_gateway)):
        scraped = {"proxy": proxy, "llama": parse_metrics(LLAMA_1)}
        summary = summarize(scraped, scrape_replicas(settings, scraped))
        assert summary["replicas"] == []
        summary["problems"] = {}
        assert not any(line.startswith("replicas") for line in render(summary).splitlines())
    assert summarize({"llama": parse_metrics(LLAMA_1)})["experts"]["hit_rate"] == 0.9  # callers of before


def test_replicas_only_the_gateway_reports_are_scraped_where_it_dials(
    no_replica_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`moe-l2 stats` after `moe-l2 up --llama-replicas 3` in a shell without MOE_L2_LLAMA_URLS: it knows
    one llama, the gateway three; the third does not answer."""
    gateway = gateway_metrics(
        {R1: {"math": 2}, R2: {"code": 1}, R3: {"chat": 1}}, {R1: 0, R2: 0, R3: 0}, {R1: 1, R2: 1, R3: 1}
    )
    monkeypatch.setattr(
        stats.httpx,
        "Client",
        serving({"http://127.0.0.1:11435": gateway, f"http://{R1}": LLAMA_1, f"http://{R2}": LLAMA_2}),
    )
    settings = OpsSettings(proxy_url="http://127.0.0.1:11435", llama_url=f"http://{R1}")
    problems: dict[str, str] = {}
    scraped = scrape(settings, problems)
    replicas = scrape_replicas(settings, scraped, problems)
    assert list(replicas) == [R1, R2, R3] and replicas[R3] is None
    assert "ConnectError" in problems[f"llama {R3}"]
    rows = summarize(scraped, replicas)["replicas"]
    assert [(r["replica"], r["requests"], r["hit_rate"], r["reachable"]) for r in rows] == [
        (R1, 2.0, 0.9, True),
        (R2, 1.0, 0.5, True),
        (R3, 1.0, None, False),
    ]
    assert "(its /metrics did not answer)" in render_rows(rows)[-1]


def render_rows(rows: list[dict[str, Any]]) -> list[str]:
    return stats.render_replicas(rows)


def test_a_configured_replica_the_gateway_does_not_report(no_replica_env: None) -> None:
    settings = OpsSettings(llama_urls=f"http://{R1},http://{R2}")
    scraped = {"proxy": None, "llama-1": parse_metrics(LLAMA_1), "llama-2": None}
    rows = summarize(scraped, scrape_replicas(settings, scraped))["replicas"]
    assert [(r["replica"], r["in_rotation"], r["requests"], r["hit_rate"]) for r in rows] == [
        (R1, None, None, 0.9),
        (R2, None, None, None),
    ]
    lines = render_rows(rows)
    assert lines[1] == f"  {R1}  not reported by the gateway, in flight -, requests - (-), hot-set hit rate 90.0%"


def test_cache_manager_replicas_and_templates(no_replica_env: None) -> None:
    settings = OpsSettings(cache_urls="http://127.0.0.1:11438,http://127.0.0.1:11538")
    assert [n for n in settings.services() if n.startswith("cache")] == ["cache-manager-1", "cache-manager-2"]
    # `{host}` entries are for the gateway to fill in: stats falls back on the one MOE_L2_CACHE_URL
    settings = OpsSettings(cache_urls="http://{host}:11438", cache_url="http://127.0.0.1:11438")
    assert [n for n in settings.services() if n.startswith("cache")] == ["cache-manager"]


def test_json_output_has_the_replicas(
    no_replica_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MOE_L2_PROXY_URL", "http://gw:1")
    monkeypatch.setenv("MOE_L2_LLAMA_URLS", f"http://{R1},http://{R2}")
    monkeypatch.setattr(
        stats.httpx, "Client", serving({"http://gw:1": GATEWAY, f"http://{R1}": LLAMA_1, f"http://{R2}": LLAMA_2})
    )
    assert stats.main(["--json", "--sample", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["services"]["llama-1"] and doc["services"]["llama-2"]
    assert [(r["replica"], r["in_flight"], r["requests"], r["hit_rate"]) for r in doc["replicas"]] == [
        (R1, 3.0, 100.0, 0.9),
        (R2, 1.0, 40.0, 0.5),
    ]
    assert doc["replicas"][0]["top_domains"] == [["math", 0.6], ["code", 0.3], ["legal", 0.06]]
    assert doc["experts"]["hit_rate"] == 0.8077


def test_the_replicas_moe_l2_up_starts_for_moe_l2_llama_replicas(
    no_replica_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOE_L2_LLAMA_REPLICAS", "2")
    monkeypatch.setenv("MOE_L2_LLAMA_PORT", "20000")
    monkeypatch.setenv("MOE_L2_CACHE_PORT", "21000")
    services = OpsSettings().services()
    assert (services["llama-1"], services["llama-2"]) == ("http://127.0.0.1:20000", "http://127.0.0.1:20100")
    assert services["cache-manager-2"] == "http://127.0.0.1:21100"
    # a URL given wins: that one service
    monkeypatch.setenv("MOE_L2_LLAMA_URL", "http://llama:8080")
    assert OpsSettings().llama_replica_urls() == ["http://llama:8080"]
    monkeypatch.setenv("MOE_L2_LLAMA_REPLICAS", "lots")  # `moe-l2 up` refuses it; stats shows the one port
    assert OpsSettings().cache_replica_urls() == ["http://127.0.0.1:21000"]
