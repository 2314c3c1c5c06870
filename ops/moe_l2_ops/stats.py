"""`moe-l2 stats [--json] [--watch]`: one screen of figures read from the running services' /metrics.

Requests, domain mix, expert hot-set hit rate, pool residency against its budget, the active domain
and hot-set sizes, the expert cache's hit rate and host→device bytes per token, tokens/s. Every
figure comes from the same Prometheus series the dashboard shows, so the terminal and Grafana never
disagree. Under `moe-l2 up`, the restarts of each service come from the supervisor's state file
(moe_l2_ops.supervisor).

Several llama replicas (MOE_L2_LLAMA_URLS, `moe-l2 up --llama-replicas N`, or more than one reported
by the gateway's moe_l2_replica_* series): the screen's totals add up every replica, and a section per
replica shows whether the gateway has it in rotation, its requests in flight and in all, its top
domains and the hot-set hit rate from that llama's own counters. A replica the gateway reports but
this side was not told about is scraped at the `host:port` the gateway dials.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from moe_l2_contracts.services import CACHE_MANAGER, LLAMA, PREDICTOR, PROXY

Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> [(labels, value)]
# The gateway's own probes and figures are not traffic.
OPS_ROUTES = frozenset({"/metrics", "/healthz", "/readyz", "/moe/stats"})


class OpsSettings(BaseSettings):
    """Where the running services are: the URLs compose.yaml sets, else the ports `moe-l2 up` uses."""

    model_config = SettingsConfigDict(env_prefix="MOE_L2_", extra="ignore")

    proxy_url: str = Field(default_factory=lambda: PROXY.local_url())
    llama_url: str = Field(default_factory=lambda: LLAMA.local_url())
    llama_urls: str = Field(default="", description="every llama replica, comma-separated; else llama_url")
    predictor_urls: str = Field(default_factory=lambda: PREDICTOR.local_url())
    cache_url: str = Field(default_factory=lambda: CACHE_MANAGER.local_url())
    cache_urls: str = Field(default="", description="the cache-manager of each llama replica; else cache_url")
    redis_url: str = Field(
        default_factory=lambda: (
            f"redis://{os.environ.get('MOE_L2_REDIS_HOST', '127.0.0.1')}:{os.environ.get('MOE_L2_REDIS_PORT', 6379)}/0"
        )
    )
    ops_timeout_s: float = Field(default=3.0, gt=0)

    def llama_replica_urls(self) -> list[str]:
        """MOE_L2_LLAMA_URLS, else the one MOE_L2_LLAMA_URL, else the replicas `moe-l2 up` starts for
        MOE_L2_LLAMA_REPLICAS."""
        return _url_list(self.llama_urls) or self._local_replicas("llama_url")

    def cache_replica_urls(self) -> list[str]:
        """MOE_L2_CACHE_URLS, else the one MOE_L2_CACHE_URL (also when the list holds `{host}` templates,
        which only the gateway can fill in), else the cache-managers of MOE_L2_LLAMA_REPLICAS replicas."""
        urls = _url_list(self.cache_urls)
        return urls if urls and not any("{host}" in u for u in urls) else self._local_replicas("cache_url")

    def _local_replicas(self, field: str) -> list[str]:
        url = str(getattr(self, field)).rstrip("/")
        port = urlsplit(url).port
        if field in self.model_fields_set or port is None:
            return [url]  # a URL given: that one
        from moe_l2_ops.llama_replicas import PORT_STEP, default_replica_count

        try:
            count = default_replica_count()
        except ValueError:
            count = 1  # `moe-l2 up` refuses it; show what answers at the one port
        return [f"http://127.0.0.1:{port + PORT_STEP * i}" for i in range(count)]

    def services(self) -> dict[str, str]:
        """name -> base URL of every HTTP service (one entry per llama, cache-manager, predictor replica)."""
        out = {"proxy": self.proxy_url}
        for service, urls in (
            ("llama", self.llama_replica_urls()),
            ("cache-manager", self.cache_replica_urls()),
            ("predictor", _url_list(self.predictor_urls)),
        ):
            for i, url in enumerate(urls):
                out[service if len(urls) == 1 else f"{service}-{i + 1}"] = url
        return {name: url.rstrip("/") for name, url in out.items()}


def _url_list(urls: str) -> list[str]:
    return [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]


def replica_key(url: str) -> str:
    """The `host:port` of a llama URL: what the gateway's `replica` label says of it."""
    return urlsplit(url).netloc.lower() or url


