"""Scheduler: token budget, chunked prefill, preemption newest-first, admission limits, deadlines."""

from __future__ import annotations

import random

import pytest

from inference_svc.engine.kv_cache_manager import KVCacheManager
from inference_svc.engine.request import Request, RequestStatus, StopReason
from inference_svc.engine.sampling_params import SamplingParams
from inference_svc.engine.scheduler import (
    QueueFullError,
    RequestTooLongError,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sched(num_blocks: int = 64, block_size: int = 4, **cfg: int) -> Scheduler:
    config = SchedulerConfig(**{"max_num_batched_tokens": 16, "max_num_seqs": 4, **cfg})
    return Scheduler(config, KVCacheManager(num_blocks, block_size), clock=FakeClock())


def _req(rid: str, n_prompt: int, max_tokens: int = 4, base: int = 0, **kw: object) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, **kw)  # type: ignore[arg-type]
    return Request(
        rid, [base + i for i in range(n_prompt)], params, eos_token_ids=(2,), arrival_time=0.0
    )


def _step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, {x.request.request_id: token for x in out.scheduled if x.samples})
    return out


def _shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(x.request.request_id, x.start, x.num_new) for x in out.scheduled]


def test_budget_and_chunked_prefill() -> None:
    s = _sched(max_num_batched_tokens=8, max_num_seqs=4, long_prefill_threshold=8)
    s.add_request(_req("a", 10, max_tokens=2))
    s.add_request(_req("b", 3, max_tokens=2, base=100))
    assert _shape(_step(s)) == [("a", 0, 8)]  # a's prefill chunked, b waits for budget
    assert _shape(_step(s)) == [("a", 8, 2), ("b", 0, 3)]  # both reach their end and sample
    assert _shape(_step(s)) == [("a", 10, 1), ("b", 3, 1)]  # decodes
    assert s.num_unfinished == 0
    assert s.kv.num_free_blocks == 64


def test_max_num_seqs_limits_admission() -> None:
    s = _sched(max_num_seqs=2)
    for i in range(3):
        s.add_request(_req(f"r{i}", 2, base=10 * i))
    out = _step(s)
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preemption_newest_first_then_recompute() -> None:
    # 4 blocks of 4 tokens; three 4-token prompts fill 3 blocks, decodes need more.
    s = _sched(num_blocks=4, max_num_seqs=3, max_num_batched_tokens=16)
    for i in range(3):
        s.add_request(_req(f"r{i}", 4, max_tokens=6, base=10 * i))
    _step(s)  # prefill all three: 3 blocks, each sampled one token
    out = _step(s)  # r0 takes the last block, r1 needs one: preempt r2 (newest), then r1 itself?
    assert out.preempted == ["r2"]
    assert _shape(out) == [("r0", 4, 1), ("r1", 4, 1)]
    r2 = s.requests["r2"]
    assert r2.status is RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert r2.num_tokens == 5  # its sampled token is kept and recomputed later
    while s.num_unfinished:
        _step(s)
    assert s.stats.num_preemptions >= 1
    assert r2.num_output_tokens == 6 and r2.stop_reason is StopReason.LENGTH
    assert s.kv.num_free_blocks == 4
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)


def test_stop_conditions() -> None:
    s = _sched()
    s.add_request(_req("eos", 2, max_tokens=5))
    s.add_request(_req("min", 2, max_tokens=5, base=50, min_tokens=2))
    s.add_request(_req("stoptok", 2, max_tokens=5, base=90, stop_token_ids=(9,)))
    out = s.schedule()
    done = s.update_from_output(out, {"eos": 2, "min": 2, "stoptok": 9})
    assert [r.stop_reason for r in done] == [StopReason.EOS_TOKEN, None, StopReason.STOP_TOKEN]
    out = s.schedule()
    s.update_from_output(out, {"min": 2})
    assert done[1].stop_reason is StopReason.EOS_TOKEN and done[1].num_output_tokens == 2


def test_max_model_len_and_prompt_validation() -> None:
    s = _sched(max_model_len=6)
    with pytest.raises(RequestTooLongError, match="max_model_len=6"):
        s.add_request(_req("long", 6))
    a = _req("a", 4, max_tokens=10)
    s.add_request(a)
    while s.num_unfinished:
        _step(s)
    assert a.stop_reason is StopReason.MAX_MODEL_LEN and a.num_tokens == 6


def test_bounded_waiting_queue() -> None:
    s = _sched(max_waiting=2)
    s.add_request(_req("a", 2))
    s.add_request(_req("b", 2))
    with pytest.raises(QueueFullError, match="limit 2"):
        s.add_request(_req("c", 2))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(_req("a", 2))


def test_abort_frees_blocks_at_once() -> None:
    s = _sched(num_blocks=8)
    s.add_request(_req("a", 9))
    _step(s)
    assert s.kv.num_free_blocks == 5
    request = s.finish_request("a", StopReason.ABORTED)
    assert request is not None and request.stop_reason is StopReason.ABORTED
    assert s.kv.num_free_blocks == 8 and s.num_unfinished == 0
    assert s.finish_request("a", StopReason.ABORTED) is None


def test_deadline_finishes_waiting_and_running() -> None:
    s = _sched(max_num_seqs=1)
    clock = s.clock
    assert isinstance(clock, FakeClock)
    s.add_request(_req("run", 2, max_tokens=10, time_limit_s=1.0))
    s.add_request(_req("wait", 2, max_tokens=10, time_limit_s=0.5, base=40))
    _step(s)
    clock.now = 0.6
    out = _step(s)
    assert [r.request_id for r in out.finished] == ["wait"]
    clock.now = 1.0
    out = _step(s)
    assert [(r.request_id, r.stop_reason) for r in out.finished] == [("run", StopReason.TIME_LIMIT)]
    assert s.kv.num_free_blocks == 64


@pytest.mark.parametrize("seed", range(5))
def test_random_mix_returns_every_block(seed: int) -> None:
    """Finish, abort and preemption in any mix: reference counts match tables; all blocks return."""
    rng = random.Random(seed)
    s = _sched(num_blocks=10, max_num_seqs=5, max_num_batched_tokens=12, long_prefill_threshold=6)
    shared = [rng.randrange(1000) for _ in range(8)]
    n = 0
    for _ in range(200):
        if rng.random() < 0.3 and len(s.waiting) < 10:
            prompt = (shared if rng.random() < 0.5 else []) + [
                rng.randrange(1000) for _ in range(rng.randint(1, 12))
            ]
            params = SamplingParams(max_tokens=rng.randint(1, 16), temperature=0)
            s.add_request(Request(f"q{n}", prompt, params, eos_token_ids=(2,)))
            n += 1
        if s.requests and rng.random() < 0.1:
            s.finish_request(rng.choice(list(s.requests)), StopReason.ABORTED)
        out = s.schedule()
        s.update_from_output(
            out, {x.request.request_id: rng.randrange(3, 1000) for x in out.scheduled if x.samples}
        )
        refs = [0] * 10
        for r in s.running:
            for b in s.kv.block_ids(r.request_id).block_ids:
                refs[b] += 1
        assert refs == [b.ref_cnt for b in s.kv.pool.blocks]
        assert not any(s.kv.block_ids(r.request_id).block_ids for r in s.waiting)
    assert s.stats.num_preemptions > 0 and s.stats.num_finished > 0
    for rid in list(s.requests):
        s.finish_request(rid, StopReason.ABORTED)
    assert s.kv.num_free_blocks == 10
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
