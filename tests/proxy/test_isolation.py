"""No response ever reaches the wrong client: the real gateway in front of the real llama-server.

Each prompt has its own length, so `usage.prompt_tokens` says whose completion a client got; the
expected count per prompt comes from llama-server itself, asked directly.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.proxy.support import GatewayProc, chat_body

pytestmark = pytest.mark.llama

EXPECT = {"Expect": "100-continue"}


@pytest.fixture(scope="module")
def isolated_gateway(start_gateway, llama32) -> GatewayProc:
    """A gateway of these tests alone: its pool to llama holds only their connections."""
    return start_gateway(llama32.url)


def prompt(i: int) -> str:
    return f"client {i} says: " + " ".join(["secret"] * (3 * i + 1))


def direct_prompt_tokens(llama_url: str, texts: list[str]) -> list[int]:
    """What llama-server counts for each prompt, asked straight (one generated token each)."""

    async def go() -> list[int]:
        async with httpx.AsyncClient(base_url=llama_url, timeout=120) as client:
            replies = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=chat_body(text, max_tokens=1)) for text in texts)
            )
        return [reply.raise_for_status().json()["usage"]["prompt_tokens"] for reply in replies]

    return asyncio.run(go())


def chat(url: str, text: str, max_tokens: int, headers: dict[str, str]) -> tuple[int, int] | str:
    """(status, prompt_tokens) of one chat on its own client connection, or the error's name."""
    body = chat_body(text, max_tokens=max_tokens, ignore_eos=True)
    try:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(60, read=30)) as client:
            reply = client.post("/v1/chat/completions", json=body, headers=headers)
            tokens = reply.json()["usage"]["prompt_tokens"] if reply.status_code == 200 else -1
            return reply.status_code, tokens
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return type(exc).__name__


def test_expect_100_continue_chat_gets_its_own_completion_and_the_next_chat_too(isolated_gateway, llama32):
    """The issue's reproducer: A sends `Expect: 100-continue`, then B, another client, chats; each gets
    a 200 with its own completion (B's request goes out on the pooled connection A's used)."""
    texts = [prompt(1), prompt(8)]
    want_a, want_b = direct_prompt_tokens(llama32.url, texts)
    assert want_a != want_b
    got = []
    for _ in range(3):
        # A's generation runs long enough that B is asked while A's answer is still being generated
        a = chat(isolated_gateway.url, texts[0], 128, EXPECT)
        b = chat(isolated_gateway.url, texts[1], 4, {})
        got.append((a, b))
    assert got == [((200, want_a), (200, want_b))] * 3, f"(A, B) per round: {got}; want A {want_a}, B {want_b}"


async def one_client(client: httpx.AsyncClient, i: int, text: str) -> tuple[int | str, int, str]:
    """(status or error name, prompt_tokens, completion id) of one client; mode by i: blocking,
    streaming, each with or without `Expect: 100-continue`."""
    try:
        return await ask(client, i, text)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return type(exc).__name__, -1, ""


async def ask(client: httpx.AsyncClient, i: int, text: str) -> tuple[int, int, str]:
    stream = i % 2 == 1
    headers = EXPECT if i % 4 >= 2 else {}
    body = chat_body(text, max_tokens=4)
    if not stream:
        reply = await client.post("/v1/chat/completions", json=body, headers=headers)
        if reply.status_code != 200:
            return reply.status_code, -1, ""
        data = reply.json()
        return 200, data["usage"]["prompt_tokens"], data["id"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    prompt_tokens, ident = -1, ""
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
        if reply.status_code != 200:
            return reply.status_code, -1, ""
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            ident = event.get("id", ident)
            if event.get("usage"):
                prompt_tokens = event["usage"]["prompt_tokens"]
    return 200, prompt_tokens, ident


def test_64_concurrent_clients_each_get_their_own_completion(isolated_gateway, llama32):
    texts = [prompt(i) for i in range(64)]
    want = direct_prompt_tokens(llama32.url, texts)
    assert len(set(want)) == 64  # every prompt has its own length

    async def go() -> list[tuple[int | str, int, str]]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(
            base_url=isolated_gateway.url, timeout=httpx.Timeout(120, read=60), limits=limits
        ) as client:
            rounds = []
            for _ in range(2):  # the second round goes out on the gateway's pooled connections
                rounds += await asyncio.gather(*(one_client(client, i, text) for i, text in enumerate(texts)))
            return rounds

    got = asyncio.run(go())
    failed = [(i % 64, status) for i, (status, _, _) in enumerate(got) if status != 200]
    # (client, its own prompt_tokens, the prompt_tokens of the completion it got)
    crossed = [(i % 64, want[i % 64], n) for i, (status, n, _) in enumerate(got) if status == 200 and n != want[i % 64]]
    assert not crossed and not failed, f"another's completion: {crossed[:8]}; errors: {failed[:8]} ({len(failed)})"
    ids = [ident for _, _, ident in got]
    assert len(set(ids)) == 128, "two clients got the same completion"
