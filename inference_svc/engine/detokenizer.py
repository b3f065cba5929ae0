"""Incremental detokenization with stop strings: text is emitted only once it cannot be part of one.

Decoding re-reads a short window of ids (prefix/read offsets) so multi-byte characters and
leading-space merges come out right; text that could still begin a stop string is held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


# How many ids before the read point are re-decoded so the tokenizer sees enough context.
_CONTEXT = 5


@dataclass(frozen=True)
class DetokenizerUpdate:
    text: str  # newly releasable text
    stop_string: str | None = None  # set when a stop string matched; the output ends before it


class IncrementalDetokenizer:
    """Per-request state; feed each new token, get the text delta that is safe to emit."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids)
        self._read = len(self._ids)
        self._prefix = max(0, self._read - _CONTEXT)
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""  # decoded output text (cut before a matched stop string)
        self._emitted = 0  # characters of `text` released so far
        self.stopped: str | None = None

    def _decode_delta(self) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the rest of the character.
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def add_token(self, token_id: int) -> DetokenizerUpdate:
        if self.stopped is not None:
            raise RuntimeError("add_token after a stop string matched")
        self._ids.append(token_id)
        old_len = len(self.text)
        self.text += self._decode_delta()
        if self._stop:
            # A new match must overlap the new text; find the earliest one.
            start = max(0, old_len - self._max_stop + 1)
            hits = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                index, stop = min(hits)
                self.text = self.text[:index]
                self.stopped = stop
                return DetokenizerUpdate(self._release(len(self.text)), stop)
        return DetokenizerUpdate(self._release(len(self.text) - self._held_back()))

    def flush(self) -> str:
        """The rest of the text, when the request ends for any other reason.

        Bytes of an unfinished character come out as U+FFFD, as a full decode would give them.
        """
        if self.stopped is None and self._read < len(self._ids):
            prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
            full_text = self._tok.decode(self._ids[self._prefix :], self._skip)
            self.text += full_text[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)
        return self._release(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        for k in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
