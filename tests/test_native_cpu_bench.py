"""bench/native_cpu.py's own parts: which builds it compares and what it reads back from them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from moe_l2_llama.build import BuildConfig
from tests.benches import load_bench

bench = load_bench("native_cpu")


def test_it_compares_the_native_build_with_the_portable_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    built: list[BuildConfig] = []
    monkeypatch.setattr(bench, "build", lambda config: built.append(config) or tmp_path / f"{config.native}")
    given = tmp_path / "mine"
    given.touch()
    bins = bench.binaries(argparse.Namespace(native=None, portable=None))
    assert built == [BuildConfig(native=True), BuildConfig(native=False)]  # the CPU build, same source
    assert bins == {"native": tmp_path / "True", "portable": tmp_path / "False"}
    assert bench.binaries(argparse.Namespace(native=given, portable=None))["native"] == given


def test_what_a_build_and_its_server_say_is_kept(tmp_path: Path) -> None:
    binary = tmp_path / "key" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF"]
    (tmp_path / "key" / "build-info.json").write_text(json.dumps({"key": "key", "cmake_flags": flags}))
    facts = bench.build_facts(binary)
    assert facts["path"] == str(binary) and facts["key"] == "key" and facts["ggml_native"] == "-DGGML_NATIVE=OFF"
    server = tmp_path / "llama-server"  # a stand-in that logs as the real one does at -lv 4
    server.write_text(
        "#!/bin/sh\necho 'main: loading'\n"
        "echo '0.00.006 I cmn  common_param: system_info: n_threads = 1 / 2 | CPU : AVX2 = 1 | AVX512 = 1 |'\n"
        "exec sleep 60\n"
    )
    server.chmod(0o755)
    assert bench.system_info(server, tmp_path / "m.gguf") == "n_threads = 1 / 2 | CPU : AVX2 = 1 | AVX512 = 1 |"


def test_the_ratio_is_the_median_of_each_run_s_pair() -> None:
    # a slow machine moment hits both builds of a run: pairs cancel it where medians of each would not
    native, portable = [10.0, 5.0, 12.0], [8.0, 4.0, 12.0]
    assert bench.paired_ratio(native, portable) == 1.25
