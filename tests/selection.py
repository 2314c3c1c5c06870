"""What `make check` leaves out, a pytest plugin (tests/conftest.py loads it).

`make check` is the inner loop: the tests that need no llama.cpp build, no Docker engine and no Vulkan
(`-m "not llama and not vulkan and not containers and not cuda_build"`). A test is marked `llama`
by hand, or here, when a fixture it uses (however indirectly) is one of the engine builds: so a new
test that asks for `llama_binary` is left out of `make check` without anyone remembering the mark.
"""

from __future__ import annotations

import pytest

# fixture -> the mark of the tests that use it
BUILD_FIXTURES = {
    "llama_binary": "llama",  # the CPU build of the patched llama-server
    "rpc_binary": "llama",  # the RPC build and its ggml-rpc-server
    "vulkan_binary": "vulkan",  # the Vulkan build, on llvmpipe
    "vulkan_build": "vulkan",  # the same build, for tests that only start it
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for mark in sorted({mark for fixture, mark in BUILD_FIXTURES.items() if fixture in used}):
            if item.get_closest_marker(mark) is None:
                item.add_marker(mark)
