"""The images' Dockerfiles and .dockerignore, read statically against the compose file."""

from __future__ import annotations

import re
import tomllib
from typing import Any

import pytest

from tests.compose.checks import CUDA_ARCHITECTURES, EXTRAS, ONE_SHOT, PORTS, PYTHON_SERVICES
from tests.compose.dockerfiles import _last, built_services, check_dockerfile, exec_form, parse_dockerfile, stage_chain
from tests.compose.loading import ROOT
from tests.compose.shapes import as_argv, healthcheck_argv


def test_dockerfiles(doc: dict[str, Any], doc_cpu: dict[str, Any]) -> None:
    built = [(name, *spec) for name, spec in built_services(doc).items()]
    built.append(("llama", *built_services(doc_cpu)["llama"]))
    built = [b for b in built if b[0] not in ONE_SHOT]  # it runs the proxy's image (check_admin_token)
    assert {name for name, _, _ in built} == {"proxy", "predictor", "cache-manager", "llama"}
    for name, dockerfile, target in built:
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        check_dockerfile(dockerfile.read_text(), target, PORTS[name])
    referenced = {dockerfile for _, dockerfile, _ in built}
    for dockerfile in ROOT.glob("services/*/Dockerfile"):
        assert dockerfile.resolve() in referenced, f"{dockerfile} is built by no service"


@pytest.mark.parametrize("service", sorted(PYTHON_SERVICES))
def test_python_dockerfiles(service: str, doc: dict[str, Any]) -> None:
    text = (ROOT / "services" / service / "Dockerfile").read_text()
    assert "pip wheel --no-deps --no-build-isolation" in text, "the image installs the wheel built from the repository"
    assert f"[{EXTRAS[service]}]" in text, f"the image installs moe-l2[{EXTRAS[service]}]"
    stages = parse_dockerfile(text)
    assert len(stages) >= 2, "multi-stage: build in one stage, run from a clean one"
    cmd = exec_form(_last(stage_chain(stages, None), "CMD") or "[]")
    assert cmd == ["python", "-m", PYTHON_SERVICES[service]] == as_argv(doc["services"][service]["command"])
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert EXTRAS[service] in extras


def _pip_installs(text: str) -> list[str]:
    """Every `pip install` of the Dockerfile's RUN instructions, with its arguments."""
    runs = [rest for stage in parse_dockerfile(text) for instr, rest in stage.instructions if instr == "RUN"]
    return [m.group(0) for run in runs for m in re.finditer(r"pip install\b[^;&|]*", run)]


def test_pip_installs_come_from_the_lock_files() -> None:
    """Each Python image installs its extra's lock with --require-hashes (the lock file COPYed first,
    in a layer of its own), and nothing else that pip would resolve: the wheel goes in --no-deps."""
    for service, extra in EXTRAS.items():
        text = (ROOT / "services" / service / "Dockerfile").read_text()
        lock = f"requirements/{extra}.txt"
        assert (ROOT / lock).is_file(), lock
        installs = _pip_installs(text)
        hashed = [i for i in installs if "--require-hashes" in i]
        assert hashed and all(f"-r {lock}" in i for i in hashed), f"{service}: {installs}"
        assert all("--require-hashes" in i or "--no-deps" in i for i in installs), f"{service}: {installs}"
        # the lock is in the image before the install that reads it, and before the source
        copies = [rest for stage in parse_dockerfile(text) for instr, rest in stage.instructions if instr == "COPY"]
        at = next(i for i, rest in enumerate(copies) if lock in rest.split())
        assert at < copies.index(". ."), f"{service}: the lock is COPYed after the source"


def test_a_pip_install_outside_the_lock_is_caught() -> None:
    text = (ROOT / "services" / "proxy" / "Dockerfile").read_text()
    assert len(_pip_installs(text)) == 2
    unlocked = text.replace('--no-deps "$(ls', '"$(ls')
    assert any("--require-hashes" not in i and "--no-deps" not in i for i in _pip_installs(unlocked))


