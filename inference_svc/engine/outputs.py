"""Typed results the engine hands out: per-step request outputs, usage, timing and load counters."""

from __future__ import annotations

from dataclasses import dataclass

from inference_svc.engine.request import StopReason


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class Timing:
    """Seconds since the request arrived (None until the event happened)."""

    queue_s: float | None  # arrival -> first scheduled
    first_token_s: float | None  # arrival -> first token
    total_s: float | None  # arrival -> finished


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: the new tokens and text, and, at the end, why.

    A request's first output is its admission (`admitted`, no tokens), sent when the scheduler
    first gives it a step, before the model runs: its usage then has the prompt tokens and the
    prompt tokens the prefix cache served. A request that ends before it is ever scheduled
    (aborted, or its time limit passed while waiting) gets only its final output.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    usage: Usage
    stop_reason: StopReason | None = None
    stop_detail: str | int | None = None  # the matched stop string or stop token
    logprobs: list[float] | None = None  # one per new token, when asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None
    timing: Timing | None = None  # set on the final output
    admitted: bool = False  # the admission output: no tokens, not finished


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float  # fraction of KV blocks in use
    num_blocks: int
    block_size: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_finished: int
    num_generated_tokens: int
    num_steps: int

    @property
    def prefix_hit_rate(self) -> float:
        q = self.prefix_queried_tokens
        return self.prefix_hit_tokens / q if q else 0.0
