"""The local stack's own settings (`moe-l2 up`): where its state lives, the ports its services are wired
to each other with, how a service that dies is restarted. Read by the stack, by the replicas' builders
(llama_replicas.py), and by `moe-l2 stats` and `doctor`, which find the stack's state through them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from moe_l2_contracts.admin import ADMIN_TOKEN_FILENAME
from moe_l2_contracts.services import CACHE_MANAGER, LLAMA, PROXY
from moe_l2_ops.supervisor import LOG_BACKUPS, LOG_MAX_BYTES, STATE_FILENAME, LogRotation, RestartPolicy


class StackSettings(BaseSettings):
    """Settings of the local stack itself; each service reads its own MOE_L2_* variables too."""

    model_config = SettingsConfigDict(env_prefix="MOE_L2_", extra="ignore")

    redis_host: str = "127.0.0.1"
    redis_port: int = Field(default=6379, ge=1, le=65535)
    state_dir: Path = Field(
        default_factory=lambda: Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "moe-l2",
        description="logs, Redis' append-only file, the generated demo model",
    )
    # the ports the services are wired to each other with (each service reads its own as well)
    llama_port: int = Field(default=LLAMA.port, ge=1, le=65535)
    cache_port: int = Field(default=CACHE_MANAGER.port, ge=1, le=65535)
    proxy_port: int = Field(default=PROXY.port, ge=1, le=65535)
    demo_seed: int = 0
    start_timeout_s: float = Field(default=180.0, gt=0)
    # restarts of a service that dies (see moe_l2_ops.supervisor.RestartPolicy)
    restart_delay_s: float = Field(default=0.5, ge=0, description="delay of the first restart; doubles each time")
    restart_max_delay_s: float = Field(default=30.0, ge=0)
    restart_reset_s: float = Field(default=60.0, ge=0, description="healthy this long: the backoff starts over")
    restart_max_failures: int = Field(default=5, ge=1, description="failures within the window that stop restarts")
    restart_window_s: float = Field(default=300.0, gt=0)
    # each service's log (moe_l2_ops.supervisor.ServiceLog)
    log_max_bytes: int = Field(
        default=LOG_MAX_BYTES, ge=0, description="a service's log rotates at this size; 0: never"
    )
    log_backups: int = Field(default=LOG_BACKUPS, ge=1, description="old log files kept: <name>.log.1 ... .N")

    def log_rotation(self) -> LogRotation:
        return LogRotation(max_bytes=self.log_max_bytes, backups=self.log_backups)

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(
            delay_s=self.restart_delay_s,
            max_delay_s=max(self.restart_max_delay_s, self.restart_delay_s),
            reset_after_s=self.restart_reset_s,
            max_failures=self.restart_max_failures,
            window_s=self.restart_window_s,
        )

    @property
    def state_file(self) -> Path:
        """What the supervisor of `moe-l2 up` writes: every service's state, pid and restarts."""
        return self.state_dir / STATE_FILENAME

    @property
    def admin_token_file(self) -> Path:
        return self.state_dir / ADMIN_TOKEN_FILENAME

    def hit_curve_file(self, model: Path) -> Path:
        """Where the cache-manager writes the hit curve of `model`'s routing (MOE_L2_CACHE_HIT_CURVE_PATH) and
        llama-server's auto placement reads it at the next start: one file per model path, named after the
        file and a hash of its absolute path (two models of one name in two folders do not share a curve)."""
        key = hashlib.sha256(str(model.absolute()).encode()).hexdigest()[:12]
        return self.state_dir / "hit-curves" / f"{model.stem}-{key}.txt"
