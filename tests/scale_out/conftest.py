"""Fixtures of the scale-out tests: real llama replicas on the demo model, each with its own real
cache-manager, one real Redis they all write, and real gateway processes in front of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from moe_l2_gguf.index import load_index
from moe_l2_ops.supervisor import Supervisor, free_port
from tests.cache import conftest as cache_fixtures
from tests.cache.conftest import CacheManager, RedisServer
from tests.proxy import conftest as proxy_fixtures
from tests.proxy.support import ManagedProcess, llama_spec

pytestmark = pytest.mark.llama

# the fixtures of the cache-manager's and the gateway's tests, shared here
module_redis = cache_fixtures.module_redis
start_gateway = proxy_fixtures.start_gateway

# the hot set holds half the routed experts' bytes unless a test says otherwise
HOT_SET_SHARE = 0.5


@dataclass
class Replica:
    llama: ManagedProcess
    cache: CacheManager
    cache_env: dict[str, str]
    logs: Path

    def swap_cache_manager(self, **env: str) -> None:
        """A new cache-manager for this llama with these settings changed (the old one is stopped)."""
        self.cache.close()
        settings = {**self.cache_env, **env}
        self.cache = CacheManager(settings, self.logs / f"cache-manager-{len(list(self.logs.iterdir()))}.log")
        self.cache.start()


def hot_set_bytes(model: Path, share: float) -> str:
    """MOE_L2_CACHE_HOTSET_BYTES for a hot set of `share` of the model's routed expert bytes."""
    return str(int(load_index(model).routed_bytes * share))


@pytest.fixture(scope="module")
def start_replica(
    llama_binary: Path, demo_model: Path, module_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Replica]]:
    """Factory: llama-server (4 slots, one thread) and its cache-manager; all stopped at module end."""
    started: list[Replica] = []

    def start(name: str, model: Path | None = None, **cache_env: str) -> Replica:
        model = model or demo_model
        logs = tmp_path_factory.mktemp(f"{name}-logs")
        llama = ManagedProcess(
            name,
            free_port(),
            llama_spec(llama_binary, model, name, parallel=4, ctx_size=4 * 2048),
            Supervisor(logs),
        )
        llama.start()
        env = {
            "MOE_L2_MODEL_PATH": str(model),
            "MOE_L2_LLAMA_URL": llama.url,
            "MOE_L2_REDIS_URL": module_redis.url,
            "MOE_L2_CACHE_PULL_INTERVAL_S": "0",  # the tests pull when the tables should learn
            "MOE_L2_CACHE_DWELL_S": "1",
            "MOE_L2_CACHE_HOTSET_BYTES": hot_set_bytes(model, HOT_SET_SHARE),
            **cache_env,
        }
        cache = CacheManager(env, logs / "cache-manager.log")
        cache.start()
        replica = Replica(llama, cache, env, logs)
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.cache.close()
        replica.llama.stop()


def gateway_metrics(client: httpx.Client) -> str:
    resp = client.get("/metrics")
    resp.raise_for_status()
    return resp.text
