"""Other processes' mappings of the model file (llama's), and paging ranges out of them.

The page cache cannot drop a page some process maps: POSIX_FADV_DONTNEED skips it, and our own
MADV_DONTNEED only unmaps it from us. llama-server maps the whole model, so every expert it has
touched stays resident until the kernel needs memory. `process_madvise(MADV_PAGEOUT)` (Linux 5.10;
file pages since 5.18 for a caller who owns the file or may write it, which root may) reclaims the
pages of a range in another process: unmapped there and, being clean, dropped from the page cache.
It needs CAP_SYS_NICE and ptrace access to that process (root, and in a container the same PID
namespace: compose's `pid: service:llama`).

The processes are found by the file's identity (device and inode) in /proc/PID/maps, not by name,
so a llama that mapped a replaced file (a deleted inode) is not touched.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path

_SYS_PIDFD_OPEN = 434  # the same number on every architecture since 5.3
_SYS_PROCESS_MADVISE = 440
_MADV_PAGEOUT = 21
_UIO_MAXIOV = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@dataclass(frozen=True)
class FileMapping:
    """One line of /proc/PID/maps for the file: [start, end) maps the file from `offset`."""

    start: int
    end: int
    offset: int

    def address(self, file_offset: int, length: int) -> tuple[int, int] | None:
        """The part of [file_offset, file_offset + length) this mapping covers, as (address, length)."""
        lo = max(file_offset, self.offset)
        hi = min(file_offset + length, self.offset + (self.end - self.start))
        return (self.start + lo - self.offset, hi - lo) if hi > lo else None


def file_identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def find_mappers(paths: list[Path], proc: Path = Path("/proc")) -> dict[int, dict[int, list[FileMapping]]]:
    """Every other process that maps one of these files (by device and inode): pid -> file index -> mappings."""
    wanted: dict[tuple[str, str], int] = {}
    for i, path in enumerate(paths):
        dev, ino = file_identity(path)
        wanted[(f"{os.major(dev):02x}:{os.minor(dev):02x}", str(ino))] = i
    own = os.getpid()
    found: dict[int, dict[int, list[FileMapping]]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            text = (entry / "maps").read_text()
        except OSError:  # gone, or not ours to read
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or (file := wanted.get((fields[3], fields[4]))) is None:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            mapping = FileMapping(start, end, int(fields[2], 16))
            found.setdefault(int(entry.name), {}).setdefault(file, []).append(mapping)
    return found


class ProcessPager:
    """Pages file ranges out of one process's mappings. Raises OSError when the kernel refuses."""

    def __init__(self, pid: int, mappings: dict[int, list[FileMapping]]) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self.pid = pid
        self.mappings = mappings
        fd = self._libc.syscall(_SYS_PIDFD_OPEN, ctypes.c_int(pid), ctypes.c_uint(0))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_open({pid}): {os.strerror(err)}")
        self._pidfd = int(fd)

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def page_out(self, ranges: list[tuple[int, int, int]]) -> int:
        """MADV_PAGEOUT on these (file, offset, length) ranges; returns the bytes advised."""
        iovecs = [
            a for file, off, length in ranges for m in self.mappings.get(file, ()) if (a := m.address(off, length))
        ]
        done = 0
        for i in range(0, len(iovecs), _UIO_MAXIOV):
            batch = iovecs[i : i + _UIO_MAXIOV]
            vec = (_Iovec * len(batch))(*(_Iovec(addr, length) for addr, length in batch))
            rc = self._libc.syscall(
                _SYS_PROCESS_MADVISE,
                ctypes.c_int(self._pidfd),
                vec,
                ctypes.c_size_t(len(batch)),
                ctypes.c_int(_MADV_PAGEOUT),
                ctypes.c_uint(0),
            )
            if rc < 0:
                err = ctypes.get_errno()
                if err == errno.ESRCH:  # the process exited meanwhile
                    break
                raise OSError(err, f"process_madvise(pid {self.pid}, MADV_PAGEOUT): {os.strerror(err)}")
            done += int(rc)
        return done

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
