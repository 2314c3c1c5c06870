"""Dockerfiles parsed and checked without an engine: stages, pinned bases, USER, HEALTHCHECK, EXPOSE."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.compose.loading import COMPOSE


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def _logical_lines(text: str) -> list[str]:
    lines, buf = [], ""
    for raw_line in text.splitlines():
        line = raw_line.strip()
        if not line or line.startswith("#"):
            continue  # comments and blank lines, also inside a continuation
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        lines.append((buf + line).strip())
        buf = ""
    if buf.strip():
        lines.append(buf.strip())
    return lines


def _substitute_args(text: str, args: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        default = m.group(2)
        value = args.get(name, "")
        return value if value else (default or "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)", repl, text)


def parse_dockerfile(text: str) -> list[Stage]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "FROM":
            tokens = [t for t in rest.split() if not t.startswith("--")]
            assert tokens, f"FROM without an image: {line}"
            name = tokens[2] if len(tokens) >= 3 and tokens[1].lower() == "as" else None
            stages.append(Stage(_substitute_args(tokens[0], global_args), name))
        elif not stages:
            if instr == "ARG":
                key, _, default = rest.partition("=")
                global_args[key.strip()] = default.strip().strip("\"'")
        else:
            stages[-1].instructions.append((instr, rest))
    assert stages, "no FROM in the Dockerfile"
    return stages


_PINNED_TAG = re.compile(r"\d+\.\d+\.\d+|\d{8}")


def image_is_pinned(image: str) -> bool:
    """`name:tag` with an exact version in the tag (x.y.z or a date), or a digest; never latest."""
    if "@sha256:" in image:
        return True
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return False
    tag = last.rsplit(":", 1)[1]
    return tag != "latest" and bool(_PINNED_TAG.search(tag))


def stage_chain(stages: list[Stage], target: str | None) -> list[Stage]:
    """The target stage (the last one if None) preceded by the stages it is built FROM."""
    by_name = {s.name.lower(): s for s in stages if s.name}
    if target is None:
        stage = stages[-1]
    else:
        assert target.lower() in by_name, f"target {target!r} is not a stage ({sorted(by_name)})"
        stage = by_name[target.lower()]
    chain = [stage]
    while stage.base.lower() in by_name:
        stage = by_name[stage.base.lower()]
        assert stage not in chain, "stages build FROM each other in a cycle"
        chain.insert(0, stage)
    return chain


def _last(chain: list[Stage], instr: str) -> str | None:
    values = [rest for stage in chain for name, rest in stage.instructions if name == instr]
    return values[-1] if values else None


def exec_form(rest: str) -> list[str]:
    rest = rest.strip()
    if rest.startswith("["):
        return [str(x) for x in json.loads(rest)]
    return ["/bin/sh", "-c", rest]


def check_dockerfile(text: str, target: str | None, port: int) -> None:
    stages = parse_dockerfile(text)
    names: set[str] = set()
    for stage in stages:
        base = stage.base.lower()
        assert base in names or image_is_pinned(stage.base), f"FROM {stage.base}: pin an exact tag"
        for instr, rest in stage.instructions:
            if instr in ("COPY", "ADD"):
                for flag in re.findall(r"--from=(\S+)", rest):
                    assert flag.lower() in names or image_is_pinned(flag), f"COPY --from={flag}"
        if stage.name:
            names.add(stage.name.lower())
    chain = stage_chain(stages, target)
    user = _last(chain, "USER")
    assert user, f"target {target or 'last stage'}: no USER (it would run as root)"
    assert user.split(":")[0].strip() not in ("root", "0"), f"USER {user} is root"
    health = _last(chain, "HEALTHCHECK")
    assert health and health.strip().upper() != "NONE", f"target {target or 'last stage'}: no HEALTHCHECK"
    exposed = set()
    for stage in chain:
        for instr, rest in stage.instructions:
            if instr == "EXPOSE":
                exposed |= {p.split("/")[0] for p in rest.split()}
    assert str(port) in exposed, f"target {target or 'last stage'} does not EXPOSE {port}"


def built_services(doc: dict[str, Any]) -> dict[str, tuple[Path, str | None]]:
    out = {}
    for name, service in doc["services"].items():
        build = service.get("build")
        if build is None:
            continue
        if isinstance(build, str):
            build = {"context": build}
        context = (COMPOSE.parent / build.get("context", ".")).resolve()
        out[name] = (context / build.get("dockerfile", "Dockerfile"), build.get("target"))
    return out
