"""The llama service: the pinned, patched llama-server (build and launch)."""
