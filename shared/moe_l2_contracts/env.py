"""The environment variables' naming convention, which every service's settings follow.

A service's own setting NAME is `MOE_L2_<SERVICE>_<NAME>`, the prefix its row of the service table
gives (`MOE_L2_PROXY_`, `MOE_L2_LLAMA_`, `MOE_L2_PREDICTOR_`, `MOE_L2_CACHE_`): its port, its
timeouts, its budgets. What several processes must agree on has one stack-wide name `MOE_L2_<NAME>`,
declared with `stack_wide()` so it is never prefixed: the model (`MOE_L2_MODEL_PATH`), the admin
token, the extra domains, the taxonomy, the Redis URL, and the address of a service
(`MOE_L2_<SERVICE>_URL`, the service's prefix again). A service's log level falls back on the
stack-wide `MOE_L2_LOG_LEVEL`.

Names from before the convention (`MOE_L2_POOL_BYTES`, `MOE_L2_API_KEYS`, ...) still work, with a
warning that names the new one: a deployment's old `.env` keeps its budget and its keys instead of
silently falling back to the defaults. The new name wins when both are set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from pydantic import AliasChoices, Field
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

log = logging.getLogger("moe_l2.settings")

PREFIX = "MOE_L2_"
LOG_LEVEL_ENV = "MOE_L2_LOG_LEVEL"


def stack_wide(name: str, **kwargs: Any) -> Any:
    """A setting every process reads under the one name `MOE_L2_<name>` (no service prefix)."""
    return Field(validation_alias=PREFIX + name, **kwargs)


def renamed_before_convention(*fields: str) -> Mapping[str, str]:
    """`renamed_env` of settings whose fields were read as MOE_L2_<FIELD> before the convention."""
    return MappingProxyType({PREFIX + field.upper(): field for field in fields})


def log_level_field(env_prefix: str) -> Any:
    """`<prefix>LOG_LEVEL`, else the stack-wide MOE_L2_LOG_LEVEL, else info."""
    return Field(default="info", validation_alias=AliasChoices(env_prefix + "LOG_LEVEL", LOG_LEVEL_ENV))


class RenamedEnvSource(PydanticBaseSettingsSource):
    """Values under the names a service's settings had before the convention, each with a warning."""

    def __init__(self, settings_cls: type[BaseSettings], renamed: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self.renamed = renamed  # old variable -> field

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads every renamed variable at once

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        prefix = self.settings_cls.model_config.get("env_prefix", "")
        for old, field in self.renamed.items():
            if old in os.environ:
                log.warning("%s is deprecated: set %s%s instead", old, prefix, field.upper())
                values[field] = os.environ[old]
        return values


class ServiceSettings(BaseSettings):
    """A service's settings: `model_config`'s env_prefix is its MOE_L2_<SERVICE>_, `renamed_env` its
    variables from before the convention (old name -> field)."""

    renamed_env: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # after the environment: a variable under its new name wins over its old one
        renamed = RenamedEnvSource(settings_cls, cls.renamed_env)
        return init_settings, env_settings, renamed, dotenv_settings, file_secret_settings
