"""The pool's read-ahead (MADV_WILLNEED) reads every page it asks for, against the kernel.

Linux reads at most the file's read-ahead window per MADV_WILLNEED and drops the rest of the range
without a word; the pool asks for whole hot sets and expert slices larger than that window."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from moe_l2_cache.pages import PAGE, WILLNEED_PIECE, ModelPages

from .conftest import drop_page_cache


def test_a_read_ahead_larger_than_the_read_ahead_window_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    size = 48 << 20  # above any default read-ahead window (128 KiB; 8 MiB on the bench machine, 16 sequential)
    with path.open("wb") as f:
        f.write(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes())
    drop_page_cache(path)
    pages = ModelPages([path])
    try:
        assert not pages.resident_map(0).any(), "the file did not leave the page cache"
        n_pages = size // PAGE
        pages.read_ahead([(0, 0, n_pages - 1)])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not pages.resident_map(0).all():
            time.sleep(0.05)
        resident = pages.resident_map(0)
        assert resident.all(), f"{int(resident.sum())} of {n_pages} pages read"
    finally:
        pages.close()
        os.unlink(path)


def test_the_pieces_are_no_larger_than_the_smallest_default_window() -> None:
    assert WILLNEED_PIECE == 128 << 10 and WILLNEED_PIECE % PAGE == 0
