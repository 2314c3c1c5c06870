"""The processes of one bench/ram_tier.py configuration: llama-server (the same binary and flags for every
config, --moe-willneed aside) and, for moe-l2, a real redis-server and the real cache-manager with
MOE_L2_RAM_BUDGET, the flywheel's tables seeded before it starts."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.servers import BenchError
from ram_tier_inputs import ESFT_TASKS

from moe_l2_domains.known import known_domains
from moe_l2_llama.route_trace import ROUTE_TRACE_ENV
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import ServiceSpec, Supervisor, SupervisorError, free_port, http_ok, tcp_open

# "willneed": stock + the engine's read-ahead of each layer's chosen experts alone, no tier (--configs)
CONFIGS = ("stock", "willneed", "moe-l2")
DEFAULT_CONFIGS = ("stock", "moe-l2")


@dataclass
class Stack:
    """The processes of one configuration while it runs."""

    config: str
    supervisor: Supervisor
    llama_url: str
    llama_pid: int
    cache_url: str | None = None
    cache_pid: int | None = None

    def pids(self) -> list[int]:
        return [p for p in (self.llama_pid, self.cache_pid) if p is not None]


def llama_env(args: argparse.Namespace) -> dict[str, str]:
    """llama-server's domains (the taxonomy's and the ESFT tasks) and the route trace it replays, if any."""
    env = {"LLAMA_ARG_MOE_DOMAINS": ",".join(sorted(known_domains() | set(ESFT_TASKS)))}
    if args.trace_file:
        env[ROUTE_TRACE_ENV] = str(args.trace_file)
    return env


def start_stack(config: str, model: Path, binary: Path, budget: int, args: argparse.Namespace, logs: Path) -> Stack:
    """The processes of `config` under a Supervisor of their own, its logs in `logs`; all stopped when one
    does not start."""
    supervisor = Supervisor(logs)
    try:
        settings = LlamaSettings(
            port=free_port(),
            parallel=1,
            ctx_size=args.ctx,
            threads=args.threads,
            telemetry=True,
            admin_token=args.token,
            moe_willneed=config == "willneed" or (config == "moe-l2" and args.willneed == "on"),
            cpu_repack=False,  # repacked weights would live in anonymous memory, not in the mapping
        )
        spec = llama_service_spec(f"llama-{config}", binary, model, settings, start_timeout_s=args.start_timeout)
        spec.env.update(llama_env(args))
        llama = supervisor.start(spec)
        stack = Stack(config, supervisor, llama.spec.url, llama.proc.pid)
        if config == "moe-l2":
            redis_port = free_port()
            redis_dir = logs / "redis"
            redis_dir.mkdir(exist_ok=True)
            argv = [redis_binary(), "--bind", "127.0.0.1", "--port", str(redis_port), "--dir", str(redis_dir)]
            argv += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
            supervisor.start(
                ServiceSpec("redis", argv, tcp_open("127.0.0.1", redis_port), f"redis://127.0.0.1:{redis_port}/0")
            )
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
            if args.seed_bodies:
                seed_flywheel(redis_url, args.seed_bodies, args.model_bytes.model_id)
            cache_port = free_port()
            env = {
                "MOE_L2_MODEL_PATH": str(model),
                "MOE_L2_LLAMA_URL": stack.llama_url,
                "MOE_L2_REDIS_URL": redis_url,
                "MOE_L2_CACHE_PORT": str(cache_port),
                "MOE_L2_CACHE_HOST": "127.0.0.1",
                "MOE_L2_ADMIN_TOKEN": args.token,
                "MOE_L2_RAM_BUDGET": str(budget),
                "MOE_L2_EXTRA_DOMAINS": ",".join(ESFT_TASKS),
                # requests run one at a time, each its own domain: every hint switches at once
                "MOE_L2_CACHE_DWELL_S": str(args.dwell_s),
            }
            base = f"http://127.0.0.1:{cache_port}"
            cm = supervisor.start(
                ServiceSpec(
                    "cache-manager",
                    [sys.executable, "-m", "moe_l2_cache"],
                    http_ok(f"{base}/healthz"),
                    base,
                    env=env,
                    start_timeout_s=args.start_timeout,
                )
            )
            stack.cache_url, stack.cache_pid = base, cm.proc.pid
        return stack
    except SupervisorError as exc:
        supervisor.stop()
        raise BenchError(f"{config}: a service did not start: {str(exc).splitlines()[0]} (logs under {logs})") from exc
    except BaseException:
        supervisor.stop()
        raise


def redis_binary() -> str:
    from moe_l2_ops.stack import redis_server_binary

    try:
        return redis_server_binary()
    except SupervisorError as exc:
        raise BenchError(str(exc)) from exc


def seed_flywheel(redis_url: str, seed: dict[str, dict], model_id: str) -> None:
    """The flywheel's tables as if the held-out sequences had been served (the keys of
    moe_l2_cache.redis_keys): per domain, per MoE layer, expert -> activations, and its tokens."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        base = f"moe:{model_id}"
        for domain, table in seed.items():
            client.sadd(f"{base}:domains", domain)
            client.hincrby(f"{base}:tokens", domain, int(table["tokens"]))
            for layer, experts in table["layers"].items():
                client.hset(f"{base}:routing:{domain}:{layer}", mapping={str(e): c for e, c in experts.items()})
    finally:
        client.close()
