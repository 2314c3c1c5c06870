"""Configuration of the cache-manager, from MOE_L2_* environment variables (compose.yaml sets the same)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CacheSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MOE_L2_", extra="ignore")

    cache_host: str = "127.0.0.1"
    cache_port: int = Field(default=11438, ge=1, le=65535)
    redis_url: str = "redis://127.0.0.1:6379/0"
    llama_url: str = "http://127.0.0.1:11436"
    model_path: Path | None = Field(default=None, description="the GGUF llama serves (first shard of a split model)")

    pool_bytes: int = Field(default=8 << 30, ge=0, description="host-memory budget of the expert pool")
    pool_lock: bool = Field(default=True, description="mlock the pinned hot set (else prefetch only)")
    cache_policy: str | None = Field(default=None, description="expert-cache policy; the policy package's default")
    hotset_bytes: int | None = Field(
        default=None, ge=0, description="byte budget of a domain's hot set; default: the pool budget"
    )

    pull_interval_s: float = Field(
        default=5.0, ge=0, description="pull llama's routing counts this often; 0 = only on demand"
    )
    decay: float = Field(
        default=0.5, gt=0, le=1, description="weight old counts keep per MOE_L2_DECAY_TOKENS new tokens of a domain"
    )
    decay_tokens: int = Field(default=100_000, ge=1)
    dwell_s: float = Field(
        default=10.0, ge=0, description="minimum time a domain stays active before another takes over"
    )
    buffer_max_cells: int = Field(
        default=1_000_000, ge=1, description="(domain, layer, expert) counts kept in memory while Redis is down"
    )

    admin_token: str | None = Field(default=None, description="required (Bearer) by the admin endpoints when set")
    log_level: str = "info"
    llama_timeout_s: float = Field(default=10.0, gt=0)
    redis_timeout_s: float = Field(default=2.0, gt=0)

    def hotset_budget(self) -> int:
        return self.pool_bytes if self.hotset_bytes is None else self.hotset_bytes
