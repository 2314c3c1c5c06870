"""Configuration of the cache-manager: its own MOE_L2_CACHE_* variables and the stack-wide ones
(moe_l2_contracts.env gives the convention; compose.yaml sets the same)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import ByteSize, Field, field_validator
from pydantic_settings import SettingsConfigDict

from moe_l2_contracts.admin import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, configured_token
from moe_l2_contracts.domains import UNTAGGED, split_domains
from moe_l2_contracts.env import ServiceSettings, log_level_field, renamed_before_convention, stack_wide
from moe_l2_contracts.services import CACHE_MANAGER, LLAMA
from moe_l2_domains.known import known_domains


class CacheSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix=CACHE_MANAGER.env_prefix, extra="ignore", populate_by_name=True)
    renamed_env: ClassVar[Mapping[str, str]] = renamed_before_convention(
        "pool_bytes",
        "pool_lock",
        "hotset_bytes",
        "pull_interval_s",
        "decay",
        "decay_tokens",
        "engine_profile_interval_s",
        "engine_transitions_min_tokens",
        "dwell_s",
        "buffer_max_cells",
        "llama_timeout_s",
        "redis_timeout_s",
    )

    host: str = "127.0.0.1"
    port: int = Field(default=CACHE_MANAGER.port, ge=1, le=65535)
    redis_url: str = stack_wide("REDIS_URL", default="redis://127.0.0.1:6379/0")
    llama_url: str = stack_wide("LLAMA_URL", default_factory=LLAMA.local_url)
    model_path: Path | None = stack_wide(
        "MODEL_PATH", default=None, description="the GGUF llama serves (first shard of a split model)"
    )

    pool_bytes: int = Field(default=8 << 30, ge=0, description="host-memory budget of the expert pool")
    pool_lock: bool = Field(default=True, description="mlock the pinned hot set (else prefetch only)")
    policy: str | None = Field(default=None, description="expert-cache policy; the policy package's default")
    # docs/ram-tier.md
    ram_budget: ByteSize | None = stack_wide(
        "RAM_BUDGET",
        default=None,
        description="the model file's resident memory at most (bytes, or 12GiB / 12G): non-expert tensors locked, "
        "experts kept by the pool's policy, every other expert's pages paged out of llama; overrides "
        "MOE_L2_CACHE_POOL_BYTES",
    )
    llama_replicas: int = stack_wide(
        "LLAMA_REPLICAS",
        default=1,
        ge=1,
        description="llama replicas on this host (compose's scale): the RAM tier needs them to be one",
    )
    # 0.1 s: a quick pass over the 9.5 GB ds-v2-lite shape costs ~45 ms of CPU (a full one ~330 ms, once a
    # second), and llama reads in at most what the disk reads in that time before it is paged out again
    # (the headroom).
    ram_sweep_s: float = Field(default=0.1, gt=0, description="RAM tier: page out the misses this often")
    ram_headroom_bytes: ByteSize | None = Field(
        default=None,
        description="RAM tier: expert bytes left for misses between sweeps; default one token's routed experts "
        "and one layer's every expert, at most a third of the expert budget",
    )
    hotset_bytes: int | None = Field(
        default=None, ge=0, description="byte budget of a domain's hot set; default: the pool budget"
    )

    pull_interval_s: float = Field(
        default=5.0, ge=0, description="pull llama's routing counts this often; 0 = only on demand"
    )
    decay: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="weight old counts keep per MOE_L2_CACHE_DECAY_TOKENS new tokens of a domain",
    )
    decay_tokens: int = Field(default=100_000, ge=1)
    engine_profile_interval_s: float = Field(
        default=30.0, ge=0, description="send the domains' routing priors to llama's expert cache this often; 0 = never"
    )
    engine_transitions_min_tokens: int = Field(
        default=1000,
        ge=0,
        description="tokens a domain must have routed before its learned transitions go to llama's expert cache",
    )
    # docs/cache-manager.md, "The hit curve"
    hit_curve_path: Path | None = Field(
        default=None,
        description="write here the hit curve llama-server's --moe-cache-bytes auto reads at its start "
        "(--moe-cache-hit-curve): the shipped curve's shape through the hit rate llama's expert cache measured "
        "(moe_l2_cache.hit_curve); unset: not written",
    )
    # 1,000,000: the hit rate's standard error. Counted as independent draws it would be sqrt(p(1-p)/n), 0.16
    # points at 100,000 accesses; but a request's accesses are not independent (the cache keeps what its own
    # tokens reuse), and its requests differ: the project's policy replaying 60 ESFT requests of 65 decode tokens
    # (9,875 accesses each) had per-request hit rates of standard deviation 4.7 points at 7 of 64 slots (4.2 at
    # 32), so the pooled rate's standard error is 1.5 points at 100,000 accesses (10 requests) and 0.47 at
    # 1,000,000 (100 requests). The shipped curve climbs 1.7-2.7 points a slot at 6-8 of 64: at 100,000 its 95%
    # interval spans two slots, at 1,000,000 less than one. DeepSeek-V2-Lite makes up to 156 accesses a decode
    # token (26 cached layers x top-6): 1,000,000 is about 6,500 tokens, a minute or two of one replica's decode.
    hit_curve_min_accesses: int = Field(
        default=1_000_000,
        ge=1,
        description="accesses llama's expert cache must count (llamacpp:moe_cache_accesses_total, since the "
        "cache-manager started) before its hit rate calibrates the hit curve: fewer leave the shipped curve",
    )
    # 60 s: llama-server reads the file only when it starts, and the cache-manager reads llama's counters and
    # writes once more when it stops, so between the two the interval only bounds what is lost when the
    # cache-manager crashes or llama restarts (its counters start again from 0: the accesses since the last
    # reading are not counted; at 50-200 tokens/s of decode, 60 s is 0.5-1.8 million accesses). A round is two
    # GETs to llama (/moe/cache, /metrics) and, when the counts moved, a 2 KB file written and fsynced.
    hit_curve_interval_s: float = Field(
        default=60.0, gt=0, description="read llama's cache counters (and write the hit curve) at most this often"
    )
    dwell_s: float = Field(
        default=10.0, ge=0, description="minimum time a domain stays active before another takes over"
    )
    hot_set_scope: Literal["domain", "traffic"] = Field(
        default="domain",
        description="domain: push the active domain's hot set; traffic: the hot set of the domains hinted "
        "recently, each by its decayed share of the hints (a replica serving several domains at once)",
    )
    # 60 s: several dwells (10 s), so a push reflects about a minute of requests rather than the last
    # few (a spill-over burst of a hot domain moves the mix only by its share of that minute), yet a
    # domain the gateway moves to another replica (failover, rebalancing) falls under 10% of the mix
    # log2(10) = 3.3 half-lives after its last hint, about 3 minutes.
    traffic_half_life_s: float = Field(
        default=60.0, gt=0, description="traffic scope: a hint's weight in the mix halves this often"
    )
    buffer_max_cells: int = Field(
        default=1_000_000,
        ge=1,
        description="(domain, layer, expert) and expert-pair counts kept in memory while Redis is down",
    )

    admin_token: str = stack_wide(
        "ADMIN_TOKEN", default="", description="required as X-MoE-Admin-Token by the admin calls, and sent on llama's"
    )
    admin_token_file: Path | None = stack_wide(
        "ADMIN_TOKEN_FILE", default=None, description="a file holding the admin token (compose)"
    )
    extra_domains: str = stack_wide(
        "EXTRA_DOMAINS", default="", description="comma-separated domains accepted beside the taxonomy's"
    )
    log_level: str = log_level_field(CACHE_MANAGER.env_prefix)
    llama_timeout_s: float = Field(default=10.0, gt=0)
    redis_timeout_s: float = Field(default=2.0, gt=0)

    # docs/cache-manager.md, "One cache-manager per llama replica"
    claim_llama: bool = Field(
        default=False,
        description="resolve MOE_L2_LLAMA_URL's host to all its addresses and serve the first one no other "
        "cache-manager has claimed in Redis (docker compose --scale llama=N --scale cache-manager=N)",
    )
    # 15 s: renewed every 5 s, so two renewals may be missed (a Redis blip, a stalled event loop) before
    # the claim lapses, and a replica whose cache-manager died without a word waits at most ~20 s (TTL +
    # one retry of a standby) for another one.
    claim_ttl_s: float = Field(
        default=15.0, ge=1, description="lifetime of the llama claim in Redis; renewed every third of it"
    )
    claim_resolve_timeout_s: float = Field(
        default=60.0, ge=0, description="how long the llama host may fail to resolve before the service gives up"
    )

    @field_validator("hit_curve_path", mode="before")
    @classmethod
    def _empty_path_is_none(cls, value: object) -> object:
        # MOE_L2_CACHE_HIT_CURVE_PATH= (empty, as compose's ${VAR:-}) is unset, not the current folder
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("extra_domains")
    @classmethod
    def _extra_domains_are_valid(cls, value: str) -> str:
        known_domains(split_domains(value))  # ValueError naming the bad ones
        return value

    def configured_admin_token(self) -> str:
        """MOE_L2_ADMIN_TOKEN, else the file MOE_L2_ADMIN_TOKEN_FILE; "" refuses every admin call.
        Raises AdminTokenError when the file cannot be read."""
        return configured_token(
            {ADMIN_TOKEN_ENV: self.admin_token, ADMIN_TOKEN_FILE_ENV: str(self.admin_token_file or "")}
        )

    def accepted_domains(self) -> frozenset[str]:
        """The domains that may become tables: the taxonomy's, the extra ones, and llama's "untagged"."""
        return known_domains(split_domains(self.extra_domains)) | {UNTAGGED}

    def hotset_budget(self) -> int:
        return self.pool_bytes if self.hotset_bytes is None else self.hotset_bytes
