"""SIGTERM during start-up: what the loading thread builds afterwards is shut down, not leaked."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from inference_svc.server import app

from .conftest import make_config


class _Engine:
    def __init__(self) -> None:
        self.shut_down = threading.Event()

    def shutdown(self) -> None:
        self.shut_down.set()


class _Loaded:
    def __init__(self) -> None:
        self.engine = _Engine()


def test_a_load_abandoned_midway_is_shut_down_when_it_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # load_model stands in for a slow real load (weights, TP workers) that cannot be interrupted.
    started, release = threading.Event(), threading.Event()
    built: list[_Loaded] = []

    def slow_load(*args: Any) -> _Loaded:
        started.set()
        release.wait(30)
        built.append(_Loaded())
        return built[-1]

    monkeypatch.setattr(app, "load_model", slow_load)

    async def main() -> None:
        server = app.InferenceServer(make_config(tmp_path))
        task = asyncio.ensure_future(server.load())
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()  # the thread finishes after its caller gave up
        deadline = time.monotonic() + 30
        while not (built and built[0].engine.shut_down.is_set()):
            assert time.monotonic() < deadline, "the abandoned engine was never shut down"
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert built[0].engine.shut_down.is_set()