def test_predictor_torch_cpu_or_cuda() -> None:
    """torch comes from the lock: with TORCH_FIND_LINKS the local CPU build (torch-cpu.txt selects
    it), without it PyPI's and its CUDA libraries (torch-cuda.txt); no version of its own."""
    text = (ROOT / "services" / "predictor" / "Dockerfile").read_text()
    assert "TORCH_VERSION" not in text and "torch==" not in text
    (install,) = _pip_installs(text)[:1]
    run = next(rest for stage in parse_dockerfile(text) for instr, rest in stage.instructions if install in rest)
    assert re.search(
        r'-n "\$TORCH_FIND_LINKS" \]; then\s+set -- --find-links "\$TORCH_FIND_LINKS" -c requirements/torch-cpu.txt;',
        run,
    )
    assert "else set -- -r requirements/torch-cuda.txt;" in re.sub(r"\s+", " ", run)
    for name in ("torch-cpu", "torch-cuda"):
        assert (ROOT / "requirements" / f"{name}.txt").is_file()


def test_llama_dockerfile(doc: dict[str, Any]) -> None:
    text = (ROOT / "services" / "llama" / "Dockerfile").read_text()
    stages = parse_dockerfile(text)
    runs = {s.name: " ".join(r for i, r in s.instructions if i == "RUN") for s in stages}
    cuda_build = stage_chain(stages, "cuda")[-1]
    cuda_src = next(re.search(r"--from=(\S+)", r).group(1) for i, r in cuda_build.instructions if i == "COPY")
    assert "build.py --cuda" in runs[cuda_src] and "--cuda-architectures" in runs[cuda_src]
    assert "build.py" in runs["build-cpu"] and "--cuda" not in runs["build-cpu"]
    for stage in ("build-cpu", cuda_src):
        assert "--portable" in runs[stage], f"{stage}: an image must not be tuned for the build machine's CPU"
    assert (ROOT / "services" / "llama" / "moe_l2_llama" / "build.py").is_file()
    arch_arg = re.search(r'ARG CUDA_ARCHITECTURES="?([0-9;]+)', text)
    assert arch_arg and set(arch_arg.group(1).split(";")) >= CUDA_ARCHITECTURES
    compose_arch = doc["services"]["llama"]["build"]["args"]["CUDA_ARCHITECTURES"]
    assert set(compose_arch.split(";")) >= CUDA_ARCHITECTURES
    for target in ("cuda", "cpu"):
        chain = stage_chain(stages, target)
        assert exec_form(_last(chain, "ENTRYPOINT") or "[]") == ["llama-server"]
        assert "curl" in " ".join(r for s in chain for i, r in s.instructions if i == "RUN"), "no curl"
    assert healthcheck_argv(doc["services"]["llama"])[1] == "curl"
    assert stages[-1].name == "cuda", "a plain `docker build` gives the GPU image"


def _dockerignore_excludes(patterns: list[str], path: str) -> bool:
    def regex(pattern: str) -> re.Pattern[str]:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out)

    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        rx = regex(pattern.lstrip("!").strip("/"))
        if any(rx.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for needed in (
        "pyproject.toml",
        "README.md",
        "shared/moe_l2_contracts/__init__.py",
        "ops/moe_l2_ops/__init__.py",
        "services/proxy/moe_l2_proxy/__init__.py",
        "services/predictor/moe_l2_predictor/__init__.py",
        "services/cache-manager/moe_l2_cache/__init__.py",
        "services/llama/moe_l2_llama/build.py",
        "services/llama/docker/moe-l2-domains",
        "shared/moe_l2_domains/data/taxonomy.yaml",
        "shared/moe_l2_placement/data/hit-curve-default.txt",
        "services/llama/patches/0001-ubatch-seqs.patch",
        "requirements/proxy.txt",
        "requirements/cache.txt",
        "requirements/predictor.txt",
        "requirements/torch-cpu.txt",
        "requirements/torch-cuda.txt",
    ):
        assert not _dockerignore_excludes(patterns, needed), f".dockerignore drops {needed}"
    for dropped in (".git/HEAD", ".venv/bin/python", "models/model.gguf", "x/__pycache__/y.pyc"):
        assert _dockerignore_excludes(patterns, dropped), f".dockerignore sends {dropped}"
