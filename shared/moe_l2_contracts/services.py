"""The table of moe-l2's HTTP services: name, default port, the env variable of the port, health path.

The one place these are defined: each service's settings, `moe-l2 up`, `stats`, `doctor` and the
compose tests read them here, so a port cannot drift between them. A service's port variable is
`MOE_L2_<SERVICE>_PORT`; the URL of a sibling that `moe-l2 up` runs on this host follows it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Service:
    name: str
    port: int
    env_prefix: str  # MOE_L2_<SERVICE>_: the prefix of the service's own settings (its port, host)
    health_path: str

    @property
    def port_env(self) -> str:
        return f"{self.env_prefix}PORT"

    def local_url(self, env: Mapping[str, str] | None = None) -> str:
        """The URL of this service run by `moe-l2 up` on this host, following its port variable if set."""
        env = os.environ if env is None else env
        return f"http://127.0.0.1:{env.get(self.port_env, self.port)}"


PROXY = Service("proxy", 11435, "MOE_L2_PROXY_", "/healthz")
LLAMA = Service("llama", 11436, "MOE_L2_LLAMA_", "/health")
PREDICTOR = Service("predictor", 11437, "MOE_L2_PREDICTOR_", "/healthz")
CACHE_MANAGER = Service("cache-manager", 11438, "MOE_L2_CACHE_", "/healthz")
SERVICES: dict[str, Service] = {s.name: s for s in (PROXY, LLAMA, PREDICTOR, CACHE_MANAGER)}
