"""The domain tags every service agrees on: their names, their syntax, and which ones a request may use.

The predictor owns the full taxonomy (descriptions, keywords, examples); this module holds only
what every service needs to agree on, so a domain tag means the same thing everywhere.

Why a closed set: every distinct tag becomes a label set in llama's telemetry, a Redis domain and
a routing table per layer, all persisted. When any header value became a tag, 30 client header
values grew the Redis routing hashes from 104 to 344. So only the taxonomy's domains, plus those
an operator lists in MOE_L2_EXTRA_DOMAINS, are accepted; anything else is a 400 at the gateway
and is refused or skipped by every service behind it.
"""

from __future__ import annotations

import re

DEFAULT_DOMAINS: tuple[str, ...] = (
    "codegen",
    "debug",
    "math",
    "logic",
    "general_qa",
    "creative_write",
    "translate",
    "chinese_tech",
)

# Requests that carry no domain tag are counted under this one by the llama-server telemetry.
UNTAGGED = "untagged"

# Names starting with this are the services' own (e.g. the cache-manager's "_global" table of
# every domain together); no request may use one as its tag.
RESERVED_PREFIX = "_"

# The syntax of a tag: what llama-server's patch and the cache-manager accept.
DOMAIN_TAG = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

EXTRA_DOMAINS_ENV = "MOE_L2_EXTRA_DOMAINS"


def is_reserved(tag: str) -> bool:
    return tag.startswith(RESERVED_PREFIX)


def is_valid_tag(tag: str) -> bool:
    """Well-formed and not reserved (says nothing about whether the tag is a known domain)."""
    return bool(DOMAIN_TAG.match(tag)) and not is_reserved(tag)


def split_domains(value: str) -> tuple[str, ...]:
    """A comma-separated list of domain names, blanks dropped."""
    return tuple(item.strip() for item in value.split(",") if item.strip())
