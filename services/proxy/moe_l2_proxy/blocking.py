"""Blocking generations, asked of llama as streams and folded back into llama's blocking answer.

Why: llama-server notices that the client of a non-streaming request has gone only when its HTTP
thread's one-second wait for that request's result times out with nothing else arriving. Any
other result in the server (another slot's token, a `/metrics` scrape) restarts that wait, so
under traffic it never notices, and the slot generates to `max_tokens` for nobody: through the
gateway too, which does close its upstream connection at once. A streaming request notices at the
next token, when writing to the closed connection fails. So the gateway asks for a stream and
builds the answer llama would have sent: the same fields in the same order (llama keeps insertion
order), the same values; for `n` > 1 or several prompts, the choices by index and the first
choice's usage and timings, as llama does. Errors llama reports before the stream starts come back
as they are; an error event inside the stream becomes the error answer llama would have given
(its `code` as the status).

One difference remains, llama's own: in a stream, the log-probabilities of tokens whose text llama
held back (a possible stop word) are not sent, so `logprobs` can lack those few entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from moe_l2_proxy.upstream import LlamaUpstream

_JSON = "application/json; charset=utf-8"
# headers of llama's streamed answer that do not describe a blocking one
_STREAM_ONLY = frozenset({"content-type", "content-length", "transfer-encoding", "x-accel-buffering"})


async def send_generation(
    llama: LlamaUpstream, path: str, headers: dict[str, str], body: bytes, stream: bool
) -> httpx.Response:
    """llama's answer to a generation request: a stream is returned open (the caller relays and closes
    it); a blocking request is generated as a stream and returned read, as llama's blocking answer."""
    if stream:
        return await llama.send("POST", path, headers=headers, content=body, stream=True)
    streamed = as_stream_request(body)
    if streamed is None:
        return await llama.send("POST", path, headers=headers, content=body)
    upstream = await llama.send("POST", path, headers=headers, content=streamed, stream=True)
    try:
        if upstream.status_code != 200 or not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            await upstream.aread()
            return upstream
        status, content = await fold(upstream)
    except httpx.HTTPError as exc:
        raise llama.transport_error(exc) from exc
    finally:
        # also when the client left and this task is being cancelled: closing the connection is
        # what stops llama's slot (nothing here waits on the network)
        await upstream.aclose()
    kept = [(k, v) for k, v in upstream.headers.items() if k.lower() not in _STREAM_ONLY]
    return httpx.Response(status, headers=[*kept, ("content-type", _JSON)], content=content)


