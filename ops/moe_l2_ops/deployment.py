"""The deployment's settings, described once: what a user sets to deploy moe-l2, which service's settings
model reads each, and where each of the three launchers (`moe-l2 up`, compose, Kubernetes) carries it, or
that it refuses it and why (issue 34).

A setting names its owner's field, not a variable: the variable is the one the settings model reads
(`env`), so a renamed field cannot leave this list behind. tests/test_launcher_settings.py reads this
list, the settings models and the three launchers (compose.yaml as YAML, the kustomize base as rendered,
`moe-l2 up`'s services and their environment) and fails when a launcher drops one.

How each launcher carries a setting:
- `moe-l2 up`: its services inherit its environment (moe_l2_ops.supervisor), each settings model reads its
  own variables; llama-server gets its flags from LlamaSettings; replicas are `up`'s own.
- compose: `${VAR:-default}` in compose.yaml, on the owner's service (llama's as its LLAMA_ARG_* variable
  or flag); replicas as `scale:` (`--scale` on the command line wins).
- Kubernetes: a variable declared on the owner's container in the base (or its flag among llama's
  arguments), set by a kustomize patch; replicas as the workload's replicas (the predictor's: its
  HorizontalPodAutoscaler). The containers' memory limits are Kubernetes' own (resources.limits, checked by
  tests/kubernetes): compose and `moe-l2 up` set none, the budgets below are what bound memory there.

Where a launcher's default form cannot carry a setting, `elsewhere` says where it is and the base
refuses the setting in one line (the RAM tier's, which needs llama's PID namespace and capabilities).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pydantic import AliasChoices, ValidationError

from moe_l2_cache.settings import CacheSettings
from moe_l2_contracts.env import ServiceSettings
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.supervisor import SupervisorError
from moe_l2_predictor.settings import PredictorSettings
from moe_l2_proxy.settings import ProxySettings

UP, COMPOSE, KUBERNETES = "moe-l2 up", "compose", "kubernetes"
LAUNCHERS = (UP, COMPOSE, KUBERNETES)
# the launchers' own settings (how many of a service run) have no service's model
LAUNCHER = "launcher"
SETTINGS_MODELS: Mapping[str, type[ServiceSettings]] = MappingProxyType(
    {"proxy": ProxySettings, "llama": LlamaSettings, "predictor": PredictorSettings, "cache-manager": CacheSettings}
)
RAM_TIER_COMPOSE = "compose.ram-tier.yaml"
RAM_TIER_KUBERNETES = "overlays/ram-tier"


def field_env(model: type[ServiceSettings], name: str) -> str:
    """The variable a settings model reads for a field: its stack-wide name if it has one (MOE_L2_LOG_LEVEL
    rather than MOE_L2_PROXY_LOG_LEVEL), else its own."""
    info = model.model_fields[name]
    alias = info.validation_alias
    if alias is None:
        return str(model.model_config.get("env_prefix", "")) + name.upper()
    names = [str(c) for c in alias.choices] if isinstance(alias, AliasChoices) else [str(alias)]
    return names[-1]


@dataclass(frozen=True)
class Setting:
    """One setting of a deployment."""

    what: str
    owner: str  # a service of SETTINGS_MODELS, or LAUNCHER
    name: str  # the owner's field (LAUNCHER: the variable itself)
    example: str  # a value other than the default, which the owner accepts
    also_read_by: tuple[str, ...] = ()  # other services whose settings read the same variable
    # launcher -> where the setting is carried instead of the launcher's base form (the base refuses it)
    elsewhere: Mapping[str, str] = field(default_factory=dict)
    # the same setting given as a file, where a launcher holds it as a secret (Kubernetes' admin token)
    file_env: str = ""
    # the other variables it takes effect with (the cache's policy: with a cache)
    needs: Mapping[str, str] = field(default_factory=dict)

    @property
    def env(self) -> str:
        if self.owner == LAUNCHER:
            return self.name
        return field_env(SETTINGS_MODELS[self.owner], self.name)

    @property
    def services(self) -> tuple[str, ...]:
        """The services whose own settings read it (LAUNCHER: the services it multiplies)."""
        return (self.owner, *self.also_read_by) if self.owner != LAUNCHER else self.also_read_by


SETTINGS: tuple[Setting, ...] = (
    Setting("API keys clients send (Bearer)", "proxy", "api_keys", "key-one,key-two"),
    Setting("a gateway open beyond loopback without keys", "proxy", "allow_open", "1"),
    Setting("browser origins allowed (CORS)", "proxy", "origins", "https://app.example.com"),
    Setting("how the gateway picks a llama replica", "proxy", "routing", "least_loaded"),
    Setting(
        "the admin token",
        "cache-manager",
        "admin_token",
        "0f1e2d3c4b5a69788796a5b4c3d2e1f0",
        also_read_by=("llama",),
        file_env="MOE_L2_ADMIN_TOKEN_FILE",
    ),
    Setting("the model name clients see", "llama", "model_alias", "qwen3-30b-a3b"),
    Setting("the expert cache's GPU memory", "llama", "expert_cache_bytes", "4G"),
    Setting(
        "the expert cache's policy",
        "llama",
        "expert_cache_policy",
        "lru",
        needs=MappingProxyType({"MOE_L2_LLAMA_EXPERT_CACHE_BYTES": "4G"}),
    ),
    Setting("llama-server's slots (KV cache)", "llama", "parallel", "3"),
    Setting("llama-server's drain on SIGTERM", "llama", "shutdown_timeout_s", "10"),
    Setting(
        "llama-server's context per request (KV cache)",
        "llama",
        "ctx_per_request",
        "8192",
        needs=MappingProxyType({"MOE_L2_LLAMA_PARALLEL": "1"}),
    ),
    Setting("llama-server's context, all slots together (deprecated total)", "llama", "ctx_size", "12288"),
    Setting("the expert pool's host-memory budget", "cache-manager", "pool_bytes", "4294967296"),
    Setting(
        "the model file's resident memory (the RAM tier)",
        "cache-manager",
        "ram_budget",
        "6GiB",
        also_read_by=("llama",),
        elsewhere=MappingProxyType({COMPOSE: RAM_TIER_COMPOSE, KUBERNETES: RAM_TIER_KUBERNETES}),
    ),
    Setting(
        "llama replicas, each with its cache-manager",
        LAUNCHER,
        "MOE_L2_LLAMA_REPLICAS",
        "2",
        ("llama", "cache-manager"),
    ),
    Setting("predictor replicas", LAUNCHER, "MOE_L2_PREDICTOR_REPLICAS", "3", ("predictor",)),
)


def by_env() -> dict[str, Setting]:
    return {setting.env: setting for setting in SETTINGS}


def refuse_ram_tier_with_replicas(llama_replicas: int) -> None:
    """`moe-l2 up`, before anything is built or started: MOE_L2_RAM_BUDGET with more than one llama replica
    is refused in the cache-manager's own line (SupervisorError); compose's override passes the replicas
    to the cache-manager, which refuses the same; the Kubernetes overlay puts one replica on a node."""
    from moe_l2_cache.ram_tier import ram_tier_replicas_problem

    budget = os.environ.get("MOE_L2_RAM_BUDGET", "").strip() or None
    if problem := ram_tier_replicas_problem(budget, llama_replicas):
        raise SupervisorError(f"moe_l2_cache: {problem}")


def prepare_gateway() -> None:
    """`moe-l2 up`, before anything is built or started: MOE_L2_BIND (compose's address for the published
    ports) is where the gateway listens unless MOE_L2_PROXY_HOST says otherwise (set in this process's
    environment, which every service inherits), and the gateway's own settings must hold, among them its
    refusal of an address beyond loopback without API keys (SupervisorError: one line, the gateway's own)."""
    bind = os.environ.get("MOE_L2_BIND", "").strip()
    if bind and not os.environ.get("MOE_L2_PROXY_HOST", "").strip():
        os.environ["MOE_L2_PROXY_HOST"] = bind
    try:
        ProxySettings()
    except ValidationError as exc:
        from moe_l2_proxy.__main__ import describe

        raise SupervisorError(
            f"moe_l2_proxy: invalid settings: {'; '.join(describe(e) for e in exc.errors())}"
        ) from None
