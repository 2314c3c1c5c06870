"""A memory balloon: holds anonymous memory so that the page cache cannot keep a whole model file.

bench/ram_tier.py compares llama.cpp's mmap and moe-l2's RAM tier "at the same memory budget"; on a
machine with more RAM than the budget the kernel would otherwise keep every page of the model cached
and both would run from memory. There is no swap here, so touched anonymous memory stays put and the
page cache is all that is left to the model. The balloon is a separate process so that the kernel,
not the benchmark, is what is squeezed, and so that it can be killed on its own.

Safety, because an OOM kill of llama-server (or of the developer's shell) would ruin more than a run:
  * before allocating, MemAvailable must leave at least --margin-mib after the balloon, and --leave-mib
    (the room asked for) must be at least the margin: otherwise it refuses (exit 3, one line);
  * every --poll-s (0.1 s) it reads MemAvailable; below the margin it frees chunks until back above it
    (each release is one JSON line on stdout), so anything that grows later wins over the balloon;
    with --leave-mib, memory that other processes give back later (MemAvailable a chunk above the room
    asked for) is taken up again, until the first release;
  * its oom_score_adj is 1000: if the OOM killer comes anyway, the balloon is its first choice;
  * it exits by itself when its parent dies (PR_SET_PDEATHSIG and a getppid() poll) and after --max-s.

    python bench/balloon.py (--size-mib N | --leave-mib N) [--margin-mib 768] [--max-s 3600]
        [--chunk-mib 64] [--poll-s 0.1]

stdout: JSON lines, {"event": "ready", ...} once inflated, then "freed" / "exit" events.

BalloonProc, at the end, is the other side: bench/ram_tier.py starts the balloon as a child with it and reads
those lines (both sides of one protocol in one file).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules
from harness.output import meminfo_bytes
from harness.servers import BenchError

MIB = 1 << 20
PR_SET_PDEATHSIG = 1
EXIT_REFUSED = 3


def mem_available() -> int:
    """MemAvailable in bytes: the kernel's estimate of what can be allocated without swapping, page
    cache that can be dropped included (so model pages in the cache do not count against it)."""
    available = meminfo_bytes("MemAvailable")
    if not available:
        raise RuntimeError("/proc/meminfo has no MemAvailable")
    return available


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "t": round(time.time(), 3), **fields}), flush=True)


def set_pdeathsig(sig: int = signal.SIGTERM) -> None:
    """Linux: the kernel sends `sig` when the parent thread exits; best effort elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def set_oom_score_adj(value: int = 1000) -> bool:
    try:
        Path("/proc/self/oom_score_adj").write_text(str(value))
        return True
    except OSError:
        return False


