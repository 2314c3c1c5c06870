"""The error body of moe-l2's internal services (the predictor and the cache-manager).

    {"error": {"type": "not_found", "message": "no routing counts for this domain yet",
               "details": [{"loc": ["body", "domain"], "msg": "...", "type": "..."}]}}

`type` is a short machine-readable kind, `message` one line for a person, `details` only for a
request that does not match its schema (where and why, never the input: a body may hold a
secret). The gateway answers its clients in OpenAI's and Ollama's own formats instead
(`schemas/openai.py`, `schemas/ollama.py`).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

# The kind of an error from its HTTP status, where the raiser gave no more precise one.
KIND_BY_STATUS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    413: "too_large",
    422: "invalid_request",
    503: "unavailable",
}


class ValidationDetail(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ServiceErrorDetail(BaseModel):
    type: str = Field(description="machine-readable kind: invalid_request, not_found, unavailable, ...")
    message: str
    details: list[ValidationDetail] | None = Field(default=None, description="only for a schema mismatch")


class ServiceError(BaseModel):
    error: ServiceErrorDetail


def error_body(status: int, message: str, kind: str | None = None, details: list[dict] | None = None) -> dict:
    """The JSON of a ServiceError (details left out when there are none)."""
    error = ServiceErrorDetail(
        type=kind or KIND_BY_STATUS.get(status, "internal" if status >= 500 else "bad_request"),
        message=message,
        details=[ValidationDetail(**d) for d in details] if details else None,
    )
    return ServiceError(error=error).model_dump(exclude_none=True)
