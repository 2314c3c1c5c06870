"""Waiting in tests on the condition a sleep would have stood for, each wait with its timeout.

A sleep guesses how long something takes: too short on a loaded machine (a flaky failure), too long
everywhere else. These poll the condition itself and fail with what was awaited when it never holds.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Polls `condition` until it returns a true value, which is returned; AssertionError naming
    `what` after timeout_s. The condition is asked once more at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = time.monotonic() >= deadline
        if value := condition():
            return value
        if last:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


async def await_until(
    condition: Callable[[], T | Awaitable[T]], timeout_s: float, what: str, interval_s: float = 0.05
) -> T:
    """wait_until inside an event loop: the condition may be a coroutine function, and the loop runs
    (the tasks under test go on) between two polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = time.monotonic() >= deadline
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if last:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


async def holds_throughout(
    condition: Callable[[], Awaitable[bool]], duration_s: float, what: str, interval_s: float = 0.05
) -> None:
    """Polls `condition` for duration_s: AssertionError naming `what` at the first poll it is false.
    For a claim about a span of time (a lease kept past its TTL), watched all along rather than slept through."""
    deadline = time.monotonic() + duration_s
    while True:
        assert await condition(), f"{what} no longer held {duration_s - (deadline - time.monotonic()):.2f} s in"
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
