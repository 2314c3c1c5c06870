"""The domain taxonomy as data: names, one-line definitions, keywords, labeled examples.

The default taxonomy ships as `data/taxonomy.yaml`; `MOE_L2_TAXONOMY_PATH` replaces it (YAML or
JSON, same shape). Every tier of the predictor and the gateway's keyword fallback read it, so a
domain means the same thing everywhere. Only PyYAML (a base dependency) is needed here.

Shape of the file:

```yaml
version: 1
fallback: general_qa            # answered when no evidence points anywhere
domains:
  - name: chinese_tech
    description: one line
    languages: [zh]             # optional: the domain only applies to text in these languages
    absorbs: [codegen, debug]   # optional: in those languages, these domains' evidence is this one's
    keywords: {"代码": 2, "服务器": 2}   # term -> weight (a plain list means weight 1 each)
    patterns: {"\\d+\\s*[-+*/^]\\s*\\d+": 2}   # optional regexes -> weight
    examples: ["帮我写一个 Python 函数 ...", ...]     # fit the TF-IDF and semantic tiers
    calibration: ["...", ...]   # optional, written apart: fit only how the hybrid weighs the tiers
```
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

TAXONOMY_ENV = "MOE_L2_TAXONOMY_PATH"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # a domain name must be a valid X-MoE-Domain tag


class TaxonomyError(ValueError):
    """The taxonomy file is malformed; the message says where."""


@dataclass(frozen=True)
class Domain:
    name: str
    description: str
    keywords: dict[str, float] = field(default_factory=dict)
    patterns: dict[str, float] = field(default_factory=dict)
    examples: tuple[str, ...] = ()
    calibration: tuple[str, ...] = ()
    languages: tuple[str, ...] = ()  # empty: any language
    absorbs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Taxonomy:
    domains: tuple[Domain, ...]
    fallback: str
    source: str = "<memory>"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.domains)

    def domain(self, name: str) -> Domain:
        for d in self.domains:
            if d.name == name:
                return d
        raise KeyError(name)

    def labeled_examples(self) -> list[tuple[str, str]]:
        """(text, domain) for every example, in file order."""
        return [(text, d.name) for d in self.domains for text in d.examples]

    def calibration_prompts(self) -> list[tuple[str, str]]:
        """(text, domain) for every calibration prompt, in file order."""
        return [(text, d.name) for d in self.domains for text in d.calibration]

    def digest(self) -> str:
        """A stable hash of the content (not the path): keys fitted artefacts."""
        payload = {
            "fallback": self.fallback,
            "domains": [
                {
                    "name": d.name,
                    "description": d.description,
                    "keywords": sorted(d.keywords.items()),
                    "patterns": sorted(d.patterns.items()),
                    "examples": list(d.examples),
                    "calibration": list(d.calibration),
                    "languages": list(d.languages),
                    "absorbs": list(d.absorbs),
                }
                for d in self.domains
            ],
        }
        blob = json.dumps(payload, ensure_ascii=False, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def _weights(raw: Any, where: str) -> dict[str, float]:
    if raw is None:
        return {}
    if isinstance(raw, list):
        raw = {str(term): 1.0 for term in raw}
    if not isinstance(raw, dict):
        raise TaxonomyError(f"{where}: expected a mapping term -> weight or a list of terms")
    out: dict[str, float] = {}
    for term, weight in raw.items():
        if not isinstance(weight, int | float) or isinstance(weight, bool) or weight <= 0:
            raise TaxonomyError(f"{where}: weight of {term!r} must be a positive number")
        if not str(term).strip():
            raise TaxonomyError(f"{where}: empty term")
        out[str(term)] = float(weight)
    return out


def _str_tuple(raw: Any, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise TaxonomyError(f"{where}: expected a list of strings")
    return tuple(raw)


def _domain(raw: Any, index: int) -> Domain:
    if not isinstance(raw, dict):
        raise TaxonomyError(f"domains[{index}]: expected a mapping")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise TaxonomyError(f"domains[{index}]: name must match {_NAME.pattern}")
    where = f"domain {name}"
    patterns = _weights(raw.get("patterns"), f"{where}.patterns")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise TaxonomyError(f"{where}.patterns: {pattern!r}: {exc}") from exc
    examples = _str_tuple(raw.get("examples"), f"{where}.examples")
    calibration = _str_tuple(raw.get("calibration"), f"{where}.calibration")
    return Domain(
        name=name,
        description=str(raw.get("description") or ""),
        keywords=_weights(raw.get("keywords"), f"{where}.keywords"),
        patterns=patterns,
        examples=tuple(e for e in examples if e.strip()),
        calibration=tuple(e for e in calibration if e.strip()),
        languages=_str_tuple(raw.get("languages"), f"{where}.languages"),
        absorbs=_str_tuple(raw.get("absorbs"), f"{where}.absorbs"),
    )


def parse_taxonomy(data: Any, source: str = "<memory>") -> Taxonomy:
    """Validate a decoded taxonomy document."""
    if not isinstance(data, dict) or not isinstance(data.get("domains"), list) or not data["domains"]:
        raise TaxonomyError(f"{source}: expected a mapping with a non-empty `domains` list")
    domains = tuple(_domain(raw, i) for i, raw in enumerate(data["domains"]))
    names = [d.name for d in domains]
    if len(set(names)) != len(names):
        raise TaxonomyError(f"{source}: duplicate domain names")
    fallback = data.get("fallback", "general_qa" if "general_qa" in names else names[0])
    if fallback not in names:
        raise TaxonomyError(f"{source}: fallback {fallback!r} is not a domain")
    for d in domains:
        unknown = set(d.absorbs) - set(names)
        if unknown:
            raise TaxonomyError(f"{source}: domain {d.name} absorbs unknown domains {sorted(unknown)}")
    return Taxonomy(domains=domains, fallback=fallback, source=source)


def load_taxonomy(path: str | Path) -> Taxonomy:
    """Read a taxonomy from a YAML or JSON file (JSON is YAML)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TaxonomyError(f"cannot read taxonomy {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise TaxonomyError(f"{path}: not valid YAML/JSON: {exc}") from exc
    return parse_taxonomy(data, source=str(path))


@lru_cache(maxsize=1)
def load_default_taxonomy() -> Taxonomy:
    """The taxonomy shipped with moe-l2 (read once per process; it is immutable)."""
    with resources.as_file(resources.files("moe_l2_domains") / "data" / "taxonomy.yaml") as path:
        return load_taxonomy(path)


def load_configured_taxonomy() -> Taxonomy:
    """`MOE_L2_TAXONOMY_PATH` when set, else the shipped taxonomy."""
    path = os.environ.get(TAXONOMY_ENV)
    return load_taxonomy(path) if path else load_default_taxonomy()
