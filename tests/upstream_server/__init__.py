"""llama.cpp's own server tests (tools/server/tests of the pinned source) on moe-l2's build and demo model.

tests/test_upstream_server_tests.py extracts upstream's harness and the chosen files from the sdist and
runs them with upstream's pytest as a subprocess; plugin.py is loaded into that run (the presets load
the demo model, nothing is downloaded, and the selection with the reason for every test left out);
slot_save_demo.py is moe-l2's port of upstream's slot save/restore tests to the demo model.
"""
