from __future__ import annotations

from pathlib import Path

import pytest

from moe_l2_ops.predictor_replicas import predictor_services, predictor_urls
from moe_l2_ops.stack import StackSettings, stack_services


def test_one_predictor_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_L2_PREDICTOR_REPLICAS", raising=False)
    monkeypatch.delenv("MOE_L2_PREDICTOR_PORT", raising=False)
    [spec] = predictor_services()
    assert spec.name == "predictor"
    assert spec.url == "http://127.0.0.1:11437"
    assert spec.argv[-2:] == ["-m", "moe_l2_predictor"]
    assert not spec.required, "the gateway serves without the predictor: its crash loop must not stop the stack"


def test_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_L2_PREDICTOR_REPLICAS", "3")
    monkeypatch.setenv("MOE_L2_PREDICTOR_PORT", "12000")
    specs = predictor_services()
    assert [s.name for s in specs] == ["predictor-1", "predictor-2", "predictor-3"]
    assert [s.env["MOE_L2_PREDICTOR_PORT"] for s in specs] == ["12000", "12100", "12200"]
    assert predictor_urls() == "http://127.0.0.1:12000,http://127.0.0.1:12100,http://127.0.0.1:12200"
    names = [s.name for s in stack_services(StackSettings(), Path("/nonexistent.gguf"), Path("/bin/true"))]
    assert names.index("llama") < names.index("predictor-1")
    monkeypatch.setenv("MOE_L2_PREDICTOR_REPLICAS", "0")
    with pytest.raises(ValueError, match="between 1 and 32"):
        predictor_services()
