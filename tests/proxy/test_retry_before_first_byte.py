"""A llama replica that fails before the first byte of its answer (connection refused, or reset after
taking the request) costs the client nothing: the gateway sends the request to the next replica, a
real llama-server, and the client gets that one's answer, streamed or not. Real gateway processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from moe_l2_ops.supervisor import free_port
from tests.conftest import LlamaServer
from tests.proxy.standins import ResetBeforeAnswer
from tests.proxy.support import GatewayProc, chat_body


@pytest.fixture
def resetting() -> Iterator[ResetBeforeAnswer]:
    standin = ResetBeforeAnswer()
    yield standin
    standin.close()


@pytest.mark.parametrize("failure", ["refused", "reset"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_failing_before_the_first_byte_is_retried_on_the_next(
    start_gateway: Callable[..., GatewayProc],
    llama32: LlamaServer,
    resetting: ResetBeforeAnswer,
    failure: str,
    stream: bool,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}" if failure == "refused" else resetting.url
    gw = start_gateway(
        "",
        MOE_L2_LLAMA_URLS=f"{dead},{llama32.url}",
        MOE_L2_PROXY_ROUTING="round_robin",
        MOE_L2_PROXY_LLAMA_COOLDOWN_S="60",  # once failed, the dead one goes last: one retry to see
    )
    resp = gw.client.post("/v1/chat/completions", json=chat_body(max_tokens=4, stream=stream))
    assert resp.status_code == 200
    if stream:
        assert resp.text.rstrip().endswith("data: [DONE]") and '"error"' not in resp.text
    else:
        assert resp.json()["choices"][0]["message"]["content"] is not None
    dead_key = dead.removeprefix("http://")
    reason = "unavailable" if failure == "refused" else "protocol"
    assert gw.metric("moe_l2_replica_failures_total", replica=dead_key, reason=reason) == 1
    assert gw.metric("moe_l2_routing_decisions_total", outcome="retry") == 1
    if failure == "reset":
        assert resetting.accepted >= 1  # it did take the request before failing
    # every later request goes to the live one first, and succeeds
    for _ in range(3):
        assert gw.client.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200
    assert gw.metric("moe_l2_routing_decisions_total", outcome="retry") == 1
