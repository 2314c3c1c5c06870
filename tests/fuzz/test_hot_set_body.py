"""hypothesis on llama-server's hot-set parser (patch 0023), through the real binary.

POST /moe/hot-set is what the cache-manager's flywheel sends, and the one body the C++ side parses
by hand: layer keys as strings, expert ids checked against the model's shape. The property is what
the flywheel relies on: a body is either applied as posted (200, and GET returns it) or refused with
a 400 that leaves the set in use unchanged; never a 5xx, never a dead server.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import ADMIN_HEADERS, LlamaServer
from tests.fuzz.conftest import FuzzCounts, examples

pytestmark = [pytest.mark.llama]

SERVICE = "llama (POST /moe/hot-set)"

# JSON values (no NaN: JSON has none)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def near_valid_bodies(n_layer: int, n_expert: int) -> st.SearchStrategy[Any]:
    """Bodies shaped like the flywheel's, with ids and layer keys around the model's bounds."""
    layer_keys = st.one_of(
        st.integers(-2, n_layer + 2).map(str),
        st.sampled_from(["", " 0", "0 ", "00", "1e0", "0x1", "-0", "+1", "abc", "9" * 30]),
    )
    expert_ids = st.one_of(
        st.integers(-2, n_expert + 2),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from(["1", None, True, [], {}]),
    )
    layers = st.dictionaries(layer_keys, st.lists(expert_ids, max_size=6) | json_scalars, max_size=5)
    domain = st.one_of(st.sampled_from(["codegen", "none", "", "_global"]), st.text(max_size=70), json_scalars)
    return st.fixed_dictionaries({"domain": domain, "layers": layers}, optional={"extra": json_values})


def is_valid(body: Any, n_layer: int, n_expert: int) -> bool:
    """Whether the server must accept the body: the contract of POST /moe/hot-set."""
    if not isinstance(body, dict) or not isinstance(body.get("domain", ""), str | None):
        return False
    layers = body.get("layers")
    if not isinstance(layers, dict):
        return False
    for key, ids in layers.items():
        # canonical decimal keys: "00" and "0" would both name layer 0
        if not (key.isascii() and key.isdigit() and key == str(int(key)) and int(key) < n_layer):
            return False
        if not isinstance(ids, list):
            return False
        for e in ids:
            if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < n_expert:
                return False
    return True


@pytest.fixture(scope="module")
def shape(llama: LlamaServer) -> tuple[int, int]:
    routing = llama.routing()
    return routing["n_layer"], routing["n_expert"]


def test_hot_set_body_is_applied_or_refused(
    llama: LlamaServer, shape: tuple[int, int], fuzz_counts: FuzzCounts
) -> None:
    n_layer, n_expert = shape
    bodies = near_valid_bodies(n_layer, n_expert) | json_values
    with httpx.Client(base_url=llama.url, timeout=60, headers=ADMIN_HEADERS) as client:

        @settings(max_examples=examples(400), deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(body=bodies)
        @example(body={"domain": "codegen", "layers": {"0": [0, n_expert - 1]}})
        @example(body={"domain": "codegen", "layers": {str(n_layer): [0]}})
        @example(body={"domain": "codegen", "layers": {"0": [n_expert]}})
        @example(body={"domain": "codegen", "layers": {"0": [True]}})
        @example(body=[])
        def run(body: Any) -> None:
            before = client.get("/moe/hot-set").json()
            resp = client.post("/moe/hot-set", content=json.dumps(body), headers={"Content-Type": "application/json"})
            fuzz_counts.record(SERVICE, resp.status_code)
            assert resp.status_code < 500, (body, resp.text)
            after = client.get("/moe/hot-set").json()
            if resp.status_code == 200:
                assert is_valid(body, n_layer, n_expert), body
                assert after["domain"] == (body.get("domain") or "")
                posted = {k: sorted(set(v)) for k, v in body["layers"].items() if v}
                got = {k: sorted(v) for k, v in after["layers"].items() if v}
                assert got == posted
            else:
                assert resp.status_code == 400, (body, resp.text)
                assert not is_valid(body, n_layer, n_expert), body
                assert resp.json()["error"]["type"] == "invalid_request_error"
                assert after["version"] == before["version"]

        run()

    # the server still serves
    assert llama.client.get("/health").status_code == 200
    assert llama.client.post("/moe/hot-set", json={"domain": "none", "layers": {}}, headers=ADMIN_HEADERS).is_success
