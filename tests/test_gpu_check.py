"""`make bench-gpu` sets Python up on a machine without the project's venv (bench/gpu_setup.py, called
by bench/gpu_check.sh): the package roots come from pyproject.toml, the wheels that fit are unpacked,
and every module the check runs imports, checked here with a bare interpreter.

The bare interpreter is a venv made `--without-pip` and without the system's site-packages; the
packages the lent GPU machine has of its own (numpy, httpx and its needs, pyyaml, tqdm) are linked
into its site-packages, and everything else comes only as wheels. The wheels are made here from this
venv's installed files (a wheel is a zip of them with its tag in the name), so the test needs no
index and no .bench-gpu/ folder, and checks exactly the unpacking gpu_check.sh does. Before the
setup read the roots from pyproject.toml, the check of 2026-12-04 died on the H200 of two missing
roots; this test fails on any such gap.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.benches import load_bench

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.sh"
# what the lent H200's python3 has of its own (bench/data/gpu-2026-12-04/README.md, the brief)
MACHINE = ("numpy", "httpx", "httpcore", "h11", "anyio", "sniffio", "idna", "certifi", "PyYAML", "tqdm")
# what gpu_check.sh --prepare downloads for it
WHEELS = (
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "python-dotenv",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "gguf",
    "prometheus-client",
    "nvidia-ml-py",
)


@pytest.fixture(scope="module")
def setup_mod():
    return load_bench("gpu_setup")


def test_package_roots_are_pyproject_s_one_list(setup_mod):
    with (REPO / "pyproject.toml").open("rb") as f:
        where = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["where"]
    roots = setup_mod.package_roots()
    assert roots == where
    for root in roots:
        assert any(p.name.startswith("moe_l2_") for p in (REPO / root).iterdir()), root
    # no second, hand-written list in the script: that is how two roots went missing
    text = SCRIPT.read_text()
    assert "services/cache-manager" not in text and '"$REPO/shared:' not in text


@pytest.mark.parametrize(
    ("name", "version", "fits"),
    [
        ("pydantic-2.12.0-py3-none-any.whl", (3, 12), True),
        ("pydantic_core-2.41.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", (3, 12), True),
        ("pydantic_core-2.41.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", (3, 11), False),
        ("pydantic_core-2.41.0-cp311-cp311-manylinux_2_17_x86_64.whl", (3, 11), True),
        ("zstandard-0.23-cp39-abi3-manylinux_2_17_x86_64.whl", (3, 12), True),
        ("numpy-2.3.0-cp312-cp312-manylinux_2_28_aarch64.whl", (3, 12), False),
        ("six-1.16.0-py2.py3-none-any.whl", (3, 12), True),
        ("not-a-wheel.zip", (3, 12), False),
    ],
)
def test_only_wheels_this_interpreter_can_import_are_taken(setup_mod, name, version, fits):
    assert setup_mod.wheel_fits(name, version, "x86_64") is fits


def make_wheel(dist_name: str, folder: Path) -> Path:
    """A wheel of an installed distribution: its files (those under site-packages) and its tag."""
    dist = md.distribution(dist_name)
    wheel_meta = dist.read_text("WHEEL") or ""
    tags = re.findall(r"^Tag: (\S+)$", wheel_meta, re.MULTILINE)
    assert tags, f"{dist_name}: no Tag in its WHEEL file"
    py, abi, plat = tags[0].split("-")
    for t in tags[1:]:  # e.g. two manylinux tags: joined with dots, as wheel file names do
        plat += "." + t.split("-")[2]
    name = re.sub(r"[-.]+", "_", dist.metadata["Name"]).lower()
    path = folder / f"{name}-{dist.version}-{py}-{abi}-{plat}.whl"
    base = Path(dist.locate_file(""))
    with zipfile.ZipFile(path, "w") as z:
        for f in dist.files or []:
            if f.parts[0] == ".." or f.suffix == ".pyc":
                continue
            full = base / f
            if full.is_file():
                z.write(full, str(f))
    return path


def bare_python(tmp_path: Path) -> Path:
    """A venv without pip and without the system's packages, plus the GPU machine's own ones."""
    env = tmp_path / "bare"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    for name in MACHINE:  # every top-level entry of the distribution, its .dist-info included
        dist = md.distribution(name)
        base_dir = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            if (base_dir / top).exists() and not (site / top).exists():
                (site / top).symlink_to(base_dir / top)
    return python


def test_the_setup_with_a_bare_interpreter_imports_everything(setup_mod, tmp_path):
    python = bare_python(tmp_path)
    lacking = subprocess.run(
        [python, "-c", "import pydantic_settings"], capture_output=True, text=True, env={"PATH": os.environ["PATH"]}
    )
    assert lacking.returncode != 0, "the bare interpreter must not see this venv's packages"
    prep = tmp_path / "prep"
    (prep / "whl").mkdir(parents=True)
    for name in WHEELS:
        make_wheel(name, prep / "whl")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "GPU_CHECK_PYTHON": str(python),
        "GPU_CHECK_PREP": str(prep),
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "OUT": str(tmp_path / "out"),
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), "--setup-only"], capture_output=True, text=True, env=env, timeout=300, cwd=REPO
    )
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    n = len(setup_mod.REQUIRED)
    assert f"{n} of {n} modules import" in log
    assert "unpacked" in log  # the wheels were needed, and taken
    unpacked = re.search(r"unpacked \d+ wheels into \S+: (.*)", log)
    assert unpacked and "numpy" not in unpacked[1], "the machine's own numpy must not be shadowed"
    for root in setup_mod.package_roots():
        assert str(REPO / root) in log  # PYTHONPATH, as the log prints it


def test_the_script_parses(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    bad = subprocess.run(["bash", str(SCRIPT), "--frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown option --frobnicate" in bad.stderr


def test_a_carried_binary_finds_its_libraries_in_python_s_nvidia_wheels(tmp_path):
    """The CUDA binary's RUNPATH names the build machine's cuBLAS folder; on the GPU machine cuBLAS is
    python3's nvidia/cublas/lib. A stand-in: a program that needs libcublas.so.13 (here a one-function
    library of that soname, in a folder `site/nvidia/cublas/lib` that only PYTHONPATH names), carried
    as .xz: gpu_check unpacks it, puts the folder into LD_LIBRARY_PATH and runs its --version."""
    if not shutil.which("cc") or not shutil.which("xz"):
        pytest.skip("needs a C compiler and xz")
    lib = tmp_path / "site" / "nvidia" / "cublas" / "lib"
    lib.mkdir(parents=True)
    (tmp_path / "f.c").write_text("int fake_cublas(void) { return 13; }\n")
    (tmp_path / "main.c").write_text(
        '#include <stdio.h>\nint fake_cublas(void);\nint main(void) { printf("version %d\\n", fake_cublas()); }\n'
    )
    cc = ["cc", "-shared", "-fPIC", "-Wl,-soname,libcublas.so.13", "-o", str(lib / "libcublas.so.13")]
    subprocess.run([*cc, str(tmp_path / "f.c")], check=True)
    server = tmp_path / "llama-server"
    subprocess.run(["cc", "-o", str(server), str(tmp_path / "main.c"), str(lib / "libcublas.so.13")], check=True)
    subprocess.run(["xz", "-k", str(server)], check=True)
    assert "not found" in subprocess.run(["ldd", str(server)], capture_output=True, text=True).stdout
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "PYTHONPATH": str(tmp_path / "site"),
        "GPU_CHECK_PYTHON": sys.executable,
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "OUT": str(tmp_path / "out"),
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), "--binary-only", "--binary", f"{server}.xz"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert done.returncode == 0, log[-3000:]
    assert "libraries not found: libcublas.so.13" in log and f"LD_LIBRARY_PATH={lib}" in log
    assert "still not found: none" in log and "version 13" in log


def test_the_gauges_are_set_beside_nvidia_smi_s_read():
    facts = load_bench("gpu_facts")
    smi = facts.parse_smi_csv("12345 MiB, 143771 MiB, 37 %\n", ("memory.used", "memory.total", "utilization.gpu"))
    assert smi == {"memory.used": "12345 MiB", "memory.total": "143771 MiB", "utilization.gpu": "37 %"}
    gpu = {"memory_used_bytes": 12345 << 20, "memory_total_bytes": 143771 << 20, "utilization_ratio": 0.36}
    got = facts.compare_gauges({"gpus": [gpu]}, smi)
    assert got["used_diff_mib"] == 0 and got["utilization"] == {"nvml": 0.36, "nvidia_smi": 0.37}
    assert got["memory_total_bytes"]["nvidia_smi"] == 143771 << 20
    assert facts.compare_gauges("nvml_report() is None", smi) == "not both read"
    assert "skipped" in facts.h2d_rates(4_866_048) or facts.h2d_rates(4_866_048)["pinned_expert_gbps"] > 0