def as_stream_request(body: bytes) -> bytes | None:
    """The same request asking for a stream with usage, or None if it is not a JSON object."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    request["stream"] = True
    request["stream_options"] = {"include_usage": True}
    return json.dumps(request, ensure_ascii=False).encode()


@dataclass
class _Choice:
    index: int
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    logprobs: list[Any] | None = None
    finish_reason: str | None = None


@dataclass
class Folder:
    """The events of one OpenAI-style stream from llama (chat or text completion), gathered."""

    choices: dict[int, _Choice] = field(default_factory=dict)
    first: dict[str, Any] = field(default_factory=dict)  # the first event: id, model, fingerprint
    finals: dict[int, dict[str, Any]] = field(default_factory=dict)  # per choice: created, usage, timings
    text: bool = False
    error: dict[str, Any] | None = None
    done: bool = False
    _last_finished: int = 0

    def feed(self, event: dict[str, Any]) -> None:
        if "error" in event:
            error = event["error"]
            self.error = error if isinstance(error, dict) else {"code": 500, "message": str(error)}
            return
        if not self.first:
            self.first = event
            self.text = event.get("object") == "text_completion"
        choices = event.get("choices") or []
        for part in choices:
            self._choice(part, event)
        if not choices and "usage" in event:
            # chat: the usage event follows the finishing event of the same choice
            final = self.finals.setdefault(self._last_finished, {"created": event.get("created")})
            final.update({key: event[key] for key in ("usage", "timings") if key in event})

    def _choice(self, part: dict[str, Any], event: dict[str, Any]) -> None:
        index = int(part.get("index", 0))
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = _Choice(index)
        if self.text:
            if part.get("text"):
                choice.content.append(part["text"])
        else:
            delta = part.get("delta") or {}
            if delta.get("content"):
                choice.content.append(delta["content"])
            if delta.get("reasoning_content"):
                choice.reasoning.append(delta["reasoning_content"])
            for call in delta.get("tool_calls") or []:
                self._tool_call(choice, call)
        logprobs = part.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("content"):
            choice.logprobs = (choice.logprobs or []) + list(logprobs["content"])
        if part.get("finish_reason") is not None:
            choice.finish_reason = part["finish_reason"]
            self._last_finished = index
            final = {"created": event.get("created")}
            final.update({key: event[key] for key in ("usage", "timings") if key in event})
            self.finals[index] = final

    @staticmethod
    def _tool_call(choice: _Choice, call: dict[str, Any]) -> None:
        slot = choice.tool_calls.setdefault(int(call.get("index", 0)), {"id": "", "name": "", "arguments": ""})
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        slot["name"] += function.get("name") or ""
        slot["arguments"] += function.get("arguments") or ""

    def answer(self) -> tuple[int, dict[str, Any]]:
        """(status, body) of llama's blocking answer."""
        if self.error is not None:
            code = self.error.get("code")
            status = code if isinstance(code, int) and 400 <= code <= 599 else 500
            return status, {"error": self.error}
        final = self.finals[min(self.finals)] if self.finals else {}
        body: dict[str, Any] = {
            "choices": [self._choice_json(self.choices[i]) for i in sorted(self.choices)],
            "created": final.get("created", self.first.get("created")),
            "model": self.first.get("model"),
            "system_fingerprint": self.first.get("system_fingerprint"),
            "object": "text_completion" if self.text else "chat.completion",
        }
        if "usage" in final:
            body["usage"] = final["usage"]
        body["id"] = self.first.get("id")
        if "timings" in final:
            body["timings"] = final["timings"]
        return 200, body

    def _choice_json(self, choice: _Choice) -> dict[str, Any]:
        logprobs = {"content": choice.logprobs} if choice.logprobs else None
        if self.text:
            return {
                "text": "".join(choice.content),
                "index": choice.index,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
            }
        message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.content)}
        if choice.reasoning:
            message["reasoning_content"] = "".join(choice.reasoning)
        if choice.tool_calls:
            calls = []
            for _, slot in sorted(choice.tool_calls.items()):
                call: dict[str, Any] = {
                    "type": "function",
                    "function": {"name": slot["name"], "arguments": slot["arguments"]},
                }
                if slot["id"]:
                    call["id"] = slot["id"]
                calls.append(call)
            message["tool_calls"] = calls
        out: dict[str, Any] = {"finish_reason": choice.finish_reason, "index": choice.index, "message": message}
        if logprobs is not None:
            out["logprobs"] = logprobs
        return out


async def fold(upstream: httpx.Response) -> tuple[int, bytes]:
    """Reads llama's SSE stream to its end: (status, body) of the equivalent blocking answer."""
    folder = Folder()
    carry = b""
    # the response's own byte stream, as in streaming.relay_raw: this loop also runs once per token
    async for chunk in upstream.stream:  # type: ignore[union-attr]
        lines = (carry + chunk).split(b"\n")
        carry = lines.pop()
        for line in lines:
            _line(folder, line)
        if folder.done or folder.error is not None:
            break
    else:
        _line(folder, carry)
    if folder.error is None and not folder.done:
        raise httpx.RemoteProtocolError("llama's stream ended before its last event")
    status, body = folder.answer()
    return status, json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _line(folder: Folder, line: bytes) -> None:
    if not line.startswith(b"data:"):
        return  # blank separators, `:` pings
    payload = line[5:].strip()
    if payload == b"[DONE]":
        folder.done = True
    elif payload:
        try:
            event = json.loads(payload)
        except ValueError as exc:
            raise httpx.RemoteProtocolError("llama sent an unreadable stream event") from exc
        if isinstance(event, dict):
            folder.feed(event)
