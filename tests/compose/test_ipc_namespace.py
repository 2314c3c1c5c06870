"""Why compose's cache-manager has no `ipc: host` (issue 34): the expert pool locks and reads the page cache
of the model file, which is the kernel's, whatever IPC namespace a process is in. Measured here as it
happens between two containers: a process in an IPC namespace of its own (`unshare --ipc`, as a container
without `ipc: host`) maps a file and locks its pages; a process in the host's namespace then finds every
page resident, and cannot drop them while they are locked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

LOCKER = """
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(sys.argv[1], os.O_RDONLY)
m = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
assert libc.mlockall(1) == 0, os.strerror(ctypes.get_errno())  # MCL_CURRENT: the mapping's pages, read in
print(os.readlink("/proc/self/ns/ipc"), flush=True)
sys.stdin.read()  # hold the lock until told
"""

RESIDENT = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
fd = os.open(sys.argv[1], os.O_RDONLY)
size = os.fstat(fd).st_size
os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)  # what the pool's eviction does
addr = libc.mmap(None, size, 1, 1, fd, 0)
pages = (size + 4095) // 4096
vec = (ctypes.c_ubyte * pages)()
assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
print(sum(v & 1 for v in vec), pages)
"""


def _resident(path: Path) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", RESIDENT, str(path)], capture_output=True, text=True, check=True)
    found, pages = out.stdout.split()
    return int(found), int(pages)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="unshare --ipc needs root")
def test_locked_pages_are_shared_across_ipc_namespaces(tmp_path: Path) -> None:
    model = tmp_path / "model.bin"
    with model.open("wb") as out:
        out.write(os.urandom(8 << 20))
        out.flush()
        os.fsync(out.fileno())  # clean pages: dirty ones are not dropped
    assert _resident(model)[0] == 0, "the file's pages could not be dropped to start with"
    locker = subprocess.Popen(
        ["unshare", "--ipc", sys.executable, "-c", LOCKER, str(model)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert locker.stdout is not None
        namespace = locker.stdout.readline().strip()
        assert namespace and namespace != os.readlink("/proc/self/ns/ipc"), "not another IPC namespace"
        found, pages = _resident(model)
        assert found == pages, f"{found} of {pages} pages seen resident from the host's IPC namespace"
    finally:
        locker.communicate("", timeout=30)
    deadline = time.monotonic() + 10
    while _resident(model)[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _resident(model)[0] == 0, "unlocked, the pages can be dropped again"
