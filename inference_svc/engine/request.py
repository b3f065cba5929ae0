"""Request: one generation's state, tracked by token counters so prefill and decode are one path.

A request has `num_tokens` known tokens (prompt + generated) of which `num_computed_tokens` have
KV in the cache. A step computes some of the rest; when it reaches the end, a token is sampled.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from inference_svc.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV dropped; it will recompute
    FINISHED = "finished"


class StopReason(str, enum.Enum):
    """Why a request finished (values are what clients see)."""

    LENGTH = "length"  # max_tokens generated
    EOS_TOKEN = "eos_token"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    MAX_MODEL_LEN = "max_model_len"  # the context is full
    ABORTED = "aborted"
    TIME_LIMIT = "time_limit"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    # Extra keys mixed into the prefix-cache hash (e.g. an adapter id, a cache salt).
    cache_extra_keys: tuple[object, ...] = ()

    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = field(default=0, init=False)
    # Prompt tokens served from the prefix cache when first scheduled (reported in usage).
    num_cached_tokens: int = field(default=-1, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    stop_reason: StopReason | None = field(default=None, init=False)
    stop_detail: str | int | None = field(default=None, init=False)  # the stop string or token
    num_preemptions: int = field(default=0, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    # Hashes of the full blocks of token_ids, extended as tokens arrive (see block_pool).
    block_hashes: list[bytes] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def deadline(self) -> float | None:
        limit = self.params.time_limit_s
        return None if limit is None else self.arrival_time + limit

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
