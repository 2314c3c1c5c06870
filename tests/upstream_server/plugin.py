"""A pytest plugin loaded into llama.cpp's own server tests (`-p tests.upstream_server.plugin`) by
tests/test_upstream_server_tests.py: upstream's presets serve moe-l2's demo model, nothing is
downloaded, and the selection below is applied, each test left out with its reason.

Upstream's presets fetch small trained models from Hugging Face, which cannot be reached here. Their
`tinyllama2` preset (stories260K, a 260K-parameter llama) is the one the chosen files use; it becomes
the demo model (MOE_L2_UPSTREAM_MODEL) with the preset's own settings (n_ctx 512, n_batch 32, two
slots, n_predict 64, seed 42). Every other model preset raises, so a test that needs one fails with
its name instead of trying the network; each is deselected below. The router preset loads no model and
is kept. Standard library and pytest only: this runs in upstream's pytest, not in moe-l2's suite.
"""

from __future__ import annotations

import json
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

MODEL_ENV = "MOE_L2_UPSTREAM_MODEL"  # the demo model's path
REPORT_ENV = "MOE_L2_UPSTREAM_REPORT"  # where the collection report (JSON) is written

# The upstream files that run, each with the number of tests it collects at the pinned commit (0c1e570).
# A file is chosen for what it sends through the code the series changes (docs/llama-fork.md):
FILES: dict[str, int] = {
    # /completion and /v1/completions, blocking and streamed, in parallel slots, a client leaving a blocking
    # request (test_cancel_request; 0001 changed that wait), n_probs, the prompt cache: handle_completions_impl,
    # where 0022/0024 read and check the domain tag, and the slot launch, where 0022/0027 tag the sequence
    "unit/test_completion.py": 40,
    # /metrics, to which 0022/0023/0028 append the llamacpp:moe_* lines: upstream parses the whole text and
    # asserts a # TYPE line for every unlabelled llamacpp: metric, so ours are held to its format too
    "unit/test_metrics.py": 10,
    # /slots save, restore, erase (all left out below: stories260K's tokens and text, or an image model;
    # slot_save_demo.py ports the three text ones to the demo model)
    "unit/test_slot_save.py": 9,
    # /health, /props, /models, /slots, the listener on two addresses with an API key (server-http.cpp's
    # middleware, which 0025 extends with the admin token on /moe/)
    "unit/test_basic.py": 8,
    # /v1/chat/completions, the gateway's path to llama-server: the same handle_completions_impl as /completion
    # (the domain tag), streamed chunks, usage, logprobs, n > 1 choices (several tasks of one request, each
    # tagged), a context too small, prompt progress
    "unit/test_chat_completion.py": 52,
    # the API key middleware (0025) and CORS in server-http.cpp
    "unit/test_security.py": 29,
    # sleep and wake: the model unloaded and loaded again, the path where 0022 attaches the telemetry's eval
    # callback and hands it the new context; /metrics served from the snapshot while asleep
    "unit/test_sleep.py": 4,
}

# Files of the source tree outside tools/server/tests that chosen tests read (relative to the tree's root)
TREE_FILES: tuple[str, ...] = ("models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja",)

# moe-l2's ports of upstream tests to the demo model: our file -> where it goes in upstream's tree
PORTS: dict[str, str] = {"slot_save_demo.py": "unit/test_moe_l2_slot_save.py"}
PORT_TESTS = 2  # the tests slot_save_demo.py collects

# Why a test cannot run here. A test id without brackets leaves out every parametrization.
_STORIES = (
    "asserts what stories260K writes (a regex over its text) or how its tokenizer counts a prompt (prompt_n, "
    "n_saved): the demo model is random weights with its own vocabulary"
)
_NO_UI = "needs the web UI, which moe-l2 builds without (-DLLAMA_BUILD_UI=OFF in build_config.py's BASE_CMAKE_FLAGS)"
_IMAGES = "needs tinygemma3 and its mmproj from Hugging Face (images); the demo model is text only"

DESELECTED: dict[str, str] = {
    "unit/test_completion.py::test_completion": _STORIES,
    "unit/test_completion.py::test_completion_stream": _STORIES,
    "unit/test_completion.py::test_completion_with_openai_library": _STORIES,
    "unit/test_completion.py::test_completion_stream_with_openai_library": _STORIES,
    "unit/test_completion.py::test_completion_stream_with_openai_library_stops": (
        "needs Phi-3.5-mini from Hugging Face and asserts its text (upstream marks it slow)"
    ),
    "unit/test_completion.py::test_cache_vs_nocache_prompt": "upstream skips it itself (fails on Linux)",
    "unit/test_completion.py::test_n_probs_post_sampling": (
        "expects 10 tokens to survive top-k/top-p/min-p at the first step, a property of stories260K's "
        "distribution on that prompt: the demo model's head leaves 2 (measured)"
    ),
    "unit/test_chat_completion.py::test_chat_completion": _STORIES,
    "unit/test_chat_completion.py::test_chat_completion_cached_tokens": _STORIES,
    "unit/test_chat_completion.py::test_chat_completion_stream": _STORIES,
    "unit/test_chat_completion.py::test_chat_completion_with_openai_library": _STORIES,
    "unit/test_metrics.py::test_metrics_embedding_prompt_is_counted": (
        "needs bert-bge-small from Hugging Face (an embedding model)"
    ),
    "unit/test_slot_save.py::test_slot_save_restore": _STORIES + "; ported: slot_save_demo.py",
    "unit/test_slot_save.py::test_slot_erase": _STORIES + "; ported: slot_save_demo.py",
    "unit/test_slot_save.py::test_slot_restore_legacy_token_list": (
        _STORIES + "; the legacy file format is upstream's code, which the series does not touch"
    ),
    "unit/test_slot_save.py::test_slot_save_restore_text_only_on_multimodal": _IMAGES,
    "unit/test_slot_save.py::test_slot_save_restore_with_image": _IMAGES,
    "unit/test_slot_save.py::test_slot_save_restore_with_two_images": _IMAGES,
    "unit/test_slot_save.py::test_slot_save_restore_with_image_across_restart": _IMAGES,
    "unit/test_slot_save.py::test_slot_save_restore_image_payload_larger_than_context": _IMAGES,
    "unit/test_slot_save.py::test_slot_restore_media_file_without_mmproj": _IMAGES,
    "unit/test_basic.py::test_load_split_model": "needs a split stories15M from Hugging Face and asserts its text",
    "unit/test_basic.py::test_no_ui": _NO_UI,
    "unit/test_security.py::test_access_static_assets_without_api_key": _NO_UI,
    "unit/test_security.py::test_local_media_file": _IMAGES,
}

