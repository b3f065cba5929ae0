"""Continuous-batching scheduler: a token budget per step, chunked prefill, preemption by recompute.

Each step, running requests are served first (oldest first); when blocks run out the newest
running request is preempted (its blocks freed, to be recomputed later). Waiting requests are
admitted in arrival order while the budget, the sequence limit and the pool allow.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from inference_svc.engine.kv_cache_manager import KVCacheManager
from inference_svc.engine.request import Request, RequestStatus, StopReason


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the caller should shed load (RESOURCE_EXHAUSTED)."""


class RequestTooLongError(ValueError):
    """A prompt leaves no room to generate within max_model_len."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_waiting: int = 1024
    # A prefill longer than this is split across steps so decodes keep flowing.
    long_prefill_threshold: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")


@dataclass(frozen=True)
class ScheduledRequest:
    """One sequence's share of a step: compute tokens [start, start + num_new) of `request`."""

    request: Request
    start: int
    num_new: int
    block_ids: tuple[int, ...]

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled."""
        return self.start + self.num_new == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Requests finished by the scheduler itself (deadline passed while waiting or running).
    finished: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_finished: int = 0


class Scheduler:
    """Owns the waiting and running queues and the KV manager; engine thread only."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens == 0:
            raise RequestTooLongError("the prompt is empty")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise RequestTooLongError(
                f"prompt of {request.num_prompt_tokens} tokens leaves no room to generate within "
                f"max_model_len={self.config.max_model_len}"
            )
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"{len(self.waiting)} requests already waiting (limit {self.config.max_waiting})"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(
        self, request_id: str, reason: StopReason, detail: str | int | None = None
    ) -> Request | None:
        """Finish (abort, stop string, ...) a request and free its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, reason, detail)
        return request

    def _finish(self, request: Request, reason: StopReason, detail: str | int | None) -> None:
        request.status = RequestStatus.FINISHED
        request.stop_reason = reason
        request.stop_detail = detail
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self.stats.num_finished += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._expire_deadlines(out)
        budget = self.config.max_num_batched_tokens
        chunk_cap = self.config.long_prefill_threshold

        # Running requests first, oldest first; preempt the newest when the pool is full.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget, chunk_cap)
            while (blocks := self.kv.allocate_slots(request, num_new)) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                # Victims come from the tail, which is never scheduled yet, save `request` itself.
                if victim is request:
                    break
            if blocks is None:
                break
            out.scheduled.append(
                ScheduledRequest(request, request.num_computed_tokens, num_new, blocks.block_ids)
            )
            budget -= num_new
            i += 1

        # Admit waiting requests unless this step had to preempt (no room to spare).
        while (
            self.waiting
            and not out.preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            hit = self.kv.find_prefix(request)
            remaining = request.num_tokens - hit.num_tokens
            num_new = min(remaining, budget, chunk_cap)
            request.num_computed_tokens = hit.num_tokens
            blocks = self.kv.allocate_slots(request, num_new, hit)
            if blocks is None:
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:  # first admission, not a resume after preemption
                request.num_cached_tokens = hit.num_tokens
                request.first_scheduled_time = self.clock()
                self.kv.record_prefix_query(request.num_tokens, hit.num_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(
                ScheduledRequest(request, hit.num_tokens, num_new, blocks.block_ids)
            )
            budget -= num_new
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _expire_deadlines(self, out: SchedulerOutput) -> None:
        now = self.clock()
        for request in [*self.running, *self.waiting]:
            deadline = request.deadline
            if deadline is not None and now >= deadline:
                self.finish_request(request.request_id, StopReason.TIME_LIMIT)
                out.finished.append(request)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance counters after a step, append sampled tokens, finish on stop conditions.

        `sampled` maps request id to its new token for every scheduled request that sampled.
        Returns the requests that received a token (finished ones included).
        """
        updated = []
        for s in out.scheduled:
            request = s.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += s.num_new
            if not s.samples:
                continue
            token = sampled[request.request_id]
            request.append_token(token)
            if request.first_token_time is None:
                request.first_token_time = self.clock()
            updated.append(request)
            stop = self._check_stop(request, token)
            if stop is not None:
                self.finish_request(request.request_id, stop[0], stop[1])
        return updated

    def _check_stop(self, request: Request, token: int) -> tuple[StopReason, int | None] | None:
        params = request.params
        n_out = request.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return StopReason.EOS_TOKEN, token
            if token in params.stop_token_ids:
                return StopReason.STOP_TOKEN, token
        if n_out >= params.max_tokens:
            return StopReason.LENGTH, None
        if request.num_tokens >= self.config.max_model_len:
            return StopReason.MAX_MODEL_LEN, None
        return None
