"""The hit curve file (moe_l2_placement.hit_curve), which llama-server's `--moe-cache-bytes auto` reads with
`--moe-cache-hit-curve`: its reader and writer (a round trip, every malformed file refused naming the line and
why), the reading between points, and the shipped default: the placement model's one source of ESFT_CURVE's
hit rates, what `--replay-curve` writes, and package data of the wheel. No GPU, no server."""

from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path

import pytest

from moe_l2_placement.choose import ENGINE_HIT_CURVE, UNIFORM_HIT_CURVE, engine_auto_split
from moe_l2_placement.curve import ESFT_CURVE, ESFT_HIT_CURVE
from moe_l2_placement.hit_curve import (
    DEFAULT_HIT_CURVE,
    HitCurve,
    HitCurveError,
    format_hit_curve,
    parse_hit_curve,
    read_hit_curve,
    write_hit_curve,
)
from tests.benches import load_bench

REPO = Path(__file__).resolve().parent.parent


def test_a_curve_reads_back_as_written(tmp_path: Path) -> None:
    points = [(1 / 3, 0.25), (2 / 3, 0.625), (1.0, 1.0)]  # 1/3 has no short decimal: repr round-trips it
    path = tmp_path / "curve.txt"
    write_hit_curve(path, points, "first line\nsecond line")
    text = path.read_text()
    assert text.splitlines()[:3] == ["# first line", "# second line", "# share hit"]
    assert text.splitlines()[3] == "0.3333333333333333 0.25"
    assert read_hit_curve(path).points == tuple(points)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # llama-server may run as another user
    assert [p.name for p in tmp_path.iterdir()] == ["curve.txt"]  # no temporary file left


def test_the_format_s_freedoms() -> None:
    """Comments anywhere (a '#' first on the line, after blanks too), blank lines, tabs, CRLF, exponents."""
    text = "# a\n\n  # indented comment\r\n0.25\t0.5\r\n   \n5e-1 0.75\n# between\n1 1.0\n"
    assert parse_hit_curve(text).points == ((0.25, 0.5), (0.5, 0.75), (1.0, 1.0))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "<hit curve>: a hit curve needs at least 2 points ('share hit' lines), found 0"),
        ("# only comments\n0.5 0.5\n", "<hit curve>: a hit curve needs at least 2 points ('share hit' lines), found 1"),
        ("0.5 0.5\n1 1 1\n", "<hit curve>:2: expected two decimal numbers 'share hit' (or a '#' comment), got '1 1 1'"),
        ("0.5\n1 1\n", "<hit curve>:1: expected two decimal numbers 'share hit' (or a '#' comment), got '0.5'"),
        ("0.5 0.5 # why\n1 1\n", "<hit curve>:1: expected two decimal numbers"),  # no comment after the numbers
        ("0.5 half\n1 1\n", "<hit curve>:1: expected two decimal numbers"),
        ("0.5 nan\n1 1\n", "<hit curve>:1: expected two decimal numbers"),  # what C's strtod reads, Python's too
        ("0x1p-1 0.5\n1 1\n", "<hit curve>:1: expected two decimal numbers"),
        ("0.5 0.5\n1_0 1\n", "<hit curve>:2: expected two decimal numbers"),  # Python's float reads 1_0 as 10
        ("0 0\n1 1\n", "<hit curve>:1: share 0.0 is not in (0, 1] (slots / experts of a layer)"),
        ("0.5 0.5\n1.5 1\n", "<hit curve>:2: share 1.5 is not in (0, 1] (slots / experts of a layer)"),
        ("0.5 -0.1\n1 1\n", "<hit curve>:1: hit -0.1 is not in [0, 1]"),
        ("0.5 0.5\n1 1.01\n", "<hit curve>:2: hit 1.01 is not in [0, 1]"),
        ("0.5 0.5\n0.5 0.6\n", "<hit curve>:2: share 0.5 does not increase (the point before has 0.5)"),
        ("0.5 0.5\n0.25 0.6\n", "<hit curve>:2: share 0.25 does not increase (the point before has 0.5)"),
        (
            "0.25 0.5\n0.5 0.4\n",
            "<hit curve>:2: hit 0.4 decreases (the point before has 0.5): more slots never hit less",
        ),
    ],
)
def test_a_malformed_curve_is_refused_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(HitCurveError) as err:
        parse_hit_curve(text)
    assert str(err.value).startswith(message)


