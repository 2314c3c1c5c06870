# ruff: noqa: RUF001 - multilingual prompts: full-width punctuation and Cyrillic are the point
from __future__ import annotations

import random

import pytest

from moe_l2_domains.keywords import KeywordClassifier, KeywordPrediction
from moe_l2_domains.taxonomy import parse_taxonomy

# Clear cases: one per domain and language where it applies.
CLEAR = [
    ("Write a Python function that merges two sorted lists", "codegen"),
    ("I get KeyError: 'id' when I read the dict, how do I fix it?", "debug"),
    ("Solve the equation 2x + 3 = 11", "math"),
    ("Riddle: what has hands but cannot clap?", "logic"),
    ("Who was the first emperor of Rome?", "general_qa"),
    ("Write a short poem about the sea", "creative_write"),
    ("Translate 'good night' into German", "translate"),
    ("Docker 容器启动失败，日志显示端口被占用，怎么解决？", "chinese_tech"),
    ("解方程 3x - 5 = 10", "math"),
    ("把这句话翻译成英文：今天天气很好", "translate"),
    ("写一首关于月亮的诗", "creative_write"),
]

# Keyword traps: a word that belongs to another domain must not decide.
TRAPS = [
    ("How long can a python snake grow, and is it venomous?", "general_qa"),
    ("Write a haiku about a segfault", "creative_write"),
    ("Write a poem about my code that keeps crashing", "creative_write"),
    ("一个长方形的长是8厘米，宽是5厘米，它的面积是多少？", "math"),  # Chinese, but math, not chinese_tech
    ("甲说乙在说谎，乙说丙在说谎，丙说甲和乙都在说谎。谁说的是真话？", "logic"),
    ("用Python写一个函数，计算列表的平均值", "chinese_tech"),  # Chinese code request
    ("Python 报错 KeyError 怎么办", "chinese_tech"),  # a Chinese debug question is chinese_tech
]


@pytest.mark.parametrize(("text", "domain"), CLEAR + TRAPS)
def test_domains(keywords: KeywordClassifier, text: str, domain: str) -> None:
    prediction = keywords.predict(text)
    assert prediction.domain == domain, prediction.scores
    assert 0.0 < prediction.confidence <= 1.0


def test_the_public_interface(keywords: KeywordClassifier) -> None:
    p = keywords.predict("write a function")
    assert isinstance(p, KeywordPrediction)
    assert set(p.scores) == set(keywords.taxonomy.names)
    assert abs(sum(p.scores.values()) - 1.0) < 1e-9
    assert p.lang == "en"
    assert KeywordClassifier().taxonomy.digest() == keywords.taxonomy.digest()  # default: shipped taxonomy


@pytest.mark.parametrize("text", ["", "   ", "hello", "\x00\x01\x02", "🙂🙂🙂"])
def test_no_evidence_falls_back_to_general_qa_with_low_confidence(keywords: KeywordClassifier, text: str) -> None:
    p = keywords.predict(text)
    assert p.domain == "general_qa"
    assert p.confidence < 0.5


def small(**domains: dict) -> KeywordClassifier:
    return KeywordClassifier(parse_taxonomy({"fallback": "other", "domains": [{"name": "other"}, *domains.values()]}))


def test_latin_keywords_match_whole_words_only() -> None:
    k = small(a={"name": "code", "keywords": {"class": 3, "sum": 3, "c++": 3, "node.js": 3}})
    assert k.predict("a classic summary of the classroom").domain == "other"
    assert k.predict("define a class").domain == "code"
    assert k.predict("the sum is wrong").domain == "code"
    assert k.predict("I like C++ a lot").domain == "code"
    assert k.predict("deploy Node.js.").domain == "code"
    assert k.predict("classes").domain == "code"  # a trailing plural s is forgiven


def test_phrases_and_fullwidth_text_match() -> None:
    k = small(a={"name": "code", "keywords": {"write a function": 3}})
    assert k.predict("Please WRITE A FUNCTION now").domain == "code"
    assert k.predict("Ｗｒｉｔｅ ａ ｆｕｎｃｔｉｏｎ").domain == "code"  # NFKC folds full-width forms
    assert k.predict("write the function").domain == "other"


def test_cjk_keywords_match_inside_text() -> None:
    k = small(a={"name": "poetry", "keywords": {"写一首": 3}}, b={"name": "db", "keywords": {"数据库": 3}})
    assert k.predict("请帮我写一首诗").domain == "poetry"
    assert k.predict("数据库连接失败").domain == "db"


def test_patterns_are_searched_in_the_original_text() -> None:
    k = small(a={"name": "debug", "patterns": {r"[a-z](?:Error|Exception)\b": 3}})
    assert k.predict("got a FooBarError here").domain == "debug"
    assert k.predict("got a foobarerror here").domain == "other"


def test_language_rules() -> None:
    k = small(
        code={"name": "code", "keywords": {"python": 3}},
        zh={"name": "zh_tech", "languages": ["zh"], "absorbs": ["code"], "keywords": {"服务器": 3}},
    )
    assert k.predict("python please").domain == "code"
    assert k.predict("用python写一个函数").domain == "zh_tech"
    assert k.predict("python please").scores["zh_tech"] == 0.0
    # a restricted domain scores nothing outside its languages, even with its own keywords
    assert k.predict("サーバー 服务器 についての質問です").scores["zh_tech"] == 0.0


def test_more_evidence_means_more_confidence(keywords: KeywordClassifier) -> None:
    weak = keywords.predict("python")
    strong = keywords.predict("Write a Python function and a class, with unit tests, in a script")
    assert weak.domain == strong.domain == "codegen"
    assert strong.confidence > weak.confidence


def test_weighted_segments(keywords: KeywordClassifier) -> None:
    p = keywords.predict_weighted([("and now as a poem", 1.0), ("Write a Python function for sorting", 0.3)])
    assert p.domain == "creative_write"
    p = keywords.predict_weighted([("and in Rust?", 1.0), ("Write a Python function for sorting", 0.3)])
    assert p.domain == "codegen"


def test_huge_and_garbage_inputs_give_a_prediction(keywords: KeywordClassifier) -> None:
    rng = random.Random(0)
    garbage = bytes(rng.randrange(256) for _ in range(100_000)).decode("latin-1")
    for text in ("x" * 1_000_000, "solve the integral " * 60_000, garbage, "\ud800\udfff lone surrogates"):
        p = keywords.predict(text)
        assert p.domain in keywords.taxonomy.names
    # only the head and tail of a huge text are read: a keyword in the middle is not seen
    assert keywords.predict("a" * 500_000 + " haiku " + "a" * 500_000).domain == "general_qa"
