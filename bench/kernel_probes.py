"""What the kernel says about a process and a file, for bench/ram_tier.py: a process's major faults, bytes
read and memory (/proc/PID), the host's (/proc/meminfo), a block device's reads (/sys/block), which of a
file's pages are resident (mincore through mmap), dropping a file from the page cache (posix_fadvise), and a
thread sampling them while a request runs. Linux only; standard library."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_majflt(pid: int) -> int:
    """Major faults of `pid` (field 12 of /proc/PID/stat; the name in field 2 may hold spaces)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[9])


def proc_read_bytes(pid: int) -> int:
    """Bytes this process caused to be read from storage (/proc/PID/io read_bytes; page-cache hits
    are not counted, readahead it triggered is)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def proc_status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def block_stat_path(path: Path) -> Path | None:
    """/sys/dev/block/MAJ:MIN/stat of the device holding `path`, if it is a block device (not an
    overlay or tmpfs, whose device numbers are anonymous)."""
    st = path.stat()
    p = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    return p if p.is_file() else None


def block_read_bytes(stat: Path | None) -> int | None:
    if stat is None:
        return None
    return int(stat.read_text().split()[2]) * 512  # sectors read, always 512-byte units


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_PROT_READ, _MAP_SHARED, _MAP_FAILED = 1, 1, ctypes.c_void_p(-1).value


class FileResidency:
    """The page-cache residency of files through mincore on our own read-only shared mappings: a
    mapping that is never read faults nothing in and, having no page table entries, does not stop
    POSIX_FADV_DONTNEED (nor MADV_PAGEOUT in another process) from dropping the pages."""

    def __init__(self, files: tuple[Path, ...]) -> None:
        self.maps: list[tuple[int, int]] = []
        for path in files:
            size = path.stat().st_size
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
            finally:
                os.close(fd)
            if addr in (None, _MAP_FAILED):
                self.close()
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            self.maps.append((addr, size))
        self.vec = ctypes.create_string_buffer(max((s + PAGE - 1) // PAGE for _, s in self.maps) or 1)

    def resident_bytes(self) -> int:
        total = 0
        for addr, size in self.maps:
            pages = (size + PAGE - 1) // PAGE
            if _libc.mincore(addr, size, self.vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            # Linux sets only bit 0 (resident) of each byte
            total += (pages - self.vec.raw[:pages].count(b"\x00")) * PAGE
        return total

    def close(self) -> None:
        for addr, size in self.maps:
            _libc.munmap(addr, size)
        self.maps = []


def drop_from_page_cache(files: tuple[Path, ...]) -> None:
    """Whole files out of the page cache; pages mapped by a live process would stay, so callers stop
    every process that maps the model first."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Sampler(threading.Thread):
    """Every `period_s`: the model's resident bytes (mincore) and llama's RssFile / RssAnon; maxima kept."""

    def __init__(self, residency: FileResidency, pid: int, budget: int, period_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.residency, self.pid, self.budget, self.period_s = residency, pid, budget, period_s
        self.stop_event = threading.Event()
        self.started = time.monotonic()
        self.samples = 0
        self.over: list[tuple[float, int]] = []  # (seconds since the sampler started, resident bytes) above the budget
        self.max_resident = 0
        self.max_rss_file = 0
        self.max_rss_anon = 0
        self.error: str | None = None

    def start(self) -> None:
        self.started = time.monotonic()
        super().start()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.sample()
            except (OSError, ValueError) as exc:  # llama gone: the config is over anyway
                self.error = str(exc)
                return
            self.stop_event.wait(self.period_s)

    def sample(self) -> None:
        resident = self.residency.resident_bytes()
        self.max_resident = max(self.max_resident, resident)
        if resident > self.budget:
            self.over.append((round(time.monotonic() - self.started, 2), resident))
        self.max_rss_file = max(self.max_rss_file, proc_status_kib(self.pid, "RssFile") * 1024)
        self.max_rss_anon = max(self.max_rss_anon, proc_status_kib(self.pid, "RssAnon") * 1024)
        self.samples += 1

    def finish(self) -> None:
        """Stop, with one last sample while llama still runs (a short run may end between two)."""
        self.stop_event.set()
        if self.ident is None:  # never started: the config failed before its requests
            return
        self.join(timeout=5)
        if self.error is None:
            try:
                self.sample()
            except (OSError, ValueError) as exc:
                self.error = str(exc)