# Tests that fail on the series as it is, for a bug these tests found: each must fail with a ConnectionError
# (the request that wakes the server finds it dead), and strictly: once the bug is fixed the test passes, and
# the run fails until its entry goes. Empty since 0022 forgets its context before the server frees it: the
# three test_sleep.py tests crashed the server on wake (the reload's warm-up called the telemetry's callback
# with the freed context) until then.
KNOWN_FAILURES: dict[str, str] = {}


def _refuse_download(url: str, out: str | None = None) -> str:
    raise RuntimeError(f"moe-l2 runs upstream's server tests offline; nothing may download {url}")


def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """Before upstream's conftest imports utils.py, which imports wget for download_file (no chosen test calls
    it): a stand-in that refuses, so the run needs no package beyond moe-l2's dev environment (requests,
    openai, filelock, pytest)."""
    wget = types.ModuleType("wget")
    wget.download = _refuse_download  # type: ignore[attr-defined]
    sys.modules.setdefault("wget", wget)


def _refusing_preset(name: str) -> Callable[[], Any]:
    def preset() -> Any:
        raise RuntimeError(f"ServerPreset.{name} loads a model from Hugging Face, which moe-l2's run has not")

    return preset


def pytest_configure(config: pytest.Config) -> None:
    import utils  # upstream's, importable once its conftest is loaded (its folder is the rootdir)

    model = os.environ[MODEL_ENV]
    utils.ServerProcess.model_hf_repo = None
    utils.ServerProcess.model_hf_file = None
    tinyllama2 = utils.ServerPreset.tinyllama2

    def demo_model() -> Any:
        server = tinyllama2()
        server.model_hf_repo = None
        server.model_hf_file = None
        server.model_file = model
        # stories260K has no chat template, so upstream's server falls back to chatml; the demo model has a
        # Jinja one that the server's legacy (--no-jinja) path refuses with a 500
        server.chat_template = "chatml"
        # one thread: the demo model decodes ~2000 tokens/s on it, and on a shared 2-core machine (load 4) the run
        # took 23-25 s with one and 60-100 s with llama.cpp's default (a thread per core, spinning at its barriers)
        server.n_threads = 1
        return server

    for name, member in list(vars(utils.ServerPreset).items()):
        if isinstance(member, staticmethod) and name not in ("load_all", "router"):
            setattr(utils.ServerPreset, name, staticmethod(_refusing_preset(name)))
    utils.ServerPreset.tinyllama2 = staticmethod(demo_model)
    utils.ServerPreset.load_all = staticmethod(lambda: None)  # upstream's session fixture downloads every preset


def selection_key(nodeid: str) -> str:
    """The test's id without its parameters: `unit/f.py::test_x[a-b]` -> `unit/f.py::test_x`."""
    return nodeid.split("[", 1)[0]


def entry(table: dict[str, str], nodeid: str) -> str | None:
    """The key of `table` that names the test: its exact id, else its id without parameters."""
    for key in (nodeid, selection_key(nodeid)):
        if key in table:
            return key
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import requests

    per_file: dict[str, int] = {}
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        per_file[file] = per_file.get(file, 0) + 1
    expected = {**FILES, **{dest: PORT_TESTS for dest in PORTS.values()}}
    if per_file != expected:
        raise pytest.UsageError(
            f"upstream's files collect {per_file}, the selection records {expected}: "
            "review tests/upstream_server/plugin.py for this source (FILES, DESELECTED, KNOWN_FAILURES)"
        )

    kept, dropped, used = [], [], set()
    for item in items:
        if (key := entry(DESELECTED, item.nodeid)) is not None:
            dropped.append(item)
        else:
            kept.append(item)
            key = entry(KNOWN_FAILURES, item.nodeid)
            if key is not None:
                reason = KNOWN_FAILURES[key]
                item.add_marker(
                    pytest.mark.xfail(strict=True, raises=requests.exceptions.ConnectionError, reason=reason)
                )
        used.add(key)
    stale = sorted((set(DESELECTED) | set(KNOWN_FAILURES)) - used)
    if stale:
        raise pytest.UsageError(f"entries of tests/upstream_server/plugin.py match no test: {stale}")
    items[:] = kept
    config.hook.pytest_deselected(items=dropped)
    if path := os.environ.get(REPORT_ENV):
        report = {
            "collected": per_file,
            "selected": [i.nodeid for i in kept],
            "deselected": {i.nodeid: DESELECTED[entry(DESELECTED, i.nodeid) or ""] for i in dropped},
            "known_failures": [i.nodeid for i in kept if entry(KNOWN_FAILURES, i.nodeid) is not None],
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
