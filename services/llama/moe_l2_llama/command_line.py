"""llama-server's command line and environment, made from LlamaSettings: the argv (llama_server_command),
the LLAMA_ARG_* variables of the patch series' MoE flags (llama_server_env), and the derived values they
share (the total context, whether the expert cache, the read-ahead and the transition counts are on).

Separate from the settings model: every launcher (`moe-l2 up`, the tests, the benchmarks) turns the same
settings into the same process, and this is the one place that does it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from moe_l2_contracts.admin import configured_token
from moe_l2_domains.known import known_domains
from moe_l2_llama.cpu_features import cpu_has_amx
from moe_l2_llama.settings import LlamaSettings
from moe_l2_placement.hit_curve import DEFAULT_HIT_CURVE


def total_context(settings: LlamaSettings) -> int:
    """llama-server's -c, the context of all its slots together: each request's times the slots, unless
    a total is given (ctx_size)."""
    return settings.ctx_size if settings.ctx_size is not None else settings.ctx_per_request * settings.parallel


def expert_cache_on(settings: LlamaSettings) -> bool:
    value = settings.expert_cache_bytes
    return value == "auto" or bool(re.sub(r"[^1-9]", "", value))  # auto, or any nonzero digit: not off


def auto_placement(settings: LlamaSettings) -> bool:
    """--moe-cache-bytes auto, auto:SIZE or auto:SHARE: the engine splits the budget between whole layers and
    the cache by its cost model, which reads the hit curve (hit_curve_file)."""
    return expert_cache_on(settings) and settings.expert_cache_bytes.startswith("auto")


def hit_curve_file(settings: LlamaSettings) -> Path:
    """The hit curve llama-server's auto placement reads: the one given (hit_curve), else the shipped default."""
    return settings.hit_curve or DEFAULT_HIT_CURVE


def willneed_on(settings: LlamaSettings) -> bool:
    """A model larger than its RAM budget is read expert by expert from its mapping: the engine asks for each
    layer's chosen experts at once instead of faulting them in (docs/ram-tier.md has the measurement)."""
    return settings.moe_willneed if settings.moe_willneed is not None else bool(settings.ram_budget.strip())


def counts_transitions(settings: LlamaSettings) -> bool:
    # a domain's table is n_layer x n_expert^2 counts (15 MiB for DeepSeek-V3): worth it only for a cache
    wanted = settings.transitions if settings.transitions is not None else expert_cache_on(settings)
    return settings.telemetry and wanted


def llama_server_command(binary: Path, model: Path, settings: LlamaSettings) -> list[str]:
    cmd = [
        str(binary),
        "--model", str(model),
        "--host", settings.host,
        "--port", str(settings.port),
        "--parallel", str(settings.parallel),
        "--ctx-size", str(total_context(settings)),
        "--metrics",
        "--no-webui",
    ]  # fmt: skip
    if settings.threads:
        cmd += ["--threads", str(settings.threads)]
    if settings.cpu_moe:
        cmd.append("--cpu-moe")
    if settings.n_cpu_moe is not None:
        cmd += ["--n-cpu-moe", str(settings.n_cpu_moe)]
    if settings.fit is not None:
        cmd += ["--fit", settings.fit]
    if settings.gpu_layers is not None:
        cmd += ["--gpu-layers", str(settings.gpu_layers)]
    if expert_cache_on(settings):
        cmd += ["--moe-cache-bytes", settings.expert_cache_bytes, "--moe-cache-policy", settings.expert_cache_policy]
    if willneed_on(settings):
        cmd.append("--moe-willneed")
    repack = settings.cpu_repack if settings.cpu_repack is not None else not cpu_has_amx()
    if not repack:
        cmd.append("--no-repack")
    # clients see a model name, never the host path llama-server would report as the model id
    cmd += ["--alias", settings.model_alias]
    cmd += shlex.split(settings.extra_args)
    return cmd


def llama_server_env(settings: LlamaSettings) -> dict[str, str]:
    """Variables added to the environment of llama-server, the LLAMA_ARG_* variables of its MoE flags
    (patches 0022-0033): --moe-telemetry and --moe-transitions, the admin token (a variable, not
    --moe-admin-token, which `ps` would show; empty: every admin call is refused) and --moe-domains,
    the domains a request may be tagged with; and of its drain on SIGTERM (--shutdown-timeout). With the expert
    cache's auto placement, the hit curve it splits the budget with (--moe-cache-hit-curve)."""
    env = {
        "LLAMA_ARG_SHUTDOWN_TIMEOUT": str(settings.shutdown_timeout_s),
        "LLAMA_ARG_MOE_TELEMETRY": "1" if settings.telemetry else "0",
        "LLAMA_ARG_MOE_TRANSITIONS": "1" if counts_transitions(settings) else "0",
        "LLAMA_ARG_MOE_ADMIN_TOKEN": settings.admin_token or configured_token(),
        "LLAMA_ARG_MOE_DOMAINS": ",".join(sorted(known_domains())),
    }
    if auto_placement(settings):
        env["LLAMA_ARG_MOE_CACHE_HIT_CURVE"] = str(hit_curve_file(settings))
    return env
