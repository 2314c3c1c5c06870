"""llama's domain tags come from the taxonomy, said once (issue 47).

The llama image ships the taxonomy (shared/moe_l2_domains/data/taxonomy.yaml) and moe-l2-domains
(services/llama/docker/), which lists its domains; llama's entrypoint, compose's and the Kubernetes base's
alike, sets --moe-domains (LLAMA_ARG_MOE_DOMAINS) from it plus MOE_L2_EXTRA_DOMAINS, as `moe-l2 up` sets it
from moe_l2_domains.known_domains(). No compose file and no manifest carries a copy of the list.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from moe_l2_domains.known import known_domains
from moe_l2_domains.taxonomy import TAXONOMY_ENV, load_default_taxonomy, load_taxonomy
from moe_l2_placement.hit_curve import DEFAULT_HIT_CURVE
from tests.compose.checks import DOMAINS_LINE, DOMAINS_SCRIPT, TAXONOMY_FILE
from tests.compose.loading import COMPOSE, ROOT, load_compose_text
from tests.kubernetes.rendering import TARGETS, containers, env, kubelet_expand, render

DOCKERFILE = ROOT / "services" / "llama" / "Dockerfile"
RUNTIME_STAGES = ("cpu", "cuda")
# Where a copy of the list would be: every compose file and every file of the Kustomize tree.
DEPLOYMENT_FILES = sorted(ROOT.glob("compose*.yaml")) + sorted(
    p for p in (ROOT / "deploy" / "kubernetes").rglob("*") if p.is_file()
)


def list_domains(taxonomy: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(DOMAINS_SCRIPT), str(taxonomy)], capture_output=True, text=True, timeout=30)


def test_the_image_lists_the_domains_moe_l2_up_gives_llama(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TAXONOMY_ENV, raising=False)
    monkeypatch.delenv("MOE_L2_EXTRA_DOMAINS", raising=False)
    assert load_taxonomy(TAXONOMY_FILE).names == load_default_taxonomy().names, "not the shipped taxonomy"
    done = list_domains(TAXONOMY_FILE)
    assert done.returncode == 0, done.stderr
    # moe_l2_llama.command_line.llama_server_env's list, which `moe-l2 up` hands llama-server
    assert done.stdout == ",".join(sorted(known_domains())) + "\n"


def test_the_domains_of_another_taxonomy(tmp_path: Path) -> None:
    """The shipped file's layout: a `- name: TAG` line per domain; names that sort apart in a C locale only."""
    taxonomy = tmp_path / "taxonomy.yaml"
    taxonomy.write_text(
        "version: 1\nfallback: b_q\ndomains:\n"
        "- name: b_q\n  description: one\n  keywords:\n    name: 2\n"
        "- name: B-2\n  description: two\n"
        "- name: a.1\n  description: three\n"
    )
    assert load_taxonomy(taxonomy).names == ("b_q", "B-2", "a.1")
    done = list_domains(taxonomy)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ",".join(sorted(load_taxonomy(taxonomy).names)) + "\n"


def test_no_taxonomy_no_domains(tmp_path: Path) -> None:
    """llama's entrypoint stops (`|| exit 1`) rather than start a llama-server that refuses every tag."""
    missing = list_domains(tmp_path / "nope.yaml")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.startswith("moe-l2-domains: no taxonomy at")
    empty = tmp_path / "empty.yaml"
    empty.write_text("version: 1\ndomains: []\n")
    done = list_domains(empty)
    assert done.returncode == 1 and done.stdout == "" and "no '- name: TAG' line" in done.stderr


