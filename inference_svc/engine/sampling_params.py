"""SamplingParams: how one request samples and when it stops, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass


class InvalidSamplingParams(ValueError):
    """A sampling or stopping parameter is out of range; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping.

    temperature 0 means greedy. top_k 0 disables top-k. logprobs None returns none; n >= 0 returns
    the sampled token's logprob plus the top-n alternatives (logprobs of the raw model output).
    Stop strings are matched on detokenized text and never included in the output.
    time_limit_s stops generation (stop reason "time_limit") once that much time has passed
    since the request arrived.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers; store tuples so the object stays hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (0 < self.typical_p <= 1, f"typical_p must be in (0, 1], got {self.typical_p}"),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"logprobs must be in [0, 20], got {self.logprobs}",
            ),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (
                all(t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be non-negative",
            ),
            (
                self.time_limit_s is None or self.time_limit_s > 0,
                f"time_limit_s must be > 0, got {self.time_limit_s}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidSamplingParams(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
