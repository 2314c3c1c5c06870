"""bench/expert_offload.py's llama-servers: one a config (its arguments and environment: server_plan), started
under a Supervisor, on an RPC device of its own with --backend rpc, and the completion requests they answer."""

from __future__ import annotations

import argparse
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from harness.servers import start_rpc_device
from offload_configs import Config, ExpertLayout, auto_host_layers, concurrency, host_expert_layers

from moe_l2_llama.route_trace import ROUTE_TRACE_ENV
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import Supervisor, free_port

DEFAULT_OFFLOAD_MIN_BATCH = 32  # ggml-cuda's and ggml-vulkan's default for GGML_OP_OFFLOAD_MIN_BATCH
ALL_LAYERS = 99  # -ngl 99: every layer's non-expert weights on the device


@dataclass
class Server:
    """A config's llama-server while it runs, and its figures: one entry a run."""

    config: Config
    url: str
    log_path: Path
    n_cpu_moe: int | None
    host_layers: list[int]
    min_batch: int
    device_expert_bytes: int
    env: dict[str, str]
    args: list[str]
    prompt_tps: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    prompt_h2d: list[int] = field(default_factory=list)  # derived expert bytes per prompt step
    decode_h2d: list[int] = field(default_factory=list)  # derived expert bytes per decode request
    decode_steps: list[int] = field(default_factory=list)  # graph evaluations of the decode request
    reevaluated: list[int] = field(default_factory=list)  # prompt tokens the decode request evaluated (1)
    # the expert cache's own counters (e only), per decode request: measured, not derived
    decode_cache: list[dict[str, int]] = field(default_factory=list)
    final_cache: dict[str, int] = field(default_factory=dict)  # e only: every counter at the end
    sent: int = 0  # requests sent (the trace sequence the next one replays)
    start_seconds: float | None = None
    concurrent: dict | None = None  # -np N servers only: concurrent_run's figures
    lock: threading.Lock = field(default_factory=threading.Lock)  # next_domain from several threads


def server_plan(
    config: Config, n_cpu_moe: int, args: argparse.Namespace
) -> tuple[list[str], dict[str, str], int | None, int]:
    """(extra llama-server arguments, extra environment, --n-cpu-moe, offload minimum) of a config."""
    # -lv 4: libllama's info lines (its buffer sizes: the device memory each server holds) reach the log
    extra = ["--ubatch-size", str(args.ubatch), "-lv", "4"]
    env: dict[str, str] = {}
    if args.backend == "vulkan":
        # ggml-vulkan skips CPU-type devices (llvmpipe) unless they are listed
        env["GGML_VK_VISIBLE_DEVICES"] = os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")
    if args.trace_file:
        env[ROUTE_TRACE_ENV] = str(args.trace_file)
        if concurrency(config) > 1 and getattr(args, "concurrent_trace", None):
            env[ROUTE_TRACE_ENV] = str(args.concurrent_trace)
    if getattr(args, "seq_tags", None):
        env["LLAMA_ARG_MOE_DOMAINS"] = ",".join(sorted(set(args.seq_tags)))
    min_batch = int(os.environ.get("GGML_OP_OFFLOAD_MIN_BATCH", DEFAULT_OFFLOAD_MIN_BATCH))
    n: int | None = None
    if config.base in ("b", "d", "e"):
        extra.append("--cpu-moe")
    if config.base == "c":
        n = n_cpu_moe
    if config.base == "d":
        min_batch = 1
    if config.load_mode:
        extra += ["--load-mode", config.load_mode]
    extra += list(config.args)
    env.update(dict(config.env))
    if config.base == "e" and getattr(args, "cache_log_dir", None):
        # what offload_replay.replay_check checks the counters against, one log per cache server
        env["LLAMA_ARG_MOE_CACHE_LOG"] = str(args.cache_log_dir / f"{config.key}-access.log")
    env["GGML_OP_OFFLOAD_MIN_BATCH"] = str(min_batch)
    return extra, env, n, min_batch


def start_server(
    supervisor: Supervisor,
    binary: Path,
    model: Path,
    config: Config,
    layout: ExpertLayout,
    n_cpu_moe: int,
    device_expert_bytes: int,
    args: argparse.Namespace,
    token: str,
) -> Server:
    extra, env, n, min_batch = server_plan(config, n_cpu_moe, args)
    if args.backend == "rpc":
        # the RPC build is a CPU build: --no-repack, as the engine's tests give it (repacked host experts cannot
        # be copied to a device)
        device = start_rpc_device(supervisor, binary, f"{config.key}-rpc", args.rpc_threads)
        extra = ["--rpc", device, "--no-repack", *extra]
    parallel = concurrency(config)
    settings = LlamaSettings(
        port=free_port(),
        parallel=parallel,
        ctx_size=args.ctx * parallel,  # every slot the context of the -np 1 servers
        threads=args.threads,
        telemetry=True,
        admin_token=token,
        gpu_layers=ALL_LAYERS,
        n_cpu_moe=n,
        extra_args=" ".join(extra),
        expert_cache_bytes=(("auto:" if config.auto else "") + str(getattr(args, "e_bytes", 0) or device_expert_bytes))
        if config.base == "e"
        else "",
    )
    if config.base == "e":
        settings.expert_cache_policy = config.policy or "default"
    if "cpu_repack" in LlamaSettings.model_fields:  # the settings decide --no-repack themselves
        settings.cpu_repack = not args.no_repack
    spec = llama_service_spec(
        f"{config.key}-{config.name}", binary, model, settings, start_timeout_s=args.start_timeout
    )
    spec.env.update(env)
    if args.no_repack and "--no-repack" not in spec.argv:
        spec.argv.append("--no-repack")
    running = supervisor.start(spec)
    host_layers = host_expert_layers(config, layout, n_cpu_moe)
    if config.auto:
        host_layers = auto_host_layers(running.log_path.read_text(errors="replace"), host_layers)
    return Server(
        config=config,
        url=running.spec.url,
        log_path=running.log_path,
        n_cpu_moe=n,
        host_layers=host_layers,
        min_batch=min_batch,
        device_expert_bytes={
            "a": layout.routed_bytes,
            "c": device_expert_bytes,
            "e": getattr(args, "e_bytes", 0) or device_expert_bytes,
        }.get(config.base, 0),
        env=env,
        args=spec.argv[1:],
    )


def complete(
    client: httpx.Client, url: str, prompt: str, n_predict: int, cache_prompt: bool, domain: str | None = None
) -> dict:
    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "cache_prompt": cache_prompt,
        "ignore_eos": True,
    }
    headers = {"X-MoE-Domain": domain} if domain else None
    return client.post(f"{url}/completion", json=body, headers=headers).raise_for_status().json()["timings"]


def next_domain(s: Server, args: argparse.Namespace) -> str | None:
    """The domain tag of the server's next request: the ESFT task of the trace sequence it replays
    (request r replays sequence r), with --domains esft; else none."""
    tags = getattr(args, "concurrent_tags", None) if concurrency(s.config) > 1 else None
    tags = tags or getattr(args, "seq_tags", None)
    with s.lock:
        s.sent += 1
        r = s.sent - 1
    return tags[r % len(tags)] if tags else None
