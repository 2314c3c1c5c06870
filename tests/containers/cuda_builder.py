"""The llama image's CUDA builder stage, compiled on a machine without a GPU or a registry.

    python -m tests.containers.cuda_builder [--arch 90] [--jobs N]

A one-off check, not part of the suite (a full compile takes about half an hour on 2 cores): the
private engine of the container test, a stand-in for nvidia/cuda:13.0.1-devel-ubuntu24.04 (the CUDA
13.0.1 toolkit from NVIDIA's PyPI wheels, standins/cuda-devel.Dockerfile), then
`docker build --target build-cuda` of services/llama/Dockerfile as compose builds it but for
CUDA_DEVEL_IMAGE, the pinned source downloaded and patched inside the build. The image's default
devel image is CUDA 12.8.1, whose compiler is on no package index this machine reaches (CUDA 12's
PyPI wheels hold no nvcc): the check runs the same stage with the 13.0 toolkit. Prints each step's
time as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .engine import missing_tools, private_engine
from .standins import CUDA_DEVEL, build_standins

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="90", help="CUDA_ARCHITECTURES of the build (default 90: Hopper)")
    parser.add_argument("--jobs", type=int, help="BUILD_JOBS (default: every core)")
    parser.add_argument("--tag", default="moe-l2-llama:cuda-builder-check")
    args = parser.parse_args(argv)
    if missing := missing_tools():
        print(f"needs {', '.join(missing)}", file=sys.stderr)
        return 2
    timings: dict[str, float] = {}
    started = time.monotonic()
    with private_engine() as engine:
        timings["engine_start_s"] = round(time.monotonic() - started, 1)
        step = time.monotonic()
        build_standins(engine, timings, (CUDA_DEVEL,))
        timings["cuda_devel_standin_s"] = round(time.monotonic() - step, 1)
        step = time.monotonic()
        build_args = [
            "--build-arg",
            f"CUDA_ARCHITECTURES={args.arch}",
            "--build-arg",
            f"CUDA_DEVEL_IMAGE={CUDA_DEVEL.image}",
        ]
        if args.jobs:
            build_args += ["--build-arg", f"BUILD_JOBS={args.jobs}"]
        engine.docker(
            "build",
            "--network=host",
            "--progress=plain",
            "--target",
            "build-cuda",
            *build_args,
            "-t",
            args.tag,
            "-f",
            str(REPO / "services" / "llama" / "Dockerfile"),
            str(REPO),
            timeout=4 * 3600,
        )
        timings["build_cuda_stage_s"] = round(time.monotonic() - step, 1)
        version = engine.docker("run", "--rm", "--entrypoint", "ls", args.tag, "-l", "/opt/llama/bin").stdout
    print(version)
    print(json.dumps(timings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
