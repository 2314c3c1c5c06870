"""moe-l2's port of upstream's unit/test_slot_save.py (test_slot_save_restore, test_slot_erase) to the demo model.

Copied into upstream's tree as unit/test_moe_l2_slot_save.py and run by its pytest, with its harness (utils.py)
and the preset tests/upstream_server/plugin.py gives. The requests are upstream's, step for step; what
upstream asserts of stories260K is asserted of the demo model instead:

- the token counts (prompt_n 21 and 6, n_saved 84) are computed from the demo model's tokenizer (/tokenize)
  and the tokens predicted: a prompt is processed in full, then only past its common prefix with the cached
  one, n_saved is the prompt and the predicted tokens but the last (sampled, never decoded into the cache);
- the regexes over stories260K's text become equalities: at temperature 0 a slot restored from a file
  writes what the slot it was saved from wrote from the same cache, and an erased slot writes what it
  wrote from an empty one.
"""

from __future__ import annotations

import pytest
from utils import ServerPreset, ServerProcess

server: ServerProcess

FRANCE = "What is the capital of France?"
GERMANY = "What is the capital of Germany?"


@pytest.fixture(autouse=True)
def create_server(tmp_path):
    global server
    server = ServerPreset.tinyllama2()
    server.slot_save_path = str(tmp_path)
    server.temperature = 0.0


def tokens(text: str) -> list[int]:
    res = server.make_request("POST", "/tokenize", data={"content": text, "add_special": True})
    assert res.status_code == 200
    return res.body["tokens"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def complete(prompt: str, slot: int) -> dict:
    res = server.make_request("POST", "/completion", data={"prompt": prompt, "id_slot": slot, "cache_prompt": True})
    assert res.status_code == 200
    assert res.body["content"]
    return res.body


def test_slot_save_restore():
    server.start()
    france, germany = tokens(FRANCE), tokens(GERMANY)
    n_new = len(germany) - common_prefix(france, germany)
    assert 0 < n_new < len(germany)  # the prompts share a prefix, else no reuse is tested

    # First prompt in slot 1 should be fully processed
    first = complete(FRANCE, 1)
    assert first["timings"]["prompt_n"] == len(france)
    n_saved = len(france) + first["timings"]["predicted_n"] - 1

    # Save state of slot 1
    res = server.make_request("POST", "/slots/1?action=save", data={"filename": "slot1.bin"})
    assert res.status_code == 200
    assert res.body["n_saved"] == n_saved

    # Since we have cache, this should only process the last tokens
    cached = complete(GERMANY, 1)
    assert cached["timings"]["prompt_n"] == n_new

    # Loading the saved cache into slot 0
    res = server.make_request("POST", "/slots/0?action=restore", data={"filename": "slot1.bin"})
    assert res.status_code == 200
    assert res.body["n_restored"] == n_saved

    # Since we have cache, slot 0 should only process the last tokens, and from the same cache write the same
    restored = complete(GERMANY, 0)
    assert restored["timings"]["prompt_n"] == n_new
    assert restored["content"] == cached["content"]

    # For verification that slot 1 was not corrupted during slot 0 load, same thing should work
    again = complete(GERMANY, 1)
    assert again["timings"]["prompt_n"] == 1


def test_slot_erase():
    server.start()
    france = tokens(FRANCE)

    first = complete(FRANCE, 1)
    assert first["timings"]["prompt_n"] == len(france)  # all tokens are processed

    # erase slot 1
    res = server.make_request("POST", "/slots/1?action=erase")
    assert res.status_code == 200

    # re-run the same prompt, it should process all tokens again
    again = complete(FRANCE, 1)
    assert again["timings"]["prompt_n"] == len(france)
    assert again["content"] == first["content"]
