"""Chat handling: the last user message weighs most, the rest adds context; long inputs are clipped."""

from __future__ import annotations

import pytest

from moe_l2_contracts.schemas.predict import ChatMessage, PredictRequest
from moe_l2_predictor.prompt import CONTEXT_WEIGHT, clip, from_messages, from_request, from_text


def msgs(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=r, content=c) for r, c in pairs]


def test_the_last_user_message_is_the_main_segment() -> None:
    p = from_messages(
        msgs(
            ("system", "You are a Python expert."), ("user", "write a sort"), ("assistant", "ok"), ("user", "并且解释")
        )
    )
    assert p.main == "并且解释"
    assert p.segments[1][1] == CONTEXT_WEIGHT
    assert "You are a Python expert." in p.segments[1][0]
    assert p.lang == "zh"


def test_content_parts_and_missing_user_turns() -> None:
    parts = [ChatMessage(role="user", content=[{"type": "text", "text": "hello"}, {"type": "image_url", "x": 1}])]
    assert from_messages(parts).main == "hello"
    only_system = from_messages(msgs(("system", "Translate everything into French.")))
    assert only_system.main == "Translate everything into French."
    assert from_messages([]).main == ""
    assert from_messages(msgs(("user", ""), ("assistant", "hi"))).main == "hi"


def test_long_texts_keep_head_and_tail() -> None:
    text = "HEAD " + "x" * 1_000_000 + " TAIL"
    clipped = clip(text)
    assert clipped.startswith("HEAD") and clipped.endswith("TAIL")
    assert len(clipped) < 5000
    assert from_text(text).main == clipped


def test_garbage_is_made_safe_for_tokenizers() -> None:
    p = from_text("a\x00b\ud800c")
    assert "\x00" not in p.main
    p.main.encode("utf-8")  # no lone surrogate left


def test_requests_need_exactly_one_input() -> None:
    assert from_request(PredictRequest(text="hi")).main == "hi"
    with pytest.raises(ValueError):
        PredictRequest()
    with pytest.raises(ValueError):
        PredictRequest(text="a", messages=[])


@pytest.mark.slow
def test_context_decides_a_vague_follow_up_but_not_a_clear_one(hybrid) -> None:
    coding = [("system", "You are a helpful assistant."), ("user", "Write a Python function that parses a CSV file")]
    coding += [("assistant", "def parse(path): ...")]
    follow_up = hybrid.predict(from_messages(msgs(*coding, ("user", "now do the same in Rust please")))).response
    assert follow_up.domain == "codegen"
    switch = hybrid.predict(from_messages(msgs(*coding, ("user", "Forget that. Write a haiku about autumn.")))).response
    assert switch.domain == "creative_write"
