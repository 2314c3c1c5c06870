from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_l2_ops.cli import main as cli

pytestmark = pytest.mark.slow


def test_predict_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["predict", "--tiers", "keyword", "--json", "Write", "a", "haiku", "about", "rain"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["domain"] == "creative_write"
    assert out["tier"] == "keyword"
    assert cli(["predict", "--tiers", "keyword", "求函数 f(x)=x^2 的导数"]) == 0
    assert capsys.readouterr().out.startswith("math")


def test_train_predictor_with_extra_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "labeled.jsonl"
    rows = [
        {"text": "compute the eigenvalues of this matrix", "domain": "math"},
        {"messages": [{"role": "user", "content": "tell me a story about a fox"}], "domain": "creative_write"},
        {"text": "what does 'hola' mean", "label": "translate"},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code = cli(["train-predictor", "--data", str(data), "--tiers", "keyword,tfidf", "--cache-dir", str(tmp_path / "c")])
    assert code == 0
    out = capsys.readouterr().out
    assert "5-fold accuracy on the examples" in out
    assert "MOE_L2_PREDICTOR_DATA_PATH" in out
    assert len(list((tmp_path / "c").glob("*.pkl"))) == 1
    report = json.loads(next((tmp_path / "c").glob("*.json")).read_text())
    assert report["examples"] > 380 + 3 - 1


def test_train_predictor_refuses_bad_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "hi", "domain": "astrology"}\n')
    assert cli(["train-predictor", "--data", str(data), "--tiers", "keyword,tfidf", "--cache-dir", str(tmp_path)]) == 1
    assert "astrology" in capsys.readouterr().err
    data.write_text("not json\n")
    assert cli(["train-predictor", "--data", str(data), "--cache-dir", str(tmp_path)]) == 1
    assert "bad.jsonl:1" in capsys.readouterr().err
