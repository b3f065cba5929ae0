"""AsyncEngine: the step loop in its own thread; concurrent submits stream, abort frees blocks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from inference_svc.engine.async_engine import AsyncEngine, EngineDeadError
from inference_svc.engine.engine import Engine, EngineConfig
from inference_svc.engine.outputs import RequestOutput, Usage
from inference_svc.engine.planner import ModelShape, kv_bytes_per_token
from inference_svc.engine.request import StopReason
from inference_svc.engine.sampling_params import SamplingParams
from inference_svc.engine.scheduler import RequestTooLongError


@pytest.fixture
def async_engine(executor: Any, request: pytest.FixtureRequest) -> Iterator[AsyncEngine]:
    max_waiting = getattr(request, "param", 4)
    per_token = kv_bytes_per_token(ModelShape.from_model_config(executor.config), 1, "float32")
    config = EngineConfig(
        block_size=4,
        kv_cache_memory=256 * 4 * per_token,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        max_waiting=max_waiting,
    )
    engine = AsyncEngine(Engine(executor, None, config))
    yield engine
    # Shutting the async engine down would shut the shared executor; stop the thread only.
    with engine._cv:
        engine._stopping = True
        engine._cv.notify()
    engine._thread.join(10)


async def _collect(it: Any) -> list[RequestOutput]:
    return [out async for out in it]


def test_concurrent_submits_match_transformers(
    async_engine: AsyncEngine,
    hf_greedy: Callable[[list[int], int], list[int]],
    random_prompts: Callable[..., list[list[int]]],
) -> None:
    prompts = random_prompts(4, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0)

    async def main() -> list[list[RequestOutput]]:
        streams = [
            async_engine.submit(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)
        ]
        return await asyncio.gather(*(_collect(s) for s in streams))

    results = asyncio.run(main())
    for prompt, outs in zip(prompts, results, strict=True):
        assert [t for o in outs for t in o.new_token_ids] == hf_greedy(prompt, 8)
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    stats = async_engine.stats()
    assert stats.num_finished == 4 and stats.running == 0


def test_abort_and_closing_the_stream_free_blocks(async_engine: AsyncEngine) -> None:
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    async def main() -> tuple[RequestOutput, int]:
        stream = async_engine.submit(list(range(4, 30)), long, request_id="a")
        first = await stream.__anext__()
        assert not first.finished
        async_engine.abort("a")
        outs = [first] + await _collect(stream)
        # Leaving a stream early (client gone) aborts its request too.
        other = async_engine.submit(list(range(4, 30)), long, request_id="b")
        await other.__anext__()
        await other.aclose()  # type: ignore[attr-defined]
        for _ in range(1500):  # polls up to 30 s: generous for a loaded machine, exits early
            if async_engine.stats().num_finished == 2:  # "a" and "b", both aborted
                break
            await asyncio.sleep(0.02)
        return outs[-1], len(outs)

    last, n = asyncio.run(main())
    assert last.finished and last.stop_reason is StopReason.ABORTED and n < 100
    kv = async_engine.engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_admission_errors_surface_from_submit(async_engine: AsyncEngine) -> None:
    async def first(prompt: list[int], rid: str) -> RequestOutput:
        return await async_engine.submit(prompt, SamplingParams(max_tokens=2), rid).__anext__()

    with pytest.raises(RequestTooLongError, match="max_model_len=128"):
        asyncio.run(first(list(range(4, 200)), "too-long"))
    with pytest.raises(ValueError, match="out of range"):
        asyncio.run(first([10**6], "bad-id"))


def test_shutdown_fails_pending_and_new_requests(executor: Any) -> None:
    config = EngineConfig(block_size=4, kv_cache_memory=2**20, max_num_seqs=2,
                          max_num_batched_tokens=32, max_model_len=64, warmup=False)  # fmt: skip
    engine = AsyncEngine(Engine(executor, None, config))
    with engine._cv:
        engine._stopping = True
        engine._cv.notify()
    engine._thread.join(10)

    async def main() -> None:
        await engine.submit([5, 6], SamplingParams()).__anext__()

    with pytest.raises(EngineDeadError):
        asyncio.run(main())


@pytest.mark.parametrize("async_engine", [64], indirect=True)
def test_many_streams_with_random_cancellation(
    async_engine: AsyncEngine,
    hf_greedy: Callable[[list[int], int], list[int]],
    random_prompts: Callable[..., list[list[int]]],
) -> None:
    """24 concurrent streams, a third abandoned after their first token: the rest still match
    transformers and every block comes back."""
    prompts = random_prompts(24, seed=6)
    params = SamplingParams(max_tokens=8, temperature=0)

    async def consume(i: int) -> list[int] | None:
        stream = async_engine.submit(prompts[i], params, request_id=f"s{i}")
        tokens: list[int] = []
        async for out in stream:
            tokens.extend(out.new_token_ids)
            if i % 3 == 0 and out.new_token_ids and not out.finished:
                await stream.aclose()  # type: ignore[attr-defined]
                return None
        return tokens

    async def main() -> list[list[int] | None]:
        results = await asyncio.gather(*(consume(i) for i in range(24)))
        for _ in range(1500):  # polls up to 30 s: generous for a loaded machine, exits early
            if async_engine.stats().num_finished == 24:
                break
            await asyncio.sleep(0.02)
        return list(results)

    results = asyncio.run(main())
    for i, tokens in enumerate(results):
        if tokens is not None:
            assert tokens == hf_greedy(prompts[i], 8), i
    stats = async_engine.stats()
    assert stats.num_finished == 24 and stats.running == 0 and stats.waiting == 0
    kv = async_engine.engine.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def _engine(executor: Any, num_blocks: int, **kw: Any) -> Engine:
    per_token = kv_bytes_per_token(ModelShape.from_model_config(executor.config), 1, "float32")
    options: dict[str, Any] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 128,
        **kw,
    }
    config = EngineConfig(block_size=4, kv_cache_memory=num_blocks * 4 * per_token, **options)
    return Engine(executor, None, config)


def test_admission_is_planned_before_the_model_runs(executor: Any) -> None:
    """`schedule` admits a request without running the model; `step` puts the admission first."""
    engine = _engine(executor, 256)
    engine.add_request(list(range(4, 104)), SamplingParams(max_tokens=2), request_id="long")
    steps = engine.stats().num_steps
    planned = engine.schedule()
    (admission,) = planned.outputs
    assert admission.admitted and admission.request_id == "long"
    assert admission.new_token_ids == [] and not admission.finished
    assert (admission.usage.prompt_tokens, admission.usage.completion_tokens) == (100, 0)
    assert engine.stats().num_steps == steps  # nothing ran yet
    assert engine.run(planned) == []  # 64 of 100 prompt tokens: a chunk, nothing sampled
    outputs = engine.step()  # the rest of the prompt and the first token; no second admission
    assert [(o.admitted, len(o.new_token_ids)) for o in outputs] == [(False, 1)]
    while engine.has_unfinished():
        assert not any(o.admitted for o in engine.step())


def test_admission_streams_first_with_prompt_and_cached_tokens(executor: Any) -> None:
    engine = AsyncEngine(_engine(executor, 256))
    prefix = list(range(100, 116))  # four full blocks of 4
    params = SamplingParams(max_tokens=3, temperature=0)

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        first = await _collect(engine.submit([*prefix, 7, 8, 9, 10, 11], params, "first"))
        second = await _collect(engine.submit([*prefix, 20, 21, 22], params, "second"))
        return first, second

    try:
        first, second = asyncio.run(main())
    finally:
        _stop(engine)
    for outs, prompt_len, cached in ((first, 21, 0), (second, 19, 16)):
        head, rest = outs[0], outs[1:]
        assert head.admitted and head.new_token_ids == [] and not head.finished
        assert head.usage == Usage(prompt_len, 0, cached)
        assert not any(o.admitted for o in rest) and all(o.new_token_ids for o in rest)
        assert rest[-1].finished and rest[-1].usage == Usage(prompt_len, 3, cached)


def test_preempted_requests_are_admitted_once(
    executor: Any,
    hf_greedy: Callable[[list[int], int], list[int]],
    random_prompts: Callable[..., list[list[int]]],
) -> None:
    # 30 blocks of 4 cannot hold 6 sequences of up to ~60 tokens: some are preempted and resumed.
    engine = AsyncEngine(_engine(executor, 30, max_model_len=96))
    prompts = random_prompts(6, seed=8, lo=10, hi=40)
    params = SamplingParams(max_tokens=24, temperature=0)

    async def main() -> list[list[RequestOutput]]:
        streams = [engine.submit(p, params, f"p{i}") for i, p in enumerate(prompts)]
        return await asyncio.gather(*(_collect(s) for s in streams))

    try:
        results = asyncio.run(main())
        assert engine.stats().num_preemptions > 0
    finally:
        _stop(engine)
    for prompt, outs in zip(prompts, results, strict=True):
        assert [o.admitted for o in outs] == [True] + [False] * (len(outs) - 1)
        assert [t for o in outs for t in o.new_token_ids] == hf_greedy(prompt, 24)


def _stop(engine: AsyncEngine) -> None:
    """Stop the thread only: shutting the engine down would shut the shared executor."""
    with engine._cv:
        engine._stopping = True
        engine._cv.notify()
    engine._thread.join(10)


def _hold_engine_thread(engine: AsyncEngine) -> threading.Event:
    """Park the engine thread in a command until the returned event is set."""
    gate, parked = threading.Event(), threading.Event()

    def hold() -> None:
        parked.set()
        gate.wait(30)

    engine._call(hold)
    assert parked.wait(30)
    return gate


def test_cancel_while_waiting_for_admission_aborts_the_request(
    async_engine: AsyncEngine,
) -> None:
    """A caller cancelled before the engine thread applies its submit leaves no request behind."""
    gate = _hold_engine_thread(async_engine)
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    after: Future[tuple[bool, int]] = Future()

    def snapshot() -> None:
        kv = async_engine.engine.scheduler.kv
        after.set_result((async_engine.engine.has_unfinished(), kv.num_free_blocks))

    async def main() -> None:
        task = asyncio.ensure_future(async_engine.submit(list(range(4, 30)), long).__anext__())
        while not async_engine._commands:  # the submit is queued behind the parked thread
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async_engine._call(snapshot)
        gate.set()

    asyncio.run(main())
    unfinished, free = after.result(30)
    assert not unfinished
    assert free == async_engine.engine.scheduler.kv.pool.num_blocks


def test_shutdown_fails_a_submit_still_waiting_for_admission(executor: Any) -> None:
    engine = AsyncEngine(_engine(executor, 64, warmup=False))
    gate = _hold_engine_thread(engine)

    async def main() -> None:
        task = asyncio.ensure_future(engine.submit([5, 6], SamplingParams()).__anext__())
        while not engine._commands:
            await asyncio.sleep(0.001)
        with engine._cv:
            engine._stopping = True
        gate.set()
        # Without a result the submit would wait forever; the bound only turns a hang into a failure.
        await asyncio.wait_for(task, 30)

    with pytest.raises(EngineDeadError, match="before admitting"):
        asyncio.run(main())
    engine._thread.join(10)


def test_stop_callbacks_hear_of_a_crash_even_when_added_late(executor: Any) -> None:
    engine = AsyncEngine(_engine(executor, 64, warmup=False))
    early: Future[BaseException | None] = Future()
    engine.add_stop_callback(early.set_result)

    def crash() -> None:
        raise RuntimeError("injected")

    engine._call(crash)
    error = early.result(30)
    assert isinstance(error, RuntimeError) and str(error) == "injected"
    engine._thread.join(10)
    late: list[BaseException | None] = []
    engine.add_stop_callback(late.append)
    assert late == [error]
