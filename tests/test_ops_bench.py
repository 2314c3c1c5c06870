"""`moe-l2 bench`: a user's benchmark of stock placements against the project's default, with its table, JSON
and PNG; bad input is one line. The end-to-end run uses the RPC device (the CPU under a device's name):
its figures say nothing about a GPU, only that every part runs and reads what the benchmark wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_l2_ops import bench


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moe_l2_ops.cli", "bench", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--budgets", "fifty"], "--budgets: 'fifty' is not a share"),
        (["--budgets", "100%"], "between 0% and 100%"),
        (["--model", "/nope.gguf", "--backend", "rpc"], "--model /nope.gguf does not exist"),
        (["--shape", "mixtral-9000", "--backend", "rpc"], "unknown shape 'mixtral-9000'"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    result = run_cli(*args, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr


def doc(decode: dict[str, float], device: dict[str, int]) -> dict:
    configs = {
        name: {
            "status": "measured",
            "device_expert_bytes": device[name],
            "decode_tokens_per_s": tps,
            "prompt_tokens_per_s": 10 * tps,
        }
        for name, tps in decode.items()
    }
    configs["c"] = {"status": "measured", "decode_tokens_per_s": 99.0}  # not one of the bench's placements
    return {"configs": configs}


def test_the_table_sets_the_default_against_the_best_stock_row_at_each_budget(tmp_path: Path) -> None:
    rows = bench.rows_of("50%", doc({"b": 10.0, "cp": 20.0, "ea": 30.0}, {"b": 0, "cp": 4 * 10**9, "ea": 4 * 10**9}))
    rows += bench.rows_of("25%", doc({"b": 12.0, "cp": 8.0, "ea": 6.0}, {"b": 0, "cp": 0, "ea": 2 * 10**9}))
    assert [r.config for r in rows] == ["b", "cp", "ea", "b", "cp", "ea"]
    text = bench.table(rows)
    assert "| 50% | moe-l2 default (auto) | 4.00 | 30.0 | 300.0 | **1.50x** |" in text
    assert "| 25% | moe-l2 default (auto) | 2.00 | 6.0 | 60.0 | **0.50x** |" in text  # against b, the best there
    assert bench.plot(rows, "planted", tmp_path / "p.png") == ""
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_on_the_rpc_device_writes_its_table_json_and_png(rpc_binary: Path, tmp_path: Path) -> None:
    from moe_l2_gguf.model_shapes import get_shape, write_shape_model

    model = write_shape_model(tmp_path / "ds4.gguf", get_shape("ds-v2-lite").reduced(4, 8192), progress=False).path
    out = tmp_path / "out"
    result = run_cli(
        "--backend", "rpc", "--model", str(model), "--binary", str(rpc_binary),
        "--budgets", "50%", "--tokens", "4", "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    md = (out / "bench.md").read_text()
    for label in bench.LABELS.values():
        assert f"| 50% | {label} |" in md, md
    assert "decode vs best stock" in md and "x** |" in md
    assert "machine:" in md and "moe-l2 " in md and "ds4.gguf" in md
    report = json.loads((out / "bench.json").read_text())
    assert report["backend"] == "rpc" and report["machine"]["cores"] >= 1
    measured = report["placements"]["50%"]["configs"]
    assert all(measured[c]["status"] == "measured" for c in bench.PLACEMENTS)
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_the_ram_tier_table_sets_moe_l2_against_stock_at_each_budget() -> None:
    def config(tps: float, read: float, resident: int) -> dict:
        return {"decode_tokens_per_s": tps, "read_bytes_per_token": read, "max_model_resident_bytes": resident}

    doc = {
        "budgets": {
            "50": {
                "budget_bytes": 2**30,
                "configs": {"stock": config(10.0, 8e6, 2**31), "moe-l2": config(15.0, 2e6, 2**30)},
            }
        }
    }
    lines = bench.ram_tier_lines(doc).splitlines()
    assert lines[2] == "| 50% of the experts | stock | 10.0 | 8.0 | 2.00 | 1.00 |  |"
    assert lines[3] == "| 50% of the experts | moe-l2 | 15.0 | 2.0 | 1.00 | 1.00 | **1.50x** |"
