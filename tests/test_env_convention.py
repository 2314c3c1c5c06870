"""Every service's settings follow one naming convention (moe_l2_contracts.env), and the old names still work.

A service's own variable is MOE_L2_<SERVICE>_<NAME> (its prefix from the service table); the few
variables several processes share are stack-wide MOE_L2_<NAME>; compose.yaml sets only names some
settings read.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from pydantic import AliasChoices

from moe_l2_cache.settings import CacheSettings
from moe_l2_contracts.domains import EXTRA_DOMAINS_ENV
from moe_l2_contracts.env import ServiceSettings
from moe_l2_contracts.services import SERVICES
from moe_l2_domains.taxonomy import TAXONOMY_ENV
from moe_l2_llama.settings import LlamaSettings
from moe_l2_predictor.settings import PredictorSettings
from moe_l2_proxy.settings import ProxySettings

REPO = Path(__file__).resolve().parent.parent
SETTINGS: dict[str, type[ServiceSettings]] = {
    "proxy": ProxySettings,
    "llama": LlamaSettings,
    "predictor": PredictorSettings,
    "cache-manager": CacheSettings,
}
# The variables several processes must agree on: one name each, no service prefix.
STACK_WIDE = {
    "MOE_L2_MODEL_PATH",
    "MOE_L2_ADMIN_TOKEN",
    "MOE_L2_ADMIN_TOKEN_FILE",
    "MOE_L2_EXTRA_DOMAINS",
    "MOE_L2_TAXONOMY_PATH",
    "MOE_L2_REDIS_URL",
    "MOE_L2_LOG_LEVEL",
    # the model file's memory on its host, not one service's setting (docs/ram-tier.md); the issue
    # that asked for it names it so
    "MOE_L2_RAM_BUDGET",
    # one switch for every launcher: a gateway reachable beyond loopback may run without API keys
    "MOE_L2_ALLOW_OPEN",
    # the launchers' count of llama replicas (`--llama-replicas`, compose's scale), which the cache-manager
    # reads to refuse the RAM tier beside more than one (docs/ram-tier.md)
    "MOE_L2_LLAMA_REPLICAS",
}


def env_names(settings: type[ServiceSettings]) -> dict[str, list[str]]:
    """Every field's environment variables, as pydantic-settings reads them."""
    prefix = settings.model_config.get("env_prefix", "")
    names = {}
    for field, info in settings.model_fields.items():
        alias = info.validation_alias
        if alias is None:
            names[field] = [prefix + field.upper()]
        elif isinstance(alias, AliasChoices):
            names[field] = [str(choice) for choice in alias.choices]
        else:
            names[field] = [str(alias)]
    return names


def service_urls() -> set[str]:
    """A sibling's address: MOE_L2_<SERVICE>_URL (the predictor's replicas: _URLS)."""
    return {s.env_prefix + suffix for s in SERVICES.values() for suffix in ("URL", "URLS")}


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_every_variable_follows_the_convention(service: str) -> None:
    prefix = SERVICES[service].env_prefix
    settings = SETTINGS[service]
    assert settings.model_config.get("env_prefix") == prefix
    allowed_shared = STACK_WIDE | service_urls()
    for field, names in env_names(settings).items():
        own = [n for n in names if n.startswith(prefix) and n not in service_urls()]
        assert own or set(names) & allowed_shared, f"{service}.{field}: {names} follow neither rule"
        stray = [n for n in names if not n.startswith(prefix) and n not in allowed_shared]
        assert not stray, f"{service}.{field}: {stray} are neither {prefix}* nor stack-wide"


@pytest.mark.parametrize("service", sorted(name for name, settings in SETTINGS.items() if settings.renamed_env))
def test_old_names_still_work_with_a_warning(
    service: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings = SETTINGS[service]
    fields = env_names(settings)
    for old, field in settings.renamed_env.items():
        (new,) = fields[field]
        assert new != old and new.startswith(SERVICES[service].env_prefix)
        assert old not in {n for names in fields.values() for n in names}, f"{old} is still a current name"
    old, field = next(iter(settings.renamed_env.items()))
    default = settings.model_fields[field].default
    value, newer = _other_value(default, 1), _other_value(default, 2)
    monkeypatch.setenv(old, value)
    with caplog.at_level(logging.WARNING, logger="moe_l2.settings"):
        assert str(getattr(settings(), field)) == value
    assert f"{old} is deprecated: set {fields[field][0]} instead" in caplog.text
    # both set: the new name wins
    monkeypatch.setenv(fields[field][0], newer)
    assert str(getattr(settings(), field)) == newer


def _other_value(default: object, n: int) -> str:
    """A value unlike the default (and unlike the other n)."""
    if isinstance(default, bool):
        return str(not default) if n == 1 else str(default)
    if isinstance(default, int | float):
        return str(int(default) + n)
    return f"{default}{n}"


def test_compose_gives_each_service_only_names_it_reads() -> None:
    """A stale, misspelt or needless name in compose.yaml would be ignored in silence: none is. Each
    Python service's variables are its settings' plus those its libraries read from the environment
    (llama's container runs no Python: its entrypoint reads its variables, tests/compose checks them)."""
    direct = {EXTRA_DOMAINS_ENV, TAXONOMY_ENV}  # moe_l2_domains: known_domains(), the taxonomy
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    for name in ("proxy", "predictor", "cache-manager"):
        read = {n for names in env_names(SETTINGS[name]).values() for n in names} | direct
        env = compose["services"][name].get("environment") or {}
        for variable in env if isinstance(env, dict) else [e.split("=", 1)[0] for e in env]:
            if variable.startswith("MOE_L2_"):
                assert variable in read, f"compose.yaml gives {name} {variable}, which it does not read"


def test_a_bad_value_under_an_old_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_L2_POOL_BYTES", "lots")
    with pytest.raises(ValueError, match="pool_bytes"):
        CacheSettings()
