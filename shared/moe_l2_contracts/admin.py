"""The admin token: what the services' administrative calls require, and where it comes from.

Admin calls change or destroy state: the cache-manager's `POST /v1/pull` and `POST /v1/pool/evict`,
llama-server's `POST /moe/hot-set` and `GET /moe/routing?reset=1` (a reset destroys counts the
flywheel has not pulled yet). They require the header `X-MoE-Admin-Token: <token>`; a separate
header, not `Authorization`, because llama-server's own `--api-key` already owns that one.

The token is `MOE_L2_ADMIN_TOKEN` when set; `moe-l2 up` otherwise creates one at first start in
`<state dir>/admin-token` (mode 0600) and hands it to every service it starts. A service with no
token configured refuses every admin call: nothing is open by default.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

ADMIN_TOKEN_HEADER = "X-MoE-Admin-Token"
ADMIN_TOKEN_ENV = "MOE_L2_ADMIN_TOKEN"
ADMIN_TOKEN_FILE_ENV = "MOE_L2_ADMIN_TOKEN_FILE"
ADMIN_TOKEN_FILENAME = "admin-token"


class AdminTokenError(Exception):
    """The admin token file cannot be read or created; the message is meant for the user."""


def token_matches(presented: str | None, token: str) -> bool:
    """Constant-time comparison; an unconfigured (empty) token matches nothing."""
    if not token or presented is None:
        return False
    return hmac.compare_digest(presented.strip().encode(), token.encode())


def read_token_file(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise AdminTokenError(f"cannot read the admin token file {path}: {exc.strerror or exc}") from exc
    if not token:
        raise AdminTokenError(f"the admin token file {path} is empty")
    return token


def ensure_token_file(path: Path) -> str:
    """The token in `path`, created (32 random bytes, hex, mode 0600) if the file does not exist."""
    if path.exists():
        return read_token_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(32)
    try:
        # O_EXCL: two starts at once never hand out different tokens
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token_file(path)
    except OSError as exc:
        raise AdminTokenError(f"cannot create the admin token file {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return token


def configured_token(environ: dict[str, str] | None = None) -> str:
    """The token a service uses: MOE_L2_ADMIN_TOKEN, else the file MOE_L2_ADMIN_TOKEN_FILE names
    (compose mounts one), else "" (every admin call is refused)."""
    env = os.environ if environ is None else environ
    if token := env.get(ADMIN_TOKEN_ENV, "").strip():
        return token
    if path := env.get(ADMIN_TOKEN_FILE_ENV, "").strip():
        return read_token_file(Path(path))
    return ""
