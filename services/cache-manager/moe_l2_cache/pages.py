"""The model file's pages: mapped read-only, read ahead, locked, dropped and probed, per byte range.

mlock works on whole pages while expert slices are not page-aligned, and munlock is not counted:
unlocking one expert would unlock the pages it shares with a neighbour. So the first and last page
of every locked (and of every held) range carry a reference count; pages strictly inside a range
belong to it alone. This module knows pages and ranges, not experts or policies (residency.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_l2_gguf.index import ByteRange

PAGE = mmap.PAGESIZE
_MADV_PAGEOUT: int | None = getattr(mmap, "MADV_PAGEOUT", 21 if sys.platform == "linux" else None)  # Linux >= 5.4
PageRun = tuple[int, int, int]  # (file, first page, last page), inclusive


class _Libc:
    """mlock, munlock and mincore through ctypes (Python's mmap module has no binding for them)."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        for name in ("mlock", "munlock"):
            fn = getattr(self._libc, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            fn.restype = ctypes.c_int
        self._libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._libc.mincore.restype = ctypes.c_int

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mlock(self, addr: int, length: int) -> None:
        self._check(self._libc.mlock(addr, length), "mlock")

    def munlock(self, addr: int, length: int) -> None:
        self._check(self._libc.munlock(addr, length), "munlock")

    def mincore(self, addr: int, length: int) -> np.ndarray:
        """One byte per page of [addr, addr+length), bit 0 set when the page is resident."""
        vec = np.zeros((length + PAGE - 1) // PAGE, dtype=np.uint8)
        self._check(self._libc.mincore(addr, length, vec.ctypes.data), "mincore")
        return vec


@dataclass
class _Mapping:
    path: Path
    fd: int
    mm: mmap.mmap
    base: int  # address of the mapping
    size: int

    @classmethod
    def open(cls, path: Path) -> _Mapping:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        # numpy takes a read-only buffer (ctypes.from_buffer would not) and tells its address.
        base = int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data)
        return cls(path, fd, mm, base, size)

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


@dataclass(frozen=True)
class Span:
    """A byte range as whole pages of one mapping: [first, last] inclusive."""

    file: int
    offset: int
    length: int

    @property
    def first(self) -> int:
        return self.offset // PAGE

    @property
    def last(self) -> int:
        return (self.offset + self.length - 1) // PAGE

    def boundary_pages(self) -> list[int]:
        return [self.first] if self.first == self.last else [self.first, self.last]


class ModelPages:
    """The model's files mapped read-only, with the reference counts of the ranges held and locked.

    Not thread-safe: the pool calls it under its own lock."""

    def __init__(self, paths: list[Path]) -> None:
        self._libc = _Libc()
        self._files = {path: i for i, path in enumerate(paths)}
        self._maps: list[_Mapping] = []
        self._lock_refs: dict[tuple[int, int], int] = {}  # (file, page) -> locked ranges
        self._hold_refs: dict[tuple[int, int], int] = {}  # (file, page) -> held ranges
        self._kept: dict[int, np.ndarray] = {}  # file -> pages drop() leaves alone (the RAM tier's locked ones)
        # the RAM tier's page-out of other processes' mappings: what the pool evicts leaves llama's too,
        # before the pool reads in what replaces it
        self.page_out_elsewhere: Callable[[list[PageRun]], object] | None = None
        try:
            for path in paths:
                self._maps.append(_Mapping.open(path))
        except BaseException:
            self.close()
            raise

    def span(self, r: ByteRange) -> Span:
        return Span(self._files[r.path], r.offset, r.length)

    def hold(self, span: Span) -> None:
        """Read the range ahead (MADV_WILLNEED) and count it as held."""
        start, length = span.first * PAGE, (span.last - span.first + 1) * PAGE
        mapping = self._maps[span.file]
        will_need(mapping.mm, start, min(length, mapping.size - start))
        for page in span.boundary_pages():
            key = (span.file, page)
            self._hold_refs[key] = self._hold_refs.get(key, 0) + 1

    def release(self, span: Span) -> list[PageRun]:
        """Stop holding the range; returns its page runs no other held range needs (for drop())."""
        return [(span.file, first, last) for first, last in _release(self._hold_refs, span)]

    def lock(self, spans: list[Span]) -> None:
        """mlock every range, or none of them (an OSError after undoing the ones done)."""
        done: list[Span] = []
        try:
            for span in spans:
                mapping = self._maps[span.file]
                self._libc.mlock(mapping.base + span.first * PAGE, (span.last - span.first + 1) * PAGE)
                for page in span.boundary_pages():
                    key = (span.file, page)
                    self._lock_refs[key] = self._lock_refs.get(key, 0) + 1
                done.append(span)
        except OSError:
            for span in done:
                self.unlock(span)
            raise

    def unlock(self, span: Span) -> None:
        mapping = self._maps[span.file]
        for first, last in _release(self._lock_refs, span):
            self._libc.munlock(mapping.base + first * PAGE, (last - first + 1) * PAGE)

    def drop(self, runs: list[PageRun]) -> None:
        """Ask the kernel to drop these pages from the page cache, adjacent runs merged.

        The page cache holds large folios (several pages) and POSIX_FADV_DONTNEED skips a folio that
        is not entirely inside the range given. MADV_PAGEOUT reclaims the pages our mapping references
        (the ones mlock faulted in), splitting a folio that sticks out of the range; MADV_DONTNEED then
        unmaps what is left from this process, and POSIX_FADV_DONTNEED drops the unmapped whole folios.
        Pages another process maps (llama's) stay: the kernel refuses to drop them, as it should.
        """
        merged: list[tuple[int, int, int]] = []
        for file, first, last in sorted(runs):
            if merged and merged[-1][0] == file and merged[-1][2] + 1 >= first:
                merged[-1] = (file, merged[-1][1], max(merged[-1][2], last))
            else:
                merged.append((file, first, last))
        merged = self._without_kept(merged)
        for file, first, last in merged:
            mapping = self._maps[file]
            start = first * PAGE
            length = min((last - first + 1) * PAGE, mapping.size - start)
            if _MADV_PAGEOUT is not None:
                with suppress(OSError):  # kernels before 5.4 do not know it; the calls below still work
                    mapping.mm.madvise(_MADV_PAGEOUT, start, length)
            mapping.mm.madvise(mmap.MADV_DONTNEED, start, length)
        # after our own unmapping: MADV_PAGEOUT skips a page two processes map
        if self.page_out_elsewhere is not None and merged:
            self.page_out_elsewhere(merged)
        for file, first, last in merged:
            mapping = self._maps[file]
            start = first * PAGE
            os.posix_fadvise(
                mapping.fd, start, min((last - first + 1) * PAGE, mapping.size - start), os.POSIX_FADV_DONTNEED
            )

    def forget(self, runs: list[PageRun]) -> None:
        """POSIX_FADV_DONTNEED only, for pages this process does not map (the RAM tier's page-outs: what
        llama's mapping held went with MADV_PAGEOUT; this takes what nobody maps, e.g. a read-ahead llama
        never touched). One call per run: each costs ~60 us (it drains every CPU's LRU batches)."""
        for file, first, last in self._without_kept(runs):
            mapping = self._maps[file]
            start = first * PAGE
            os.posix_fadvise(
                mapping.fd, start, min((last - first + 1) * PAGE, mapping.size - start), os.POSIX_FADV_DONTNEED
            )

    def keep(self, runs: list[PageRun], keep: bool = True) -> None:
        """Mark page runs that drop() must leave alone (or unmark them): a page shared with a locked range
        outside the pool's reference counts (the RAM tier's non-expert tensors) must not be dropped, and
        MADV_DONTNEED refuses locked pages anyway."""
        for file, first, last in runs:
            mask = self._kept.setdefault(file, np.zeros(self.file_pages(file), dtype=bool))
            mask[first : last + 1] = keep

    def _without_kept(self, runs: list[PageRun]) -> list[PageRun]:
        out: list[PageRun] = []
        for file, first, last in runs:
            kept = self._kept.get(file)
            if kept is None:
                out.append((file, first, last))
                continue
            out += [(file, first + a, first + b) for a, b in page_runs(~kept[first : last + 1])]
        return out

    def file_pages(self, file: int) -> int:
        return (self._maps[file].size + PAGE - 1) // PAGE

    def resident_map(self, file: int) -> np.ndarray:
        """One bool per page of the whole file: in the page cache now (mincore; faults nothing in)."""
        mapping = self._maps[file]
        return (self._libc.mincore(mapping.base, mapping.size) & 1).astype(bool)

    def resident_pages(self, file: int, pages: np.ndarray) -> np.ndarray:
        """One bool per page index given: in the page cache now. One mincore call per page: for the RAM
        tier's probes, a page per expert (~8 us each), where a mincore over a 9.5 GB file takes ~200 ms."""
        mapping = self._maps[file]
        out = np.zeros(len(pages), dtype=bool)
        for i, page in enumerate(pages.tolist()):
            out[i] = bool(self._libc.mincore(mapping.base + page * PAGE, PAGE)[0] & 1)
        return out

    def resident_count(self, run: PageRun) -> int:
        """Pages of the run in the page cache now."""
        file, first, last = run
        mapping = self._maps[file]
        return int((self._libc.mincore(mapping.base + first * PAGE, (last - first + 1) * PAGE) & 1).sum())

    def read_ahead(self, runs: list[PageRun]) -> None:
        """MADV_WILLNEED on these page runs: the kernel reads them in the background."""
        for file, first, last in runs:
            mapping = self._maps[file]
            start = first * PAGE
            will_need(mapping.mm, start, min((last - first + 1) * PAGE, mapping.size - start))

    def resident(self, span: Span) -> int:
        """Bytes of the range in the page cache now (mincore)."""
        mapping = self._maps[span.file]
        vec = self._libc.mincore(mapping.base + span.first * PAGE, (span.last - span.first + 1) * PAGE)
        resident = (vec & 1).astype(bool)
        if not resident.any():
            return 0
        page_start = (np.arange(span.first, span.last + 1, dtype=np.int64)) * PAGE
        lo = np.maximum(page_start, span.offset)
        hi = np.minimum(page_start + PAGE, span.offset + span.length)
        return int((hi - lo)[resident].sum())

    def close(self) -> None:
        for m in self._maps:
            m.close()
        self._maps = []


# Linux reads at most the file's read-ahead window (or the device's largest I/O) per MADV_WILLNEED and drops
# the rest of the range without a word: 64 MiB asked at once read 8 MiB on the bench machine (read_ahead_kb
# 8192), and a default 128 KiB window would read 128 KiB of a 1.6 MB expert slice. Pieces of 128 KiB, the
# smallest window the kernel has by default, are all read, and the calls cost the same (64 MiB: ~21 ms).
WILLNEED_PIECE = 128 << 10


def will_need(mm: mmap.mmap, start: int, length: int) -> None:
    """MADV_WILLNEED on [start, start + length) of the mapping, all of it (start page-aligned)."""
    for at in range(start, start + length, WILLNEED_PIECE):
        mm.madvise(mmap.MADV_WILLNEED, at, min(WILLNEED_PIECE, start + length - at))


def _release(refs: dict[tuple[int, int], int], span: Span) -> list[tuple[int, int]]:
    """Drops the span's references; returns the page runs no other range references any more."""
    free: list[int] = []
    for page in span.boundary_pages():
        key = (span.file, page)
        left = refs.get(key, 0) - 1
        if left <= 0:
            refs.pop(key, None)
            free.append(page)
        else:
            refs[key] = left
    runs: list[tuple[int, int]] = []
    if span.last - span.first >= 2:
        runs.append((span.first + 1, span.last - 1))
    runs += [(p, p) for p in free]
    return runs


def page_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The runs of True in a bool array, as (first, last) inclusive."""
    if not mask.any():
        return []
    padded = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a), int(b) - 1) for a, b in zip(edges[::2], edges[1::2], strict=True)]
