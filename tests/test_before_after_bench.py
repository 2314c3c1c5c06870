"""bench/before_after.py's pure parts: which numbers it compares, how, and whose packages a run imports."""

from __future__ import annotations

import pytest

from tests.benches import load_bench


@pytest.fixture(scope="module")
def before_after():
    return load_bench("before_after")


def test_compare_takes_medians_of_the_named_metrics_only(before_after):
    def run(p50: float, acc: float) -> dict:
        return {"latency": {"hybrid": {"p50_ms": p50, "n": 600}}, "accuracy": {"hybrid": {"accuracy": acc}}, "ok": True}

    before = [run(2.0, 0.9), run(4.0, 0.9), run(3.0, 0.9)]
    after = [run(3.3, 0.9), run(3.0, 0.9), run(9.0, 0.9)]
    rows = before_after.compare(before, after, before_after.METRICS["predictor_eval"])
    assert set(rows) == {"latency.hybrid.p50_ms", "accuracy.hybrid.accuracy"}  # not n, not the bool
    assert rows["latency.hybrid.p50_ms"]["before"] == 3.0 and rows["latency.hybrid.p50_ms"]["after"] == 3.3
    assert rows["latency.hybrid.p50_ms"]["ratio"] == pytest.approx(1.1)
    assert rows["accuracy.hybrid.accuracy"]["ratio"] == 1.0


def test_a_metric_only_one_side_has_is_left_out(before_after):
    before = [{"latency": {"keyword": {"p50_ms": 1.0}}}]
    after = [{"latency": {"keyword": {"p50_ms": 1.0}, "new_tier": {"p50_ms": 5.0}}}]
    assert set(before_after.compare(before, after, {"latency.*.p50_ms": "lower"})) == {"latency.keyword.p50_ms"}


def test_a_run_imports_its_own_checkouts_packages(before_after, tmp_path):
    for package in ("shared/moe_l2_common", "services/proxy/moe_l2_proxy"):  # an old layout, no ops/
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "services" / "llama").mkdir()  # no package inside: not on the path
    assert before_after.package_path(tmp_path).split(":") == [
        str(tmp_path / "shared"),
        str(tmp_path / "services/proxy"),
    ]