class Balloon:
    """Chunks of touched anonymous memory; released one by one from the last."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.chunks: list[mmap.mmap] = []

    @property
    def held(self) -> int:
        return sum(len(c) for c in self.chunks)

    def grow(self, nbytes: int) -> None:
        page = mmap.PAGESIZE
        while nbytes > 0:
            size = min(self.chunk_bytes, nbytes)
            size = max(page, size // page * page)
            chunk = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            # a write to every byte: each page is faulted in and backed by real memory (zero pages
            # that were only read would share the one zero page and hold nothing)
            ones = b"\x01" * min(size, 8 * MIB)
            for off in range(0, size, len(ones)):
                chunk[off : off + len(ones)] = ones[: size - off]
            self.chunks.append(chunk)
            nbytes -= size

    def shrink_one(self) -> int:
        if not self.chunks:
            return 0
        chunk = self.chunks.pop()
        size = len(chunk)
        chunk.close()  # munmap: the pages go back to the kernel at once
        return size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--size-mib", type=float, help="hold this much")
    what.add_argument("--leave-mib", type=float, help="hold what it takes to leave MemAvailable at about this")
    parser.add_argument("--margin-mib", type=float, default=768.0, help="MemAvailable never left below this")
    parser.add_argument("--max-s", type=float, default=3600.0, help="exit after this long whatever happens")
    parser.add_argument("--chunk-mib", type=float, default=64.0, help="allocation and release granularity")
    parser.add_argument("--poll-s", type=float, default=0.1)
    args = parser.parse_args(argv)
    if args.margin_mib < 0 or args.chunk_mib <= 0 or args.max_s <= 0 or args.poll_s <= 0:
        parser.error("--margin-mib must be >= 0; --chunk-mib, --max-s and --poll-s > 0")
    return args


def plan(available: int, size: int | None, leave: int | None, margin: int) -> tuple[int, str | None]:
    """(bytes to hold, refusal or None). Pure, for the tests."""
    if leave is not None:
        if leave < margin:
            return 0, f"--leave-mib {leave / MIB:.0f} is below the margin {margin / MIB:.0f} MiB"
        if available < leave:
            return 0, (
                f"MemAvailable is {available / MIB:.0f} MiB, less than the {leave / MIB:.0f} MiB to leave: "
                "this machine cannot run at that budget (lower the budget or the margin)"
            )
        return available - leave, None
    assert size is not None
    if available - size < margin:
        return 0, (
            f"MemAvailable is {available / MIB:.0f} MiB: holding {size / MIB:.0f} MiB would leave less than "
            f"the margin of {margin / MIB:.0f} MiB"
        )
    return size, None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parent = os.getppid()
    set_pdeathsig()
    oom_ok = set_oom_score_adj(1000)
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    margin = int(args.margin_mib * MIB)
    available = mem_available()
    size = None if args.size_mib is None else int(args.size_mib * MIB)
    leave = None if args.leave_mib is None else int(args.leave_mib * MIB)
    target, refusal = plan(available, size, leave, margin)
    if refusal:
        emit("refused", reason=refusal, mem_available=available)
        print(f"balloon: refused: {refusal}", file=sys.stderr, flush=True)
        return EXIT_REFUSED

    balloon = Balloon(int(args.chunk_mib * MIB))
    start = time.monotonic()
    freed_total, releases, regrown = 0, 0, 0
    # inflate a chunk at a time, checking the margin between chunks: the room may shrink meanwhile
    while balloon.held < target and not stop:
        if mem_available() - balloon.chunk_bytes < margin:
            break
        balloon.grow(min(balloon.chunk_bytes, target - balloon.held))
    emit(
        "ready",
        held_bytes=balloon.held,
        target_bytes=target,
        mem_available_before=available,
        mem_available=mem_available(),
        margin_bytes=margin,
        oom_score_adj=1000 if oom_ok else None,
        pid=os.getpid(),
    )
    why = "signal"
    while not stop:
        if os.getppid() != parent:
            why = "parent died"
            break
        if time.monotonic() - start > args.max_s:
            why = "max-s"
            break
        avail = mem_available()
        if leave is not None and avail > leave + balloon.chunk_bytes and not releases:
            # a shared machine: memory others gave back would be room the budget never meant; take it
            # (not after a release: then something here needs it, and the margin comes first)
            balloon.grow(balloon.chunk_bytes)
            regrown += balloon.chunk_bytes
        elif avail < margin and balloon.chunks:
            freed = 0
            while balloon.chunks and mem_available() < margin:
                freed += balloon.shrink_one()
            freed_total += freed
            releases += 1
            emit("freed", freed_bytes=freed, held_bytes=balloon.held, mem_available_was=avail, margin_bytes=margin)
        time.sleep(args.poll_s)
    emit(
        "exit",
        why=why,
        held_bytes=balloon.held,
        freed_bytes_total=freed_total,
        releases=releases,
        regrown_bytes=regrown,
    )
    return 0


# -- the client: bench/ram_tier.py runs the balloon as a child ---------------------------------------


class BalloonProc:
    """bench/balloon.py as a child: started with the room to leave, its JSON lines collected."""

    def __init__(self, leave_bytes: int, margin_bytes: int, max_s: float) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--leave-mib", f"{leave_bytes / MIB:.1f}"]
        argv += ["--margin-mib", f"{margin_bytes / MIB:.1f}", "--max-s", str(int(max_s))]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: list[dict] = []
        self.lines: queue.Queue[dict] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self.events.append(event)
            self.lines.put(event)

    def wait_ready(self, timeout_s: float = 600) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                event = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    err = self.proc.stderr.read() if self.proc.stderr else ""
                    why = f"the balloon exited ({self.proc.returncode}) before it was ready: {err.strip()}"
                    raise BenchError(why) from None
                continue
            if event["event"] == "refused":
                raise BenchError(f"the balloon refused: {event['reason']}")
            if event["event"] == "ready":
                return event
        raise BenchError(f"the balloon was not ready within {timeout_s:.0f}s")

    def stop(self) -> dict:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(timeout=5)
        freed = sum(e.get("freed_bytes", 0) for e in self.events if e["event"] == "freed")
        ready = next((e for e in self.events if e["event"] == "ready"), {})
        end = next((e for e in self.events if e["event"] == "exit"), {})
        return {
            "held_bytes": ready.get("held_bytes"),
            "mem_available_after_inflating": ready.get("mem_available"),
            "freed_bytes": freed,
            "releases": sum(1 for e in self.events if e["event"] == "freed"),
            "regrown_bytes": end.get("regrown_bytes"),
            "held_bytes_at_end": end.get("held_bytes"),
        }


if __name__ == "__main__":
    sys.exit(main())
