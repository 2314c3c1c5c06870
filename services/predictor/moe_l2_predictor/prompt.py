"""What the tiers read: a request's text, or a chat reduced to weighted segments.

The last user message says what the request is about; the system prompt and earlier turns only
add context ("and now in Rust?" after a coding question). So a chat becomes at most two
segments: the last user message with full weight and the rest, joined, with a smaller one. Very
long inputs keep their head and tail (see `clip`), so a 1 MB paste costs what a page does.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_l2_contracts.schemas.predict import ChatMessage, PredictRequest
from moe_l2_domains.lang import detect_lang

LAST_USER_WEIGHT = 1.0
CONTEXT_WEIGHT = 0.35
# Of the context, the most recent characters matter most: keep this much of its end.
CONTEXT_CHARS = 2000
HEAD_CHARS = 3000
TAIL_CHARS = 1000


@dataclass(frozen=True)
class Prompt:
    segments: tuple[tuple[str, float], ...]  # (text, weight), the main one first
    lang: str

    @property
    def main(self) -> str:
        return self.segments[0][0] if self.segments else ""


def clip(text: str, head: int = HEAD_CHARS, tail: int = TAIL_CHARS) -> str:
    """Head and tail of a long text: instructions come first, the question often last."""
    if len(text) <= head + tail:
        return text
    return f"{text[:head]}\n…\n{text[-tail:]}"


def clean(text: str) -> str:
    """Text safe for every tokenizer: lone surrogates and NULs (binary garbage) replaced."""
    if not text.isascii():
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text.replace("\x00", " ") if "\x00" in text else text


def message_text(message: ChatMessage) -> str:
    """The text of a message; content parts other than text (images, audio) carry none."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type", "text") == "text"]
    return "\n".join(p for p in parts if isinstance(p, str))


def from_messages(messages: list[ChatMessage]) -> Prompt:
    texts = [(m.role, clean(message_text(m))) for m in messages]
    last_user = next((i for i in range(len(texts) - 1, -1, -1) if texts[i][0] == "user" and texts[i][1].strip()), None)
    if last_user is None:
        # No user turn (a bare system prompt, say): everything is the main text.
        joined = "\n".join(t for _, t in texts if t.strip())
        main = clip(joined)
        return Prompt(segments=((main, LAST_USER_WEIGHT),), lang=detect_lang(main))
    main = clip(texts[last_user][1])
    context = "\n".join(t for i, (_, t) in enumerate(texts) if i != last_user and t.strip())
    segments: tuple[tuple[str, float], ...] = ((main, LAST_USER_WEIGHT),)
    if context:
        segments += ((context[-CONTEXT_CHARS:], CONTEXT_WEIGHT),)
    lang = detect_lang(main)
    if lang == "unknown" and context:
        lang = detect_lang(context[-CONTEXT_CHARS:])
    return Prompt(segments=segments, lang=lang)


def from_text(text: str) -> Prompt:
    main = clip(clean(text))
    return Prompt(segments=((main, LAST_USER_WEIGHT),), lang=detect_lang(main))


def from_request(request: PredictRequest) -> Prompt:
    if request.messages is not None:
        return from_messages(request.messages)
    return from_text(request.text or "")
