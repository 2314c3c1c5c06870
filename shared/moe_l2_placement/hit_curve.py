"""A hit curve: the hit rate of a layer's expert cache as a function of the share of the layer's experts it
holds, in the small text file llama-server's `--moe-cache-bytes auto` reads (`--moe-cache-hit-curve FILE`,
LLAMA_ARG_MOE_CACHE_HIT_CURVE) to split its device budget between whole layers and the cache.

The format (one reader here, one in the engine's common.cpp; keep them equal):

    # any comment lines start with '#'
    # share hit
    0.09375 0.5388
    0.109375 0.5658

One point a line: `share` = slots / experts of a layer, in (0, 1]; `hit` = the hit rate, in [0, 1]; two
decimal numbers separated by blanks (spaces or tabs), nothing else on the line. A line whose first non-blank
character is '#' is a comment, a blank line is skipped. Shares strictly increasing, hits non-decreasing, at
least 2 points. Between points the hit rate is interpolated linearly; before the first point the line runs
from (0, 0); beyond the last share it is the last point's hit.

Two curves exist: the shipped default (`DEFAULT_HIT_CURVE`, data/hit-curve-default.txt: the project's default
policy replayed on DeepSeek-V2-Lite's ESFT routing, `python bench/placement_model.py --replay-curve` writes it),
and the one the cache-manager's flywheel writes for the model it serves (moe_l2_cache.hit_curve). Standard
library only: the placement model's bare-interpreter runs read it too.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HIT_CURVE = Path(__file__).resolve().parent / "data" / "hit-curve-default.txt"
COLUMNS = "share hit"  # the header comment naming the columns

# a decimal number as the engine's reader accepts it: no hex, inf, nan, underscores (Python's float takes them)
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")

Point = tuple[float, float]


class HitCurveError(ValueError):
    """A hit curve that does not follow the format; the message names the file and line."""


@dataclass(frozen=True)
class HitCurve:
    """A checked curve (HitCurveError otherwise): points (share, hit), shares strictly increasing in (0, 1],
    hits non-decreasing in [0, 1], at least 2."""

    points: tuple[Point, ...]

    def __post_init__(self) -> None:
        problem = points_problem(self.points)
        if problem is not None:
            raise HitCurveError(problem)

    def hit(self, share: float) -> float:
        """The hit rate at `share` of a layer's experts: linear between points, from (0, 0) before the first,
        the last point's hit beyond the last share."""
        if share <= 0.0:
            return 0.0
        prev_share, prev_hit = 0.0, 0.0
        for s, h in self.points:
            if share <= s:
                return prev_hit + (h - prev_hit) * (share - prev_share) / (s - prev_share)
            prev_share, prev_hit = s, h
        return prev_hit

    def __len__(self) -> int:
        return len(self.points)


def points_problem(points: Sequence[Point]) -> str | None:
    """Why `points` is not a hit curve, None when it is one (the message names the 1-based point)."""
    if len(points) < 2:
        return f"a hit curve needs at least 2 points, got {len(points)}"
    prev: Point | None = None
    for i, (share, hit) in enumerate(points, 1):
        if problem := _point_problem(prev, share, hit):
            return f"point {i}: {problem}"
        prev = (share, hit)
    return None


def _point_problem(prev: Point | None, share: float, hit: float) -> str | None:
    if not (math.isfinite(share) and 0.0 < share <= 1.0):
        return f"share {share!r} is not in (0, 1] (slots / experts of a layer)"
    if not (math.isfinite(hit) and 0.0 <= hit <= 1.0):
        return f"hit {hit!r} is not in [0, 1]"
    if prev is not None and share <= prev[0]:
        return f"share {share!r} does not increase (the point before has {prev[0]!r})"
    if prev is not None and hit < prev[1]:
        return f"hit {hit!r} decreases (the point before has {prev[1]!r}): more slots never hit less"
    return None


def parse_hit_curve(text: str, source: str = "<hit curve>") -> HitCurve:
    """The curve in `text` (the format above); HitCurveError naming `source` and the line otherwise."""
    points: list[Point] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2 or not all(_NUMBER.fullmatch(f) for f in fields):
            raise HitCurveError(
                f"{source}:{number}: expected two decimal numbers 'share hit' (or a '#' comment), got {line[:80]!r}"
            )
        share, hit = float(fields[0]), float(fields[1])
        if problem := _point_problem(points[-1] if points else None, share, hit):
            raise HitCurveError(f"{source}:{number}: {problem}")
        points.append((share, hit))
    if len(points) < 2:
        raise HitCurveError(f"{source}: a hit curve needs at least 2 points ('share hit' lines), found {len(points)}")
    return HitCurve(tuple(points))


def read_hit_curve(path: Path | str) -> HitCurve:
    """The curve in the file at `path`; HitCurveError (a ValueError) for a malformed file, naming the file and
    line; OSError when it cannot be read."""
    path = Path(path)
    try:
        text = path.read_text(encoding="ascii")
    except UnicodeDecodeError as e:
        raise HitCurveError(f"{path}: not an ASCII text file (byte {e.start})") from None
    return parse_hit_curve(text, str(path))


def format_hit_curve(points: Iterable[Point] | HitCurve, comment: str = "") -> str:
    """The file's text: `comment` (each of its lines a '#' line), the columns' header, a point a line. Each
    number is written as Python's repr of the float, which reads back to the same float."""
    curve = points if isinstance(points, HitCurve) else HitCurve(tuple((float(s), float(h)) for s, h in points))
    out = [f"# {line}".rstrip() for line in comment.splitlines()]
    out.append(f"# {COLUMNS}")
    out += [f"{share!r} {hit!r}" for share, hit in curve.points]
    return "\n".join(out) + "\n"


def write_hit_curve(path: Path | str, points: Iterable[Point] | HitCurve, comment: str = "") -> None:
    """Write the curve to `path` atomically: a temporary file in the same folder, flushed to disk, renamed over
    `path`, so that a reader (llama-server starting) sees the old file or the new one, never half of one. The
    file is readable by all (0644): llama-server may run as another user than its writer. HitCurveError for
    points that are not a curve (nothing is written); OSError when the folder is not writable."""
    path = Path(path)
    text = format_hit_curve(points, comment)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
