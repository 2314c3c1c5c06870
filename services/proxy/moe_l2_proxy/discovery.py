"""Finding a service's replicas: every address a configured host name resolves to.

A single Docker service name with `--scale predictor=3` (or `--scale llama=2`) reaches every
replica this way (Docker's DNS returns all their addresses), as does a Kubernetes headless
Service. Used by the predictor pool and the llama replica pool; names are re-resolved in the
background by each, a request never waits on DNS.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

log = logging.getLogger("moe_l2_proxy.discovery")

# (host, port) -> the addresses to try
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class Endpoint:
    url: str  # scheme://address:port, what requests go to
    host_header: str | None = None  # the configured host name, when url holds one of its addresses


async def resolve_all(host: str, port: int) -> list[str]:
    """Every distinct address of a host name, in the resolver's order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for *_, sockaddr in infos:
        address = str(sockaddr[0])
        if address not in seen:
            seen.append(address)
    return seen


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def expand(url: str, resolver: Resolver, what: str = "predictor") -> list[Endpoint]:
    """One endpoint per address of the URL's host; the URL itself if it is an address or cannot be resolved."""
    parts = urlsplit(url.rstrip("/"))
    host = parts.hostname or ""
    if not host or is_ip_literal(host):
        return [Endpoint(url.rstrip("/"))]
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = await resolver(host, port)
    except OSError as exc:
        log.warning("cannot resolve %s host %s: %s", what, host, exc)
        addresses = []
    if not addresses:
        return [Endpoint(url.rstrip("/"))]
    host_header = parts.netloc.rpartition("@")[2]
    endpoints = []
    for address in addresses:
        shown = f"[{address}]" if ":" in address else address
        endpoints.append(Endpoint(f"{parts.scheme}://{shown}:{port}", host_header))
    return endpoints


def has_host_name(urls: list[str]) -> bool:
    """Whether any URL names its host (so that its addresses may change and are worth re-resolving)."""
    return any(not is_ip_literal(urlsplit(u).hostname or "") for u in urls)
