"""Redis key names of the routing flywheel, namespaced by model id (a hash of the GGUF's tables).

    moe:{model}:routing:{domain}:{layer}   hash  expert id -> (decayed) activations
    moe:{model}:transitions:{domain}:{layer}  hash  "a:b" -> tokens with expert a at layer, b at layer+1
    moe:{model}:tokens                     hash  domain -> tokens routed (not decayed)
    moe:{model}:domains                    set   every domain with counts
    moe:{model}:hotset:{domain}            str   JSON of the domain's hot set (schemas.cache.HotSetResponse)
    moe:{model}:active                     hash  the active domain and when it became active
    moe:{model}:meta                       hash  what the id stands for (arch, file, experts, layers)
    moe:{model}:flushed:{batch}            str   marks a batch of counts as written (expires after a day)
    moe:{model}:quarantine:{rest}          any   a key of the wrong type, moved aside (never read)
    moe:{model}:llama-claim:{host}:{port}  str   the cache-manager serving that llama replica (expires; claim.py)

Domain tags are `[A-Za-z0-9_.:-]+`; the layer is always the last component of a routing or
transitions key, so a tag containing ':' still parses.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "moe"
# The hot set computed from every domain's counts together (the "global" hot set).
GLOBAL_DOMAIN = "_global"


@dataclass(frozen=True)
class RedisKeys:
    model: str

    @property
    def base(self) -> str:
        return f"{PREFIX}:{self.model}"

    def routing(self, domain: str, layer: int) -> str:
        return f"{self.base}:routing:{domain}:{layer}"

    def transitions(self, domain: str, layer: int) -> str:
        """The counts of expert pairs (a at `layer`, b at `layer` + 1) of one domain's tokens."""
        return f"{self.base}:transitions:{domain}:{layer}"

    @property
    def tokens(self) -> str:
        return f"{self.base}:tokens"

    @property
    def domains(self) -> str:
        return f"{self.base}:domains"

    def hotset(self, domain: str) -> str:
        return f"{self.base}:hotset:{domain}"

    @property
    def active(self) -> str:
        return f"{self.base}:active"

    @property
    def meta(self) -> str:
        return f"{self.base}:meta"

    def flushed(self, batch_id: str) -> str:
        return f"{self.base}:flushed:{batch_id}"

    def llama_claim(self, hostport: str) -> str:
        """The claim on one llama replica (an address and port: `10.0.0.3:11436`, `[::1]:11436`)."""
        return f"{self.base}:llama-claim:{hostport}"

    def quarantine(self, key: str) -> str:
        """Where a key of this model that holds the wrong type is moved aside."""
        return f"{self.base}:quarantine:{key.removeprefix(self.base + ':')}"

    def parse_routing(self, key: str) -> tuple[str, int] | None:
        """(domain, layer) of a routing key of this model, None for any other key."""
        return self._parse_layer_key(key, "routing")

    def parse_transitions(self, key: str) -> tuple[str, int] | None:
        """(domain, layer) of a transitions key of this model, None for any other key."""
        return self._parse_layer_key(key, "transitions")

    def _parse_layer_key(self, key: str, section: str) -> tuple[str, int] | None:
        head = f"{self.base}:{section}:"
        if not key.startswith(head):
            return None
        domain, _, layer = key[len(head) :].rpartition(":")
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses
        if not domain or not (layer.isascii() and layer.isdigit()) or len(layer) > 9:
            return None
        return domain, int(layer)

    def section(self, key: str) -> tuple[str, str]:
        """(section, rest) of a key of this model: ("routing", "math:3"), ("domains", ""), ...;
        ("", key) for a key outside the model's prefix."""
        head = f"{self.base}:"
        if not key.startswith(head):
            return "", key
        section, _, rest = key[len(head) :].partition(":")
        return section, rest
