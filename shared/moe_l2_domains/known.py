"""The domains requests may be tagged with: the configured taxonomy's names plus the operator's extras.

The tag syntax and the reserved prefix are contracts (moe_l2_contracts.domains); which names are
known depends on the taxonomy the predictor serves, so it lives here, beside the taxonomy.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from moe_l2_contracts.domains import EXTRA_DOMAINS_ENV, RESERVED_PREFIX, is_valid_tag, split_domains
from moe_l2_domains.taxonomy import load_configured_taxonomy


def known_domains(extra: Iterable[str] | None = None) -> frozenset[str]:
    """The domains requests may be tagged with: the configured taxonomy's names plus `extra`
    (default: MOE_L2_EXTRA_DOMAINS). Invalid or reserved names in `extra` raise ValueError."""
    if extra is None:
        extra = split_domains(os.environ.get(EXTRA_DOMAINS_ENV, ""))
    extra = tuple(extra)
    bad = [name for name in extra if not is_valid_tag(name)]
    if bad:
        raise ValueError(
            f"{EXTRA_DOMAINS_ENV}: {', '.join(repr(b) for b in bad)} not valid domain names "
            f"(1 to 64 characters of [A-Za-z0-9_.:-], not starting with '{RESERVED_PREFIX}')"
        )
    return frozenset(load_configured_taxonomy().names) | frozenset(extra)
