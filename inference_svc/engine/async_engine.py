"""AsyncEngine: the Engine's step loop in its own thread, with an asyncio face for the servers.

Calls from the event loop become commands the engine thread applies between steps; outputs
come back through `loop.call_soon_threadsafe` into one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, InvalidStateError

from inference_svc.engine.engine import Engine
from inference_svc.engine.outputs import EngineStats, RequestOutput
from inference_svc.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down or crashed); no more requests are served."""


class AsyncEngine:
    """Thread-safe front of an Engine. `submit` streams outputs; `abort` frees blocks at once."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._error: BaseException | None = None
        self._dead = False  # set under _cv once the loop has ended; no command runs after it
        # Admissions queued but not yet applied: failed at exit so no submit() waits forever.
        self._admissions: set[Future[None]] = set()
        self._on_stop: list[Callable[[BaseException | None], None]] = []
        self._stats = engine.stats()
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # -- engine thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._commands or self._stopping or self.engine.has_unfinished()):
                        self._cv.wait()
                    commands, self._commands = self._commands, []
                    if self._stopping:
                        break
                for command in commands:
                    command()
                if self.engine.has_unfinished():
                    planned = self.engine.schedule()
                    # Admissions go out before the model runs: clients hear of them a step sooner.
                    for output in planned.outputs:
                        self._deliver(output)
                    for output in self.engine.run(planned):
                        self._deliver(output)
                self._stats = self.engine.stats()
        except BaseException as exc:  # report to every waiter, then stop
            log.exception("engine loop crashed")
            self._error = exc
        finally:
            error = self._error or EngineDeadError("the engine was shut down")
            with self._cv:
                self._dead = True
                self._commands.clear()
                orphans, self._admissions = self._admissions, set()
                on_stop = list(self._on_stop)
            dead = EngineDeadError(f"the engine stopped before admitting the request: {error}")
            dead.__cause__ = error
            for admission in orphans:
                with contextlib.suppress(InvalidStateError):
                    admission.set_exception(dead)
            for sink in list(self._sinks.values()):
                sink(error)
            self._sinks.clear()
            for callback in on_stop:
                try:
                    callback(self._error)
                except Exception:
                    log.exception("engine stop callback failed")

    def _deliver(self, output: RequestOutput) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is not None:
            sink(output)
            if output.finished:
                del self._sinks[output.request_id]

    def _call(self, fn: Callable[[], None], admission: Future[None] | None = None) -> None:
        with self._cv:
            if self._stopping or self._dead or not self._thread.is_alive():
                raise EngineDeadError("the engine is not running") from self._error
            if admission is not None:
                self._admissions.add(admission)
            self._commands.append(fn)
            self._cv.notify()

    def _abort_now(self, request_id: str) -> None:
        """Engine thread: finish a request and send its final output to its stream."""
        output = self.engine.abort(request_id)
        if output is not None:
            self._deliver(output)

    # -- event loop side ------------------------------------------------------------------------

    async def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_extra_keys: tuple[object, ...] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and stream its outputs; the last has `finished` set.

        The first is the admission (`admitted`, no tokens, usage with the prompt's cached tokens),
        sent when the request is first scheduled, before that step runs; see `RequestOutput`.
        Admission errors (queue full, prompt too long, bad ids) are raised from the first
        `__anext__`. Closing the iterator early (client gone) aborts the request.
        """
        rid = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        admitted: Future[None] = Future()

        def sink(item: RequestOutput | BaseException) -> None:
            # The caller's loop may be gone (its task was cancelled and the loop closed).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def add() -> None:
            with self._cv:
                self._admissions.discard(admitted)
            # False if the caller was cancelled first (wrap_future cancels this future): then
            # queue nothing, and never set a result on a cancelled future (that would raise here
            # and end the engine loop for everyone).
            if not admitted.set_running_or_notify_cancel():
                return
            try:
                self.engine.add_request(prompt, params, rid, cache_extra_keys)
            except BaseException as exc:
                admitted.set_exception(exc)
                return
            self._sinks[rid] = sink
            admitted.set_result(None)

        def undo() -> None:
            # Runs after `add` (commands keep their order): abort only what `add` queued.
            if admitted.done() and not admitted.cancelled() and admitted.exception() is None:
                self._abort_now(rid)

        self._call(add, admitted)
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:
            # `add` may already have started (its future then cannot be cancelled): undo it.
            with contextlib.suppress(EngineDeadError):
                self._call(undo)
            raise
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort from any thread; the final output (stop reason "aborted") goes to the stream."""

        with contextlib.suppress(EngineDeadError):  # a dead engine has nothing left to abort
            self._call(lambda: self._abort_now(request_id))

    def add_stop_callback(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call `callback(error)` on the engine thread when the loop ends (error None: shut down).

        Called at once, on this thread, if the loop has already ended.
        """
        with self._cv:
            if not self._dead:
                self._on_stop.append(callback)
                return
        callback(self._error)

    def stats(self) -> EngineStats:
        """Counters as of the last step (read without stopping the engine)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        self.engine.shutdown()
