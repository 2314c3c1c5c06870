"""Local stand-ins for the public base images, under their exact names: no image registry is
reachable here, and compose.yaml and the Dockerfiles name the public images.

The base is Debian itself: `debootstrap --variant=minbase` into a folder, the host's extra CA
certificates added (the machines reach PyPI and Debian through a TLS proxy whose CA the host
trusts: without it pip inside a build fails with CERTIFICATE_VERIFY_FAILED), then `docker import`.
Each stand-in is that base plus Debian's package of the same program (python3, redis-server,
prometheus), with the entrypoint the official image has. Versions differ from the public images
(Debian bookworm ships Python 3.11, Redis 7.0, Prometheus 2.42): the test checks the project's
images and compose file, not those programs. Grafana has no Debian package and no stand-in.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .engine import Engine, EngineError, run

HERE = Path(__file__).resolve().parent / "standins"
BASE_IMAGE = "moe-l2-standin/debian:bookworm"
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")


@dataclass(frozen=True)
class StandIn:
    """A public image name and the Dockerfile under standins/ that builds its stand-in."""

    image: str
    dockerfile: str


# The public names compose.yaml and the Dockerfiles' build arguments default to (test_dockerfiles checks
# that these are the names they use).
PYTHON = StandIn("python:3.12.8-slim-bookworm", "python.Dockerfile")
REDIS = StandIn("redis:7.4.2-alpine", "redis.Dockerfile")
PROMETHEUS = StandIn("prom/prometheus:v3.1.0", "prometheus.Dockerfile")
STANDINS = (PYTHON, REDIS, PROMETHEUS)
# Only for the CUDA builder check (cuda_builder.py), not the suite.
CUDA_DEVEL = StandIn("nvidia/cuda:13.0.1-devel-ubuntu24.04", "cuda-devel.Dockerfile")


def debian_mirror() -> str:
    """The Debian mirror apt on this host uses (the machines reach no other)."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if line.startswith("URIs:") and len(words) > 1 and "security" not in words[1]:
                return words[1]
            if words[:1] == ["deb"] and "security" not in line:
                url = next((w for w in words[1:] if "://" in w), None)
                if url:
                    return url
    return DEFAULT_MIRROR


def image_exists(engine: Engine, name: str) -> bool:
    return engine.docker("image", "inspect", name, check=False, timeout=30).returncode == 0


def ensure_base(engine: Engine, timings: dict[str, float]) -> None:
    """Imports the debootstrapped Debian base unless the engine has it already."""
    if image_exists(engine, BASE_IMAGE):
        return
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moe-l2-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(
            ["debootstrap", "--variant=minbase", "--include=ca-certificates", SUITE, str(rootfs), debian_mirror()],
            timeout=900,
        )
        _trust_host_cas(rootfs)
        # As Debian's official images do: a package's postinst never starts its service in a build.
        policy = rootfs / "usr/sbin/policy-rc.d"
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            engine.docker("import", "-", BASE_IMAGE, stdin=tar.stdout, capture_output=True, timeout=600)
        finally:
            tar.stdout.close()
            if tar.wait() != 0:
                raise EngineError(f"tar of {rootfs} exited {tar.returncode}")
    timings["base_image_s"] = round(time.monotonic() - started, 1)


def _trust_host_cas(rootfs: Path) -> None:
    target = rootfs / "usr/local/share/ca-certificates"
    target.mkdir(parents=True, exist_ok=True)
    for cert in HOST_CA_DIR.glob("*.crt"):
        shutil.copy2(cert, target / cert.name)
    run(["chroot", str(rootfs), "update-ca-certificates"], timeout=120)


def build_standins(engine: Engine, timings: dict[str, float], standins: tuple[StandIn, ...] = STANDINS) -> None:
    """Builds each stand-in under its public name (layers cached: a second run takes seconds)."""
    ensure_base(engine, timings)
    started = time.monotonic()
    for standin in standins:
        engine.docker(
            "build",
            "--network=host",
            "--build-arg",
            f"BASE={BASE_IMAGE}",
            "-t",
            standin.image,
            "-f",
            str(HERE / standin.dockerfile),
            str(HERE),
            timeout=900,
        )
    timings["standin_images_s"] = round(time.monotonic() - started, 1)