def parse_metrics(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return samples


def scrape(settings: OpsSettings, problems: dict[str, str] | None = None) -> dict[str, Samples | None]:
    """/metrics of every service; None for a service that did not answer (why, in `problems`)."""
    with httpx.Client(timeout=settings.ops_timeout_s) as client:
        return {name: _scrape_one(client, name, url, problems) for name, url in settings.services().items()}


def _scrape_one(client: httpx.Client, name: str, url: str, problems: dict[str, str] | None) -> Samples | None:
    try:
        resp = client.get(f"{url}/metrics")
        if resp.status_code == 200:
            return parse_metrics(resp.text)
        if problems is not None:
            problems[name] = f"/metrics answered {resp.status_code}"
    except (httpx.HTTPError, ValueError) as exc:
        if problems is not None:
            problems[name] = f"{type(exc).__name__}: {exc}"[:300]
    return None


REPLICA_SERIES = ("moe_l2_replica_healthy", "moe_l2_replica_in_flight", "moe_l2_replica_requests_total")


def gateway_replicas(proxy: Samples | None) -> list[str]:
    """The llama replicas (`host:port`) the gateway's moe_l2_replica_* series name, in first-seen order."""
    seen: dict[str, None] = {}
    for series in REPLICA_SERIES:
        for labels, _ in (proxy or {}).get(series, []):
            if labels.get("replica"):
                seen.setdefault(labels["replica"], None)
    return list(seen)


def scrape_replicas(
    settings: OpsSettings, scraped: dict[str, Samples | None], problems: dict[str, str] | None = None
) -> dict[str, Samples | None]:
    """`host:port` -> /metrics of every llama replica: the configured ones (already in `scraped`), then
    those only the gateway reports, scraped here at the address it dials."""
    urls = settings.llama_replica_urls()
    names = ["llama"] if len(urls) == 1 else [f"llama-{i + 1}" for i in range(len(urls))]
    out = {replica_key(url): scraped.get(name) for name, url in zip(names, urls, strict=True)}
    extra = [r for r in gateway_replicas(scraped.get("proxy")) if r not in out]
    if extra:
        with httpx.Client(timeout=settings.ops_timeout_s) as client:
            for replica in extra:
                out[replica] = _scrape_one(client, f"llama {replica}", f"http://{replica}", problems)
    return out


def _total(samples: Samples | None, name: str) -> float | None:
    if samples is None or name not in samples:
        return None
    return sum(value for _, value in samples[name])


def _by(samples: Samples | None, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in (samples or {}).get(name, []):
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def _max(samples: Samples | None, name: str) -> float | None:
    if samples is None or name not in samples:
        return None
    return max(value for _, value in samples[name])


def _ratio(part: float | None, whole: float | None) -> float | None:
    return round(part / whole, 4) if part is not None and whole else None


def _merged(scraped: dict[str, Samples | None], prefix: str) -> Samples | None:
    """The samples of every replica of a service, together (counters add up)."""
    parts = [s for name, s in scraped.items() if name == prefix or name.startswith(prefix + "-")]
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    merged: Samples = {}
    for part in parts:
        for name, values in part.items():
            merged.setdefault(name, []).extend(values)
    return merged


def summarize(scraped: dict[str, Samples | None], llamas: dict[str, Samples | None] | None = None) -> dict[str, Any]:
    """The figures of one screen, from one scrape of every service; `llamas`: every llama replica's
    samples by `host:port` (scrape_replicas), for the per-replica section. Totals add up the replicas."""
    # every llama and cache-manager replica together: counters add up, so do the pools' bytes
    proxy, llama, cache = scraped.get("proxy"), _merged(scraped, "llama"), _merged(scraped, "cache-manager")
    predictor = _merged(scraped, "predictor")
    traffic = [
        (labels, v)
        for labels, v in (proxy or {}).get("moe_l2_requests_total", [])
        if labels.get("route") not in OPS_ROUTES
    ]
    by_status = _by({"r": traffic}, "r", "status")
    domains = _by(proxy, "moe_l2_domain_total", "domain")
    domain_total = sum(domains.values())
    hits = _by(llama, "llamacpp:moe_hot_hits_total", "domain")
    misses = _by(llama, "llamacpp:moe_hot_misses_total", "domain")
    all_hits, all_misses = sum(hits.values()), sum(misses.values())
    budget = _total(cache, "moe_l2_cache_pool_budget_bytes")
    pinned = _total(cache, "moe_l2_cache_pool_pinned_bytes")
    resident = _total(cache, "moe_l2_cache_pool_resident_bytes")
    active = [labels.get("domain", "") for labels, v in (cache or {}).get("moe_l2_cache_active_domain", []) if v]
    configured = sum(1 for name in scraped if re.fullmatch(r"llama(-\d+)?", name))
    return {
        "services": {name: samples is not None for name, samples in scraped.items()},
        "replicas": replica_summary(proxy, llamas or {}, configured),
        "requests": {
            "total": sum(by_status.values()),  # API traffic: the ops routes (OPS_ROUTES) left out
            "errors": sum(v for status, v in by_status.items() if status[:1] in ("4", "5")),
            "by_status": by_status,
            "by_route": _by({"r": traffic}, "r", "route"),
            "in_flight": _total(proxy, "moe_l2_requests_in_flight"),
        },
        "domains": {
            "requests": domains,
            "share": {d: round(v / domain_total, 4) for d, v in domains.items()} if domain_total else {},
            "by_source": _by(proxy, "moe_l2_domain_total", "source"),
            "predictions": _by(predictor, "moe_l2_predictor_predictions_total", "domain"),
        },
        "experts": {
            "hit_rate": _ratio(all_hits, all_hits + all_misses),
            "hit_rate_by_domain": {d: _ratio(hits.get(d, 0.0), hits.get(d, 0.0) + misses.get(d, 0.0)) for d in hits},
            "routed_tokens": _by(llama, "llamacpp:moe_routed_tokens_total", "domain"),
        },
        "hot_set": {
            "active_domain": active[0] if active else None,
            "llama_experts": _total(llama, "llamacpp:moe_hot_set_experts"),
            "llama_switches": _total(llama, "llamacpp:moe_hot_set_switches_total"),
            "cache_switches": _total(cache, "moe_l2_cache_hotset_switches_total"),
        },
        "pool": {
            "budget_bytes": budget,
            "pinned_bytes": pinned,
            "locked_bytes": _total(cache, "moe_l2_cache_pool_locked_bytes"),
            "resident_bytes": resident,
            "tracked_bytes": _total(cache, "moe_l2_cache_pool_tracked_bytes"),
            "pinned_share_of_budget": _ratio(pinned, budget),
            "redis_up": _total(cache, "moe_l2_cache_redis_up"),
        },
        "expert_cache": expert_cache_summary(llama),
        "tokens": {
            "prompt": _by(proxy, "moe_l2_tokens_total", "kind").get("prompt"),
            "completion": _by(proxy, "moe_l2_tokens_total", "kind").get("completion"),
            "llama_predicted_total": _total(llama, "llamacpp:tokens_predicted_total"),
            # llama-server's gauge: decoding speed over the interval since its previous /metrics read
            "llama_decode_tokens_per_s": _total(llama, "llamacpp:predicted_tokens_seconds"),
            "tokens_per_s": None,  # filled in by `take` from two scrapes
        },
    }


def replica_summary(proxy: Samples | None, llamas: dict[str, Samples | None], configured: int) -> list[dict[str, Any]]:
    """One entry per llama replica, when there are several (configured, or reported by the gateway);
    [] for one. Gateway figures (rotation, in flight, requests, domains) are None for a replica the
    gateway does not report; the hit rate is None for a llama that did not answer."""
    reported = gateway_replicas(proxy)
    if configured <= 1 and len(reported) <= 1:
        return []
    healthy = {k: v for k, v in _by(proxy, "moe_l2_replica_healthy", "replica").items() if k}
    in_flight = {k: v for k, v in _by(proxy, "moe_l2_replica_in_flight", "replica").items() if k}
    failures = _by(proxy, "moe_l2_replica_failures_total", "replica")
    requests: dict[str, dict[str, float]] = {}
    for labels, value in (proxy or {}).get("moe_l2_replica_requests_total", []):
        domains = requests.setdefault(labels.get("replica", ""), {})
        domains[labels.get("domain", "")] = domains.get(labels.get("domain", ""), 0.0) + value
    rows = []
    for replica in [*llamas, *(r for r in reported if r not in llamas)]:
        known = replica in reported
        domains = requests.get(replica, {})
        total = sum(domains.values())
        samples = llamas.get(replica)
        hits = _total(samples, "llamacpp:moe_hot_hits_total")
        misses = _total(samples, "llamacpp:moe_hot_misses_total")
        rows.append(
            {
                "replica": replica,
                "reported_by_gateway": known,
                "in_rotation": bool(healthy[replica]) if replica in healthy else None,
                "in_flight": in_flight.get(replica) if known else None,
                "requests": total if known else None,
                "failures": failures.get(replica, 0.0) if known else None,
                "domains": domains,
                "top_domains": [
                    [d, round(n / total, 4)] for d, n in sorted(domains.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
                ]
                if total
                else [],
                "reachable": samples is not None,
                "hot_hits": hits,
                "hot_misses": misses,
                "hit_rate": _ratio(hits, (hits or 0.0) + (misses or 0.0)),
            }
        )
    return rows


def expert_cache_summary(llama: Samples | None) -> dict[str, Any] | None:
    """llama-server's expert cache (--moe-cache-bytes), since it started; None when it has none.

    Bytes per token are every host→device expert copy (misses, prefetches, domain-switch preloads and the
    copies of batches too large for the slots) over every token llama processed, prompt and generated."""
    slots = _total(llama, "llamacpp:moe_cache_slots")
    if slots is None:
        return None
    accesses = _total(llama, "llamacpp:moe_cache_accesses_total") or 0.0
    hits = _total(llama, "llamacpp:moe_cache_hits_total") or 0.0
    copied = (_total(llama, "llamacpp:moe_cache_h2d_bytes_total") or 0.0) + (
        _total(llama, "llamacpp:moe_cache_bypass_bytes_total") or 0.0
    )
    tokens = (_total(llama, "llamacpp:prompt_tokens_total") or 0.0) + (
        _total(llama, "llamacpp:tokens_predicted_total") or 0.0
    )
    prefetch = _total(llama, "llamacpp:moe_cache_prefetch_total")
    domain_accesses = _by(llama, "llamacpp:moe_cache_domain_accesses_total", "domain")
    domain_hits = _by(llama, "llamacpp:moe_cache_domain_hits_total", "domain")
    domain_bytes = _by(llama, "llamacpp:moe_cache_domain_h2d_bytes_total", "domain")
    return {
        "slots": slots,
        "layers": _max(llama, "llamacpp:moe_cache_layers"),  # the same on every replica: not added up
        "device_bytes": _total(llama, "llamacpp:moe_cache_device_bytes"),
        "accesses": accesses,
        "hits": hits,
        "hit_rate": _ratio(hits, accesses),
        "h2d_bytes": copied,
        "tokens": tokens,
        "h2d_bytes_per_token": round(copied / tokens, 1) if tokens else None,
        "prefetch": prefetch,
        "prefetch_used_share": _ratio(_total(llama, "llamacpp:moe_cache_prefetch_used_total"), prefetch),
        "preload": _total(llama, "llamacpp:moe_cache_preload_total"),  # None before patch 0028
        # each token charged to its request's domain (patch 0013); the server's warm-up is "untagged"
        "hit_rate_by_domain": {d: _ratio(domain_hits.get(d, 0.0), n) for d, n in domain_accesses.items() if n},
        # its misses and its micro-batches' prefetches (an expert two domains miss together counts for both)
        "h2d_bytes_by_domain": {d: b for d, b in domain_bytes.items() if domain_accesses.get(d)},
        "hit_rate_now": None,  # filled in by `take` from two scrapes
        "h2d_bytes_per_token_now": None,
    }


def expert_cache_now(previous: dict[str, Any] | None, current: dict[str, Any] | None) -> None:
    """The live figures of `current` (hit rate, bytes per token) over the interval since `previous`."""
    if not previous or not current:
        return
    accesses = current["accesses"] - previous["accesses"]
    tokens = current["tokens"] - previous["tokens"]
    if accesses > 0:
        current["hit_rate_now"] = round((current["hits"] - previous["hits"]) / accesses, 4)
    if tokens > 0:
        current["h2d_bytes_per_token_now"] = round((current["h2d_bytes"] - previous["h2d_bytes"]) / tokens, 1)


def supervisor_summary(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per service: state, restarts, the last failure; None unless a `moe-l2 up` is running."""
    if not state or not state.get("live"):
        return None
    return {
        name: {
            "state": svc.get("state"),
            "restarts": svc.get("restarts", 0),
            "pid": svc.get("pid"),
            "last_failure": svc.get("last_failure"),
            "last_recovery_s": svc.get("last_recovery_s"),
        }
        for name, svc in state["services"].items()
    }


def read_supervisor() -> dict[str, Any] | None:
    from moe_l2_ops.stack import StackSettings
    from moe_l2_ops.supervisor import read_state

    return supervisor_summary(read_state(StackSettings().state_file))


def throughput(previous: dict[str, Any], current: dict[str, Any], elapsed_s: float) -> float | None:
    """Generated tokens per second between two screens (llama's counter)."""
    before, after = previous["tokens"]["llama_predicted_total"], current["tokens"]["llama_predicted_total"]
    if before is None or after is None or elapsed_s <= 0:
        return None
    return round(max(after - before, 0.0) / elapsed_s, 2)


def format_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "-"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def render(stats: dict[str, Any]) -> str:
    req, dom, exp, hot, pool, tok = (stats[k] for k in ("requests", "domains", "experts", "hot_set", "pool", "tokens"))
    problems = stats.get("problems", {})
    services = "  ".join(
        f"{name} {'up' if ok else 'DOWN'}" + (f" ({problems[name]})" if name in problems else "")
        for name, ok in stats["services"].items()
    )
    share = ", ".join(f"{d} {v:.0%}" for d, v in sorted(dom["share"].items(), key=lambda kv: -kv[1])) or "-"
    sources = ", ".join(f"{s} {v:g}" for s, v in sorted(dom["by_source"].items())) or "-"
    per_domain = ", ".join(f"{d} {_pct(v)}" for d, v in sorted(exp["hit_rate_by_domain"].items())) or "-"
    statuses = ", ".join(f"{s}: {v:g}" for s, v in sorted(req["by_status"].items())) or "-"
    lines = [
        f"services    {services}",
        f"requests    {req['total']:g} total, {req['errors']:g} errors ({statuses}), "
        f"in flight {_num(req['in_flight'])}",
        f"domains     {share}",
        f"  source    {sources}",
        f"experts     hot-set hit rate {_pct(exp['hit_rate'])}  (per domain: {per_domain})",
        f"hot set     active domain {hot['active_domain'] or '-'}, llama holds {_num(hot['llama_experts'])} experts, "
        f"switches {_num(hot['cache_switches'])} (cache-manager) / {_num(hot['llama_switches'])} (llama)",
        f"pool        pinned {format_bytes(pool['pinned_bytes'])} of {format_bytes(pool['budget_bytes'])} budget "
        f"({_pct(pool['pinned_share_of_budget'])}), resident {format_bytes(pool['resident_bytes'])}, "
        f"tracked {format_bytes(pool['tracked_bytes'])}",
        f"cache       {render_expert_cache(stats.get('expert_cache'))}",
        f"tokens      prompt {_num(tok['prompt'])}, completion {_num(tok['completion'])}"
        + (f"; generated {tok['tokens_per_s']:g} tokens/s now" if tok["tokens_per_s"] is not None else ""),
    ]
    if replicas := stats.get("replicas"):
        lines += render_replicas(replicas)
    if supervised := stats.get("supervisor"):
        lines.append(f"restarts    {render_restarts(supervised)}")
    return "\n".join(lines)


def render_replicas(replicas: list[dict[str, Any]]) -> list[str]:
    """The per-replica section: one line per llama replica, its columns aligned."""
    width = max(len(r["replica"]) for r in replicas)
    lines = [f"replicas    {len(replicas)} llama replicas"]
    for r in replicas:
        if r["in_rotation"] is None:
            rotation = "not reported by the gateway"
        else:
            rotation = "in rotation" if r["in_rotation"] else "OUT (cooling down)"
        top = ", ".join(f"{d} {share:.0%}" for d, share in r["top_domains"]) or "-"
        text = (
            f"  {r['replica']:<{width}}  {rotation}, in flight {_num(r['in_flight'])}, "
            f"requests {_num(r['requests'])} ({top}), hot-set hit rate {_pct(r['hit_rate'])}"
        )
        if r["failures"]:
            text += f", failures {_num(r['failures'])}"
        if not r["reachable"]:
            text += " (its /metrics did not answer)"
        lines.append(text)
    return lines


def render_expert_cache(cache: dict[str, Any] | None) -> str:
    if cache is None:
        return "off (llama-server runs without --moe-cache-bytes)"
    text = (
        f"{_num(cache['slots'])} slots x {_num(cache['layers'])} layers ({format_bytes(cache['device_bytes'])}), "
        f"hit rate {_pct(cache['hit_rate'])}"
    )
    if cache["hit_rate_now"] is not None:
        text += f" (now {_pct(cache['hit_rate_now'])})"
    text += f", {format_bytes(cache['h2d_bytes_per_token'])}/token copied"
    if cache["h2d_bytes_per_token_now"] is not None:
        text += f" (now {format_bytes(cache['h2d_bytes_per_token_now'])})"
    if cache["prefetch"]:
        text += f", prefetched {_num(cache['prefetch'])} ({_pct(cache['prefetch_used_share'])} used)"
    if cache.get("preload"):
        text += f", pre-loaded {_num(cache['preload'])} on domain switches"
    if by_domain := cache.get("hit_rate_by_domain"):
        copied = cache.get("h2d_bytes_by_domain") or {}
        text += (
            " (per domain: "
            + ", ".join(
                f"{d} {_pct(v)}" + (f" {format_bytes(copied[d])} copied" if d in copied else "")
                for d, v in sorted(by_domain.items())
            )
            + ")"
        )
    return text


def render_restarts(supervised: dict[str, Any]) -> str:
    parts = []
    for name, svc in supervised.items():
        text = f"{name} {svc['restarts']}"
        if svc["state"] != "running":
            text += f" {str(svc['state']).upper()}"
        if svc["restarts"] or svc["state"] != "running":
            text += f" (last: {svc['last_failure'] or '-'})"
        parts.append(text)
    return ", ".join(parts)


@dataclass
class Screen:
    stats: dict[str, Any]
    at: float


def take(settings: OpsSettings, previous: Screen | None) -> Screen:
    problems: dict[str, str] = {}
    scraped = scrape(settings, problems)
    screen = Screen(summarize(scraped, scrape_replicas(settings, scraped, problems)), time.monotonic())
    screen.stats["problems"] = problems
    screen.stats["supervisor"] = read_supervisor()
    if previous is not None:
        screen.stats["tokens"]["tokens_per_s"] = throughput(previous.stats, screen.stats, screen.at - previous.at)
        expert_cache_now(previous.stats.get("expert_cache"), screen.stats.get("expert_cache"))
    return screen


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="moe-l2 stats",
        description="Figures of the running moe-l2 services (from their /metrics). Service URLs: "
        "MOE_L2_PROXY_URL, MOE_L2_LLAMA_URLS (else MOE_L2_LLAMA_URL), MOE_L2_PREDICTOR_URLS, "
        "MOE_L2_CACHE_URLS (else MOE_L2_CACHE_URL), else the MOE_L2_*_PORT of `moe-l2 up`. Several llama "
        "replicas (listed, or reported by the gateway) get a section each.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the text screen")
    parser.add_argument("--watch", action="store_true", help="refresh until Ctrl-C, with live tokens/s")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (--watch)")
    parser.add_argument("--count", type=int, default=0, help="stop after this many refreshes (--watch; 0 = never)")
    parser.add_argument(
        "--sample",
        type=float,
        default=1.0,
        help="one screen: seconds between the two scrapes tokens/s is measured over",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = OpsSettings()
    screen: Screen | None = None
    shown = 0
    try:
        if not args.watch and args.sample > 0:
            screen = take(settings, None)
            time.sleep(args.sample)
        while True:
            screen = take(settings, screen)
            if not any(screen.stats["services"].values()):
                print("error: no moe-l2 service answered; is `moe-l2 up` running?", file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps(screen.stats, sort_keys=True), flush=True)
            else:
                if args.watch and sys.stdout.isatty():
                    print("\033[H\033[2J", end="")  # clear the terminal between screens
                print(render(screen.stats) + ("\n" if args.watch else ""), flush=True)
            shown += 1
            if not args.watch or (args.count and shown >= args.count):
                return 0
            time.sleep(max(args.interval, 0.1))
    except (KeyboardInterrupt, BrokenPipeError):  # Ctrl-C, or `| head` closed the pipe
        return 0
