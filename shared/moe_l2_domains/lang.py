"""Script-based language detection: zh, ja, ko, ru, ar, he, el, th, hi, en (any Latin script), unknown.

Good enough to tell which script a prompt's instruction is written in, which is all the predictor
needs (chinese_tech is "technology, asked in Chinese"). Latin-script languages are all `en`:
telling Spanish from English needs a statistical model and nothing downstream depends on it.
Code (fenced blocks, inline backticks) is ignored, so a Chinese question about an English stack
trace is still Chinese. Standard library only; a few microseconds for a typical prompt.
"""

from __future__ import annotations

import re

UNKNOWN = "unknown"

_CODE = re.compile(r"```.*?(?:```|$)|`[^`\n]*`", re.DOTALL)
_LATIN_WORD = re.compile(r"[A-Za-z\u00c0-\u024f]{2,}")
_HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ffff]")
_KANA = re.compile(r"[\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9f]")
_HANGUL = re.compile(r"[\uac00-\ud7af\u1100-\u11ff\u3130-\u318f]")
# Scripts whose words are separated by spaces: counted in words, like Latin.
_WORD_SCRIPTS: dict[str, re.Pattern[str]] = {
    "ru": re.compile(r"[\u0400-\u04ff]{2,}"),
    "ar": re.compile(r"[\u0600-\u06ff]{2,}"),
    "he": re.compile(r"[\u0590-\u05ff]{2,}"),
    "el": re.compile(r"[\u0370-\u03ff]{2,}"),
    "hi": re.compile(r"[\u0900-\u097f]{2,}"),
}
_THAI = re.compile(r"[\u0e00-\u0e7f]")
# Any letter of a script other than Latin and Han: most non-ASCII prompts have none, and one
# search for them saves the per-script passes.
_OTHER = re.compile(
    r"[\u0370-\u06ff\u0900-\u097f\u0e00-\u0e7f\u1100-\u11ff\u3040-\u30ff\u3130-\u318f\u31f0-\u31ff\uac00-\ud7af\uff66-\uff9f]"
)
# Only the start of a long text is looked at: the instruction is there, and a pasted book is not.
SCAN_CHARS = 2000

# A script wins over Latin when it carries at least this share of the Latin word count: a Chinese
# instruction usually surrounds English identifiers, an English one sometimes quotes a Chinese word.
_OVER_LATIN = 0.4
# Characters per word-equivalent in scripts written without spaces.
_HAN_PER_WORD = 1.5
_HANGUL_PER_WORD = 2.5
_THAI_PER_WORD = 4.0


def strip_code(text: str) -> str:
    """The text without fenced code blocks and inline code."""
    return _CODE.sub(" ", text) if "`" in text else text


def detect_lang(text: str) -> str:
    """The language code of the text's dominant script (see the module docstring)."""
    text = strip_code(text[:SCAN_CHARS])
    latin = len(_LATIN_WORD.findall(text))
    if text.isascii():
        return "en" if latin else UNKNOWN
    han = len(_HAN.findall(text))
    candidates: dict[str, float] = {}
    if _OTHER.search(text) is None:
        if han:
            candidates["zh"] = han / _HAN_PER_WORD
    else:
        kana = len(_KANA.findall(text))
        if kana >= 2:
            # Japanese mixes kanji with kana; any real amount of kana makes it Japanese.
            candidates["ja"] = (kana + han) / _HAN_PER_WORD
        elif han:
            candidates["zh"] = han / _HAN_PER_WORD
        if hangul := len(_HANGUL.findall(text)):
            candidates["ko"] = hangul / _HANGUL_PER_WORD
        if thai := len(_THAI.findall(text)):
            candidates["th"] = thai / _THAI_PER_WORD
        for code, pattern in _WORD_SCRIPTS.items():
            if words := len(pattern.findall(text)):
                candidates[code] = float(words)
    if candidates:
        code, units = max(candidates.items(), key=lambda kv: kv[1])
        if units >= 1.0 and units >= _OVER_LATIN * latin:
            return code
    return "en" if latin else UNKNOWN
