"""`jobs.gateway.deps.unless_disconnected`: a client that goes away ends the wait at once,
even when the work it waits on swallows a cancellation (as a Python 3.11 ``wait_for`` that
completes as the cancel lands does), so the route goes on to cancel the request's jobs."""

from __future__ import annotations

import asyncio
import time

import pytest

from jobs.gateway import deps


class Request:
    """What `unless_disconnected` reads of a Starlette request: ASGI ``receive``, here
    answering ``http.disconnect`` once `gone_after_s` have passed."""

    def __init__(self, gone_after_s: float):
        self.gone_at = time.monotonic() + gone_after_s

    async def receive(self) -> dict:
        await asyncio.sleep(max(0.0, self.gone_at - time.monotonic()))
        return {"type": "http.disconnect"}


async def swallows_one_cancel(ran: list[str], then_s: float = 10.0) -> str:
    try:
        await asyncio.sleep(then_s)
    except asyncio.CancelledError:
        ran.append("swallowed")  # and carries on, as if the inner wait had completed
    await asyncio.sleep(then_s)
    ran.append("finished")
    return "result"


def test_a_swallowed_cancellation_does_not_hold_the_request_until_the_work_ends():
    async def main():
        ran: list[str] = []
        t0 = time.monotonic()
        with pytest.raises(deps.ClientGone):
            await deps.unless_disconnected(Request(0.05), swallows_one_cancel(ran))
        return ran, time.monotonic() - t0

    ran, seconds = asyncio.run(main())
    assert ran == ["swallowed"]  # canceled again: it never ran on to its end
    assert seconds < 1.0  # the disconnect at 0.05 s, then one re-cancel interval


def test_work_that_ends_first_is_returned_and_a_later_disconnect_is_ignored():
    async def done() -> str:
        await asyncio.sleep(0.01)
        return "result"

    assert asyncio.run(deps.unless_disconnected(Request(5.0), done())) == "result"


def test_cancel_until_done_leaves_the_result_of_work_that_ignores_every_cancel():
    async def main():
        async def stubborn() -> str:
            for _ in range(3):
                try:
                    await asyncio.sleep(0.02)
                except asyncio.CancelledError:
                    pass
            return "kept"

        task = asyncio.ensure_future(stubborn())
        await asyncio.sleep(0)
        await deps.cancel_until_done(task, every_s=0.005)
        return task

    task = asyncio.run(main())
    assert task.done() and task.result() == "kept"
