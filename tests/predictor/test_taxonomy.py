from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moe_l2_contracts.domains import DEFAULT_DOMAINS
from moe_l2_domains.lang import detect_lang
from moe_l2_domains.taxonomy import TaxonomyError, load_taxonomy, parse_taxonomy
from tests.predictor.conftest import HELDOUT

# Domains whose prompts may be Chinese: all but the ones chinese_tech absorbs in Chinese.
CHINESE_APPLIES = {"math", "logic", "general_qa", "creative_write", "translate", "chinese_tech"}


def test_the_shipped_taxonomy_has_the_default_domains(taxonomy) -> None:
    assert taxonomy.names == DEFAULT_DOMAINS
    assert taxonomy.fallback == "general_qa"
    for d in taxonomy.domains:
        assert d.description and "\n" not in d.description
        assert len(d.keywords) >= 20, d.name
        assert len(d.examples) >= 40, d.name
        assert len(set(d.examples)) == len(d.examples), d.name


def test_examples_vary_in_length_and_language(taxonomy) -> None:
    for d in taxonomy.domains:
        lengths = sorted(len(e) for e in d.examples)
        assert lengths[0] < 40 < lengths[-1], d.name
        langs = {detect_lang(e) for e in d.examples}
        if d.name in CHINESE_APPLIES:
            assert "zh" in langs, d.name
        if d.name != "chinese_tech":
            assert len(langs) >= 2, (d.name, langs)  # (Latin-script languages all count as en)
    assert {detect_lang(e) for e in taxonomy.domain("chinese_tech").examples} == {"zh"}
    assert taxonomy.domain("chinese_tech").languages == ("zh",)


def test_heldout_and_calibration_never_overlap_the_examples(taxonomy) -> None:
    examples = {text for text, _ in taxonomy.labeled_examples()}
    calibration = {text for text, _ in taxonomy.calibration_prompts()}
    heldout = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    heldout_texts = {row.get("text") or row["messages"][-1]["content"] for row in heldout}
    assert len(heldout) >= 200
    assert {row["domain"] for row in heldout} == set(taxonomy.names)
    assert not examples & calibration
    assert not heldout_texts & examples
    assert not heldout_texts & calibration


def test_digest_follows_the_content(taxonomy, tmp_path: Path) -> None:
    data = yaml.safe_load((Path(taxonomy.source)).read_text())
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    assert load_taxonomy(path).digest() == taxonomy.digest()
    data["domains"][0]["examples"].append("one more example")
    assert parse_taxonomy(data).digest() != taxonomy.digest()


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"domains": []}, "non-empty"),
        ({"domains": [{"name": "a"}, {"name": "a"}]}, "duplicate"),
        ({"domains": [{"name": "bad name!"}]}, "name must match"),
        ({"domains": [{"name": "a", "keywords": {"x": -1}}]}, "positive"),
        ({"domains": [{"name": "a", "patterns": {"(": 1}}]}, "patterns"),
        ({"domains": [{"name": "a", "absorbs": ["b"]}]}, "unknown"),
        ({"fallback": "z", "domains": [{"name": "a"}]}, "fallback"),
        ({"domains": [{"name": "a", "examples": "not a list"}]}, "list of strings"),
    ],
)
def test_malformed_taxonomies_are_refused(doc: dict, message: str) -> None:
    with pytest.raises(TaxonomyError, match=message):
        parse_taxonomy(doc)


def test_a_keyword_list_means_weight_one() -> None:
    t = parse_taxonomy({"domains": [{"name": "a", "keywords": ["x", "y"]}, {"name": "b"}]})
    assert t.domain("a").keywords == {"x": 1.0, "y": 1.0}
    assert t.fallback == "a"