def _stages(text: str) -> dict[str, list[str]]:
    """The Dockerfile's instructions (continuations joined) by stage name."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if m := re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, flags=re.IGNORECASE):
            current = stages.setdefault(m.group(1), [])
        elif line.strip() and not line.startswith("#"):
            current.append(line.strip())
    return stages


@pytest.mark.parametrize("stage", RUNTIME_STAGES)
def test_every_llama_image_ships_the_script_and_its_taxonomy(stage: str) -> None:
    """Where the tests put them (tests/compose/checks.py, install_llama_image_files): the script in a folder
    on PATH, the taxonomy in ../share/moe-l2 from it."""
    lines = _stages(DOCKERFILE.read_text())[stage]
    copies = {}
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            *_, source, target = line.split()
            copies[source] = target
    script = copies.get(str(DOMAINS_SCRIPT.relative_to(ROOT)))
    taxonomy = copies.get(str(TAXONOMY_FILE.relative_to(ROOT)))
    assert script and taxonomy, f"the {stage} image lacks moe-l2-domains or the taxonomy: {copies}"
    bin_dir = Path(script).parent
    assert Path(script).name == "moe-l2-domains"
    assert Path(taxonomy) == bin_dir.parent / "share" / "moe-l2" / "taxonomy.yaml"
    assert any(re.match(rf"ENV PATH={re.escape(str(bin_dir))}:", line) for line in lines), f"{bin_dir} not on PATH"
    assert "--chmod=0755" in next(line for line in lines if str(DOMAINS_SCRIPT.relative_to(ROOT)) in line)


def _runs_of_names(text: str, names: frozenset[str], length: int = 3) -> list[str]:
    words = re.findall(r"[A-Za-z0-9][A-Za-z0-9_.-]*", text)
    return [
        " ".join(words[i : i + length])
        for i in range(len(words) - length + 1)
        if all(w in names for w in words[i : i + length])
    ]


@pytest.mark.parametrize("path", DEPLOYMENT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_copy_of_the_taxonomys_domains(path: Path) -> None:
    """Three of the taxonomy's names in a row (a comma-separated list, a YAML list) would be a copy that
    goes stale when the taxonomy changes: llama's entrypoint reads them from the image instead."""
    names = frozenset(load_default_taxonomy().names)
    assert len(names) >= 3
    found = _runs_of_names(path.read_text(errors="replace"), names)
    assert not found, f"{path.relative_to(ROOT)} lists the taxonomy's domains: {found[0]}"
    assert not re.search(r"LLAMA_ARG_MOE_DOMAINS\s*:|name:\s*LLAMA_ARG_MOE_DOMAINS\b", path.read_text()), (
        f"{path.relative_to(ROOT)} sets LLAMA_ARG_MOE_DOMAINS: llama's entrypoint does"
    )


def test_the_copy_check_finds_a_copy() -> None:
    names = frozenset(load_default_taxonomy().names)
    listed = ",".join(sorted(names))
    assert _runs_of_names(f"      LLAMA_ARG_MOE_DOMAINS: {listed}\n", names)
    assert _runs_of_names("domains:\n" + "".join(f"  - {n}\n" for n in sorted(names)), names)
    assert not _runs_of_names("# debug logging, the logic of it, and math to translate\n", names)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_kubernetes_llama_reads_the_domains_from_its_image(target: str) -> None:
    container, _ = containers(render(target))["llama"]
    variables = env(container)
    assert "LLAMA_ARG_MOE_DOMAINS" not in variables, "a copy of the taxonomy's domains"
    script = "\n".join(kubelet_expand(a, variables) for a in container["command"])
    assert DOMAINS_LINE in script, "llama's command does not set the domains from the image"
    assert "MOE_L2_EXTRA_DOMAINS" in variables


@pytest.mark.parametrize("stage", RUNTIME_STAGES)
def test_every_llama_image_ships_the_hit_curve_where_the_launchers_point(stage: str) -> None:
    """--moe-cache-bytes auto's prior (--moe-cache-hit-curve): the file compose and Kubernetes name is the one
    the image copies from moe_l2_placement's shipped curve."""
    copies = {}
    for line in _stages(DOCKERFILE.read_text())[stage]:
        if line.startswith("COPY ") and "--from=" not in line:
            *_, source, target = line.split()
            copies[source] = target
    shipped = copies.get(str(DEFAULT_HIT_CURVE.relative_to(ROOT)))
    assert shipped, f"the {stage} image lacks the shipped hit curve: {copies}"
    compose_env = load_compose_text(COMPOSE.read_text())["services"]["llama"]["environment"]
    assert compose_env["LLAMA_ARG_MOE_CACHE_HIT_CURVE"] == shipped
    for target in sorted(TARGETS):
        container, _ = containers(render(target))["llama"]
        assert env(container)["LLAMA_ARG_MOE_CACHE_HIT_CURVE"] == shipped, target
