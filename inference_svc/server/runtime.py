"""What both servicers share: the engine once it is warm, the model card, admission and draining.

`ServingState.stream` turns a validated request into engine outputs and every refusal into a
`StatusError` carrying the gRPC code: overload RESOURCE_EXHAUSTED, loading or draining UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import grpc

from inference_svc.engine.async_engine import AsyncEngine, EngineDeadError
from inference_svc.engine.outputs import RequestOutput
from inference_svc.engine.scheduler import QueueFullError, RequestTooLongError
from inference_svc.server.telemetry import Telemetry
from inference_svc.server.validation import GenerationInput, ModelLimits, PromptTokenizer

T = TypeVar("T")


@contextlib.asynccontextmanager
async def deadline(seconds: float | None) -> AsyncIterator[None]:
    """Raise TimeoutError in the body after `seconds` (None: no limit).

    `asyncio.timeout` as a plain cancel-and-convert, so it also runs on Python 3.10.
    """
    if seconds is None:
        yield
        return
    task = asyncio.current_task()
    assert task is not None, "deadline() needs a running task"
    fired = False

    def fire() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    handle = asyncio.get_running_loop().call_later(max(0.0, seconds), fire)
    try:
        yield
    except asyncio.CancelledError:
        if not fired:
            raise
        if hasattr(task, "uncancel"):  # 3.11+: our cancel must not count as an outside one
            task.uncancel()
        raise TimeoutError from None
    finally:
        handle.cancel()


class StatusError(Exception):
    """A refusal with its gRPC status code; servicers pass it to `context.abort`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ServerTokenizer(PromptTokenizer, Protocol):
    chat_template: str | None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class ModelCard:
    """Facts about the served model that clients can ask for."""

    model_id: str
    architecture: str
    revision: str
    manifest_digest: str
    dtype: str
    tensor_parallel_size: int
    kv_block_size: int
    kv_blocks: int
    max_waiting: int
    has_chat_template: bool
    prefix_caching: bool = True


@dataclass(frozen=True)
class LoadedModel:
    engine: AsyncEngine
    tokenizer: ServerTokenizer
    limits: ModelLimits
    card: ModelCard


class ServingState:
    """Shared by the servicers of one server; lives on the server's event loop."""

    def __init__(self, telemetry: Telemetry | None = None) -> None:
        self.telemetry = telemetry
        self._model: LoadedModel | None = None
        self.draining = False
        # Ids of requests in flight, for Abort, duplicate ids and draining.
        self.active: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def set_model(self, model: LoadedModel) -> None:
        self._model = model

    @property
    def model(self) -> LoadedModel:
        if self._model is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry")
        return self._model

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def check_accepting(self) -> LoadedModel:
        if self.draining:
            raise StatusError(
                grpc.StatusCode.UNAVAILABLE, "the server is draining; retry on another replica"
            )
        model = self.model
        if not model.engine.is_running:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the engine has stopped")
        return model

    def token_text(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id], skip_special_tokens=False)

    async def model_or_abort(self, context: grpc.aio.ServicerContext) -> LoadedModel:
        """The loaded model, or the call ends with why there is none (still loading, stopped)."""
        try:
            return self.model
        except StatusError as e:
            await context.abort(e.code, e.message)
            raise  # not reached: abort raises

    def refused(self, code: grpc.StatusCode, api: str) -> None:
        if self.telemetry is not None:
            self.telemetry.refusal(code.name, api)

    async def relay(
        self, messages: AsyncIterator[T], context: grpc.aio.ServicerContext, api: str
    ) -> AsyncIterator[T]:
        """A streaming handler's messages, ended at the call's deadline, failures as status codes.

        Our own timer as well as gRPC's: the engine request ends with the deadline even if the
        transport notices late.
        """
        try:
            async with deadline(context.time_remaining()):
                async for message in messages:
                    yield message
        except StatusError as e:
            self.refused(e.code, api)
            await context.abort(e.code, e.message)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine stopped: {e}")
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")

    async def stream(
        self, gen: GenerationInput, request_id: str = "", api: str = "llm.v1.Inference"
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; the engine request is aborted if the caller stops early."""
        model = self.check_accepting()
        rid = request_id or uuid.uuid4().hex
        if rid in self.active:
            raise StatusError(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight"
            )
        self.active.add(rid)
        self._idle.clear()
        finished = False
        try:
            # submit() is an async generator: closing it is what aborts an unfinished request.
            outputs = cast(
                AsyncGenerator[RequestOutput, None],
                model.engine.submit(list(gen.prompt_token_ids), gen.params, rid),
            )
            async with contextlib.aclosing(outputs):
                try:
                    first = await outputs.__anext__()
                except QueueFullError as e:
                    raise StatusError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, f"the server is overloaded: {e}"
                    ) from None
                except (RequestTooLongError, ValueError) as e:  # what validation let through
                    raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
                except EngineDeadError as e:
                    raise StatusError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
                finished = first.finished
                if finished:
                    self._record(first, api)
                yield first
                async for out in outputs:
                    finished = out.finished
                    if finished:
                        self._record(out, api)
                    yield out
        finally:
            # Cancellation (client gone, deadline) lands here: free the KV blocks at once.
            if not finished:
                model.engine.abort(rid)
            self.active.discard(rid)
            if not self.active:
                self._idle.set()

    def _record(self, out: RequestOutput, api: str) -> None:
        if self.telemetry is not None:
            self.telemetry.finished(out, api)

    def abort(self, request_id: str) -> bool:
        if request_id not in self.active:
            return False
        self.model.engine.abort(request_id)
        return True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait for in-flight requests to end; False if some are still running at the timeout."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def abort_all(self) -> None:
        for rid in list(self.active):
            self.model.engine.abort(rid)
