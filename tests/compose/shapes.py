"""Reading a service's fields whatever form Compose allows (lists or mappings, short or long syntax)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def as_dict(value: Any) -> dict[str, Any]:
    """`environment`, `labels`, ...: a mapping or a list of KEY=VALUE."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): ("" if v is None else str(v)) for k, v in value.items()}
    out = {}
    for item in value:
        key, _, val = str(item).partition("=")
        out[key] = val
    return out


def as_argv(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return value.split()
    return [str(v) for v in value]


def flag_value(argv: list[str], *flags: str) -> str:
    for i, arg in enumerate(argv[:-1]):
        if arg in flags:
            return argv[i + 1]
    raise AssertionError(f"the command lacks {flags[0]}: {argv}")


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool
    kind: str  # bind | volume


def mounts(service: dict[str, Any]) -> list[Mount]:
    out = []
    for item in service.get("volumes", []):
        if isinstance(item, dict):
            source, target = str(item.get("source", "")), str(item["target"])
            read_only = bool(item.get("read_only", False))
            kind = str(item.get("type", "volume"))
        else:
            parts = str(item).split(":")
            source, target = (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])
            modes = parts[2].split(",") if len(parts) > 2 else []
            read_only = "ro" in modes
            kind = "bind" if source.startswith((".", "/", "~")) else "volume"
        out.append(Mount(source, target, read_only, kind))
    return out


@dataclass(frozen=True)
class Port:
    host_ip: str  # "" = every interface
    published: str
    target: int


def published_ports(service: dict[str, Any]) -> list[Port]:
    out = []
    for item in service.get("ports", []):
        if isinstance(item, dict):
            out.append(Port(str(item.get("host_ip", "")), str(item.get("published", "")), int(item["target"])))
            continue
        spec = str(item).split("/", 1)[0]
        parts = spec.rsplit(":", 2)
        if len(parts) == 3:
            out.append(Port(parts[0].strip("[]"), parts[1], int(parts[2])))
        elif len(parts) == 2:
            out.append(Port("", parts[0], int(parts[1])))
        else:
            out.append(Port("", "", int(parts[0])))
    return out


def healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = (service.get("healthcheck") or {}).get("test")
    if isinstance(test, str):
        return ["CMD-SHELL", test]
    return [str(t) for t in test or []]