def test_a_file_s_errors_name_it(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("# share hit\n0.5 0.5\n0.25 0.75\n")
    with pytest.raises(HitCurveError, match=rf"^{re.escape(str(path))}:3: share 0\.25 does not increase"):
        read_hit_curve(path)
    path.write_bytes(b"0.5 0.5\n1 1\n# \xe9\n")
    with pytest.raises(HitCurveError, match=rf"^{re.escape(str(path))}: not an ASCII text file \(byte 14\)"):
        read_hit_curve(path)
    with pytest.raises(FileNotFoundError):
        read_hit_curve(tmp_path / "missing.txt")


def test_points_that_are_no_curve_are_not_written(tmp_path: Path) -> None:
    path = tmp_path / "curve.txt"
    path.write_text("0.5 0.5\n1 1\n")
    with pytest.raises(HitCurveError, match=r"point 2: hit 0\.25 decreases"):
        write_hit_curve(path, [(0.5, 0.5), (1.0, 0.25)])
    with pytest.raises(HitCurveError, match="at least 2 points, got 1"):
        HitCurve(((1.0, 1.0),))
    assert path.read_text() == "0.5 0.5\n1 1\n"  # the old file stands
    assert [p.name for p in tmp_path.iterdir()] == ["curve.txt"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "curve.txt"
    write_hit_curve(path, [(0.5, 0.5), (1.0, 1.0)])
    before = path.read_text()

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        write_hit_curve(path, [(0.5, 0.6), (1.0, 1.0)])
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["curve.txt"]


def test_between_points_the_curve_is_a_line() -> None:
    curve = HitCurve(((0.25, 0.5), (0.5, 0.6), (0.75, 0.9)))
    assert curve.hit(0.0) == 0.0 and curve.hit(-1.0) == 0.0
    assert curve.hit(0.125) == pytest.approx(0.25)  # from (0, 0) to the first point
    assert curve.hit(0.25) == 0.5  # a point is its own value, exactly
    assert curve.hit(0.375) == pytest.approx(0.55)
    assert curve.hit(0.625) == pytest.approx(0.75)
    assert curve.hit(0.75) == 0.9
    assert curve.hit(1.0) == 0.9 and curve.hit(2.0) == 0.9  # the last hit beyond the last share
    # a llama-server without --moe-cache-hit-curve: a cache of a share of the experts hits that share
    assert [UNIFORM_HIT_CURVE.hit(s / 8) for s in range(9)] == [s / 8 for s in range(9)]


# -- the shipped default ------------------------------------------------------------------------------------------


def test_the_shipped_curve_is_the_replay_s_hit_rates() -> None:
    """59 points, s / 64 for s = 6..64, each ESFT_CURVE's hit rate: the placement model reads its hit rates
    from this file, and so does the engine's auto placement under `moe-l2 up` (--moe-cache-hit-curve)."""
    shipped = read_hit_curve(DEFAULT_HIT_CURVE)
    assert len(shipped) == 59
    assert [share for share, _ in shipped.points] == [s / 64 for s in range(6, 65)]
    assert [hit for _, hit in shipped.points] == [ESFT_CURVE[s][0] for s in range(6, 65)]
    assert shipped == ESFT_HIT_CURVE == ENGINE_HIT_CURVE
    # the engine's arithmetic in Python reads it at a layer's slot counts as the table it replaces did
    for s in range(6, 65):
        assert ENGINE_HIT_CURVE.hit(s / 64) == ESFT_CURVE[s][0]
    text = DEFAULT_HIT_CURVE.read_text()
    assert "python bench/placement_model.py --replay-curve" in text
    assert "DeepSeek-V2-Lite's ESFT routing" in text


def test_the_shipped_curve_is_what_replay_curve_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--replay-curve writes the file byte for byte (the replay itself, a minute, stands in for ESFT_CURVE:
    tests/test_placement_model.py checks a row of it) and prints the rest of the table as curve.py holds it."""
    pm = load_bench("placement_model")
    monkeypatch.setattr(pm, "replay_curve", lambda slots: {s: ESFT_CURVE[s] for s in slots})
    out = tmp_path / "curve.txt"
    assert pm.main(["--replay-curve", "--hit-curve-out", str(out)]) == 0
    assert out.read_text() == DEFAULT_HIT_CURVE.read_text()
    assert format_hit_curve(ESFT_HIT_CURVE, pm.REPLAY_CURVE_COMMENT) == DEFAULT_HIT_CURVE.read_text()


def test_the_engine_split_follows_the_curve() -> None:
    """A pessimistic curve (uniform routing) keeps more whole layers on the device than the shipped one."""
    expert, layers = 4_866_048, 26
    budget = layers * 64 * expert // 2
    shipped = engine_auto_split(layers, 64, 6, expert, budget, 35e-6, 1e-4)
    uniform = engine_auto_split(layers, 64, 6, expert, budget, 35e-6, 1e-4, UNIFORM_HIT_CURVE)
    assert shipped == engine_auto_split(layers, 64, 6, expert, budget, 35e-6, 1e-4, ESFT_HIT_CURVE)
    assert uniform.n_dev > shipped.n_dev


def test_the_wheel_ships_the_curve() -> None:
    """Package data: `moe-l2 up` (llama_server_env) and the placement model read it from the installed package."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "data/*" in pyproject["tool"]["setuptools"]["package-data"]["moe_l2_placement"]
    assert DEFAULT_HIT_CURVE.parent.name == "data" and DEFAULT_HIT_CURVE.parent.parent.name == "moe_l2_placement"


def test_a_shipped_curve_off_the_replay_s_slot_counts_is_refused() -> None:
    """curve.py joins the file's hit rates to the replay's other figures by slot count: a file regenerated for
    other counts than the table (or edited by hand) fails at import, saying how to regenerate both."""
    from moe_l2_placement.curve import _ESFT_REPLAY, _esft_curve

    assert _esft_curve(ESFT_HIT_CURVE, _ESFT_REPLAY) == ESFT_CURVE
    off = HitCurve(tuple((share * 0.99, hit) for share, hit in ESFT_HIT_CURVE.points))
    with pytest.raises(HitCurveError, match=r"its shares are not s / 64 for the replay's slot counts 6\.\.64"):
        _esft_curve(off, _ESFT_REPLAY)
