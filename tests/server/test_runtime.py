"""runtime.deadline: the timer behind Generate's deadline, one code path on every Python."""

from __future__ import annotations

import asyncio

import pytest

from inference_svc.server.runtime import deadline


def test_deadline_raises_timeout_and_leaves_the_task_uncancelled() -> None:
    async def body() -> tuple[bool, int]:
        with pytest.raises(TimeoutError):
            async with deadline(0.01):
                await asyncio.sleep(10)
        task = asyncio.current_task()
        assert task is not None
        # The task goes on normally afterwards: our cancel was taken back.
        await asyncio.sleep(0)
        return True, task.cancelling() if hasattr(task, "cancelling") else 0

    done, cancelling = asyncio.run(body())
    assert done and cancelling == 0


def test_no_deadline_and_a_body_that_finishes_in_time() -> None:
    async def body() -> list[str]:
        seen = []
        async with deadline(None):
            await asyncio.sleep(0)
            seen.append("unbounded")
        # Due at once but never run: the body ends without yielding to the loop.
        async with deadline(0):
            seen.append("in time")
        await asyncio.sleep(0)  # a timer left armed would cancel the task here
        await asyncio.sleep(0)
        seen.append("after")
        return seen

    assert asyncio.run(body()) == ["unbounded", "in time", "after"]


def test_an_outside_cancel_stays_a_cancel() -> None:
    async def body() -> None:
        async with deadline(10):
            await asyncio.sleep(10)

    async def main() -> None:
        task = asyncio.ensure_future(body())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
