"""Configuration of the gateway: its own MOE_L2_PROXY_* variables and the stack-wide ones
(moe_l2_contracts.env gives the convention; compose.yaml sets the same)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from moe_l2_contracts.env import ServiceSettings, log_level_field, renamed_before_convention, stack_wide
from moe_l2_contracts.services import CACHE_MANAGER, LLAMA, PREDICTOR, PROXY


def split_list(value: str) -> list[str]:
    """A comma-separated setting as a list, blanks dropped."""
    return [item.strip() for item in value.split(",") if item.strip()]


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches: localhost, 127.0.0.0/8, ::1 (not 0.0.0.0 or ::, which
    mean every interface)."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to, it is not known to be loopback


class ProxySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix=PROXY.env_prefix, extra="ignore", populate_by_name=True)
    renamed_env: ClassVar[Mapping[str, str]] = renamed_before_convention(
        "llama_api_key",
        "llama_connect_timeout_s",
        "llama_read_timeout_s",
        "llama_max_connections",
        "predict_budget_ms",
        "predictor_cooldown_s",
        "predictor_dns_refresh_s",
        "hint_queue_size",
        "hint_timeout_s",
        "api_keys",
        "max_body_bytes",
        "ollama_version",
        "access_log",
        "keep_alive_s",
        "header_timeout_s",
        "body_timeout_s",
        "max_header_bytes",
        "max_connections",
        "origins",
    )

    host: str = Field(default="127.0.0.1", description="the address the gateway listens on")
    port: int = Field(default=PROXY.port, ge=1, le=65535)
    exposed_host: str = Field(
        default="",
        description="the address clients reach the gateway on when something in front of it publishes its port "
        "(compose passes MOE_L2_BIND, the host address of the published port, while the gateway listens on 0.0.0.0 "
        "inside its container); empty: MOE_L2_PROXY_HOST. Anything but loopback needs MOE_L2_PROXY_API_KEYS "
        "or MOE_L2_ALLOW_OPEN=1",
    )
    allow_open: bool = stack_wide(
        "ALLOW_OPEN",
        default=False,
        description="1 serves a gateway reachable beyond loopback without API keys (logged at start); without it "
        "such a gateway refuses to start",
    )

    llama_url: str = stack_wide(
        "LLAMA_URL", default_factory=lambda: LLAMA.local_url(), description="the one llama, when LLAMA_URLS is unset"
    )
    llama_urls: str = stack_wide(
        "LLAMA_URLS",
        default="",
        description="comma-separated llama replicas; each host name is expanded to all of its addresses "
        "(`--scale llama=N`, a Kubernetes headless Service); empty: MOE_L2_LLAMA_URL",
    )
    routing: Literal["affinity", "round_robin", "least_loaded"] = Field(
        default="affinity",
        description="how a request's llama replica is chosen: `affinity` sends a domain to the replica whose "
        "expert cache holds it (consistent hashing with bounded loads), `round_robin`, `least_loaded`",
    )
    routing_epsilon: float = Field(
        default=0.25, ge=0, description="affinity's load bound: no replica above (1 + this) x the mean in flight"
    )
    llama_cooldown_s: float = Field(
        default=5.0,
        ge=0,
        description="a failing llama replica leaves the rotation this long, then until /health is 200",
    )
    llama_probe_interval_s: float = Field(
        default=1.0, gt=0, description="how often a resting replica's /health is asked"
    )
    llama_dns_refresh_s: float = Field(default=10.0, gt=0)
    llama_api_key: str = Field(default="", description="sent to llama as a Bearer token, only when set")
    llama_connect_timeout_s: float = Field(default=5.0, gt=0)
    llama_read_timeout_s: float = Field(
        default=600.0, gt=0, description="longest silence from llama (a long prompt evaluates before any token)"
    )
    llama_max_connections: int = Field(
        default=512,
        ge=1,
        description="requests in flight to llama at once (all replicas together); more wait, see "
        "MOE_L2_PROXY_MAX_WAITING",
    )
    max_waiting: int = Field(
        default=256,
        ge=0,
        description="requests waiting for one of MOE_L2_PROXY_LLAMA_MAX_CONNECTIONS; one more is answered 503 with "
        "Retry-After at once (`overloaded`) instead of joining a queue without end",
    )
    wait_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="longest a request waits for one of MOE_L2_PROXY_LLAMA_MAX_CONNECTIONS; then 503 with Retry-After",
    )
    llama_transport: Literal["fast", "httpx"] = Field(
        default="fast",
        description="how the gateway speaks HTTP to llama: `fast` (httptools, http1_transport.py) or `httpx` "
        "(httpx's default transport: about twice the CPU per relayed token, and no resend of a request whose "
        "kept-alive connection llama had just closed); the rest of the gateway is the same either way",
    )

    predictor_urls: str = stack_wide(
        "PREDICTOR_URLS",
        default_factory=lambda: PREDICTOR.local_url(),
        description="comma-separated; each host name is expanded to all of its addresses (Docker replicas)",
    )
    predict_budget_ms: float = Field(default=50.0, ge=0, description="0 skips the predictor (keyword tier only)")
    predictor_cooldown_s: float = Field(default=5.0, ge=0, description="a failing replica is skipped this long")
    predictor_dns_refresh_s: float = Field(default=10.0, gt=0)

    cache_url: str = stack_wide(
        "CACHE_URL", default_factory=lambda: CACHE_MANAGER.local_url(), description="empty: no hints are sent"
    )
    cache_urls: str = stack_wide(
        "CACHE_URLS",
        default="",
        description="comma-separated, one cache-manager per entry of MOE_L2_LLAMA_URLS in the same order; "
        "`{host}` stands for the replica's address (a cache-manager beside each replica); empty: MOE_L2_CACHE_URL",
    )
    cache_pairing: Literal["position", "discover"] = Field(
        default="position",
        description="how a llama replica finds its cache-manager: `position` pairs the entries of "
        "MOE_L2_CACHE_URLS with those of MOE_L2_LLAMA_URLS; `discover` asks every address of every "
        "MOE_L2_CACHE_URLS entry which llama it serves (GET /v1/stats), for `--scale cache-manager=N`",
    )
    hint_queue_size: int = Field(default=256, ge=1)
    hint_timeout_s: float = Field(default=1.0, gt=0)

    api_keys: str = Field(default="", description="comma-separated Bearer keys; empty: no authentication")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1)
    ollama_version: str = Field(default="0.12.0", description="what GET /api/version reports to Ollama clients")

    log_level: str = log_level_field(PROXY.env_prefix)
    access_log: bool = Field(default=False, description="uvicorn's access log (paths and statuses only)")
    keep_alive_s: int = Field(
        default=75,
        ge=1,
        description="how long an idle client connection is kept open; longer than clients' own pool expiry "
        "(httpx and the OpenAI SDK: 5 s), so the client always closes first and never sends on a connection "
        "the gateway is closing",
    )

    header_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="a request head (request line and headers) must arrive whole within this long of its first "
        "byte, or of the connection opening; else 408 and the connection is closed (slow or stalled clients)",
    )
    body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="longest silence while a request body is still coming; else 408 (or a plain close once an "
        "answer has started) and the connection is closed",
    )
    max_header_bytes: int = Field(
        default=64 * 1024, ge=1024, description="a request head larger than this is answered 431 and closed"
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="open client connections; a request arriving on a connection beyond this is answered 503 "
        "and that connection closed",
    )
    origins: str = Field(
        default="",
        description="comma-separated browser origins allowed besides the local ones (http(s)://localhost, "
        "127.0.0.1, [::1], 0.0.0.0 on any port, app://, file://, tauri://, vscode-webview://); `*` inside an "
        "entry matches any characters but '/', and `*` alone allows every origin",
    )

    drain_s: float = Field(
        default=30.0,
        ge=0,
        description="on SIGTERM, how long the requests in flight may go on (new ones are refused 503, /healthz "
        "and /readyz answer 503); a stream still running then ends with an error event. 30 s: a CPU generation "
        "of a few hundred tokens ends within it, and it fits Kubernetes' and compose's stop grace (set above it)",
    )

    @property
    def origin_list(self) -> list[str]:
        return split_list(self.origins)

    @model_validator(mode="after")
    def _no_open_gateway(self) -> ProxySettings:
        if problem := self.open_exposure():
            if not self.allow_open:
                raise ValueError(
                    f"{problem} without API keys: set MOE_L2_PROXY_API_KEYS (comma-separated keys), "
                    "or MOE_L2_ALLOW_OPEN=1 to serve it open"
                )
        return self

    def open_exposure(self) -> str:
        """What makes this gateway open: reachable beyond loopback with no API key ('' if it is not)."""
        if self.api_key_list:
            return ""
        where = self.exposed_host.strip() or self.host
        if is_loopback(where):
            return ""
        via = "published" if self.exposed_host.strip() else "listening"
        return f"the gateway would be reachable on {where} ({via})"

    @model_validator(mode="after")
    def _cache_urls_pair_up(self) -> ProxySettings:
        if self.cache_pairing == "position":
            self.cache_url_templates()
        return self

    def cache_url_templates(self) -> list[str | None]:
        """The cache-manager URL (with `{host}` unfilled) of each entry of llama_url_list."""
        llama, cache = self.llama_url_list, self.cache_url_list
        if not cache:
            return [None] * len(llama)
        if len(cache) == 1:
            return [cache[0]] * len(llama)
        if len(cache) != len(llama):
            raise ValueError(
                f"MOE_L2_CACHE_URLS lists {len(cache)} cache-managers for {len(llama)} entries of "
                "MOE_L2_LLAMA_URLS: give one per entry, in the same order, or a single one for all"
            )
        return list(cache)

    @property
    def llama_url_list(self) -> list[str]:
        return split_list(self.llama_urls) or split_list(self.llama_url)

    @property
    def cache_url_list(self) -> list[str]:
        return split_list(self.cache_urls) or split_list(self.cache_url)

    @property
    def predictor_url_list(self) -> list[str]:
        return split_list(self.predictor_urls)

    @property
    def api_key_list(self) -> list[str]:
        return split_list(self.api_keys)
