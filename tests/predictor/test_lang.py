# ruff: noqa: RUF001 - multilingual prompts: full-width punctuation and Cyrillic are the point
from __future__ import annotations

import pytest

from moe_l2_domains.lang import detect_lang, strip_code


@pytest.mark.parametrize(
    ("text", "lang"),
    [
        ("How do I reverse a list?", "en"),
        ("¿Cuál es el río más largo del mundo?", "en"),  # Latin script: en by design
        ("为什么天空是蓝色的？", "zh"),
        ("帮我用Python写一个快速排序", "zh"),  # an English identifier inside a Chinese instruction
        ("明日は雨が降るかもしれません。", "ja"),
        ("富士山の高さはどれくらいですか？", "ja"),
        ("오늘 날씨가 정말 좋네요", "ko"),
        ("Почему у зебры полоски?", "ru"),
        ("ما هي عاصمة فرنسا؟", "ar"),
        ("", "unknown"),
        ("1234 + 5678 = ?", "unknown"),
        ("\x00\x01\xff\ufffd", "unknown"),
    ],
)
def test_scripts(text: str, lang: str) -> None:
    assert detect_lang(text) == lang


def test_a_quoted_chinese_word_does_not_make_english_chinese() -> None:
    assert detect_lang("How do you say 你好 in English?") == "en"


def test_code_is_ignored() -> None:
    text = "这段代码为什么报错？\n```python\nfor item in items:\n    print(item.name, item.value, item.other)\n```"
    assert detect_lang(text) == "zh"
    assert "print" not in strip_code(text)
    assert detect_lang("修复 `KeyError` 的问题") == "zh"
