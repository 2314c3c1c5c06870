"""What a build tells the user while it runs: a progress bar (a terminal) or a line every 10% (CI logs),
and the `[build-llama]` log lines.

Separate so that the download (source), the compile (cmake_build) and `moe-l2 bump-llama` report alike.

Standard library only, like build.py: the llama image runs build.py as a script, in a bare builder stage.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on a terminal, a line every 10% elsewhere (CI logs)."""

    def __init__(self, label: str, stream=sys.stderr) -> None:  # noqa: ANN001
        self.label = label
        self.stream = stream
        self.tty = stream.isatty()
        self.last_decile = -1
        self.start = time.monotonic()

    def update(self, done: int, total: int) -> None:
        frac = done / total if total else 0.0
        elapsed = time.monotonic() - self.start
        if self.tty:
            width = 30
            filled = int(frac * width)
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {elapsed:5.0f}s")
            self.stream.flush()
        elif int(frac * 10) > self.last_decile:
            self.last_decile = int(frac * 10)
            self.stream.write(f"{self.label}: {done}/{total} ({frac:.0%}, {elapsed:.0f}s)\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def log(msg: str) -> None:
    print(f"[build-llama] {msg}", file=sys.stderr, flush=True)
