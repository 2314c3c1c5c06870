"""Compose files as Compose reads them: YAML with `!reset`/`!override`, merged, interpolated."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
COMPOSE_CPU = ROOT / "compose.cpu.yaml"
COMPOSE_RAM_TIER = ROOT / "compose.ram-tier.yaml"
PROMETHEUS = ROOT / "services" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "services" / "grafana"
# The dashboard's one copy: in the Kustomize base, which reads no file outside its folder; compose mounts it.
DASHBOARDS = ROOT / "deploy" / "kubernetes" / "base" / "dashboards"


class _Reset:
    """Compose's `!reset` tag: the override removes the attribute."""

    def __repr__(self) -> str:
        return "!reset"


RESET = _Reset()


@dataclass
class _Override:
    """Compose's `!override` tag: the override replaces the attribute instead of merging."""

    value: Any


class ComposeLoader(yaml.SafeLoader):
    pass


def _construct_tagged(loader: ComposeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
ComposeLoader.add_constructor("!override", lambda loader, node: _Override(_construct_tagged(loader, node)))


def load_compose_text(text: str) -> dict[str, Any]:
    doc = yaml.load(text, Loader=ComposeLoader)  # a SafeLoader subclass
    assert isinstance(doc, dict), "a compose file is a mapping"
    return doc


def merge(base: Any, override: Any) -> Any:
    """Simple Compose merge: mappings merge key by key, `!reset` removes, anything else replaces."""
    if isinstance(override, _Override):
        return copy.deepcopy(override.value)
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if value is RESET:
                out.pop(key, None)
            else:
                out[key] = merge(out.get(key), value)
        return out
    return copy.deepcopy(override)


_VAR_RE = re.compile(r"\$(?:(\$)|\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_BRACED_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?$", re.S)


def _interpolate_str(text: str, env: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        if m.group(1):  # "$$" is a literal "$"
            return "$"
        if m.group(3):
            return env.get(m.group(3), "")
        braced = _BRACED_RE.match(m.group(2))
        assert braced, f"bad interpolation ${{{m.group(2)}}}"
        name, op, arg = braced.groups()
        value = env.get(name)
        if op is None:
            return value or ""
        empty_counts = op.startswith(":")
        missing = value is None or (empty_counts and value == "")
        if op.endswith("-"):
            return _interpolate_str(arg, env) if missing else value
        if op.endswith("?"):
            assert not missing, f"required variable {name} is not set: {arg}"
            return value
        return "" if missing else _interpolate_str(arg, env)  # ":+" / "+"

    return _VAR_RE.sub(repl, text)


def interpolate(value: Any, env: dict[str, str] | None = None) -> Any:
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):
        return _interpolate_str(value, env)
    return value


def variables(text: str) -> dict[str, str | None]:
    """Every variable a compose file reads, with its default operator (None: no default)."""
    found: dict[str, str | None] = {}
    for m in _VAR_RE.finditer(text):
        if m.group(3):
            found[m.group(3)] = None
        elif m.group(2) is not None:
            braced = _BRACED_RE.match(m.group(2))
            assert braced, f"bad interpolation ${{{m.group(2)}}}"
            found[braced.group(1)] = braced.group(2)
    return found
