"""Incremental detokenization equals a full decode; stop strings are never emitted, even in part."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from inference_svc.engine.detokenizer import IncrementalDetokenizer
from inference_svc.testing.tokenizer import build_tokenizer

TEXT = "The quick brown fox — jumps over the lazy dog. Ünïcödé 🙂 done."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer(512)


def _stream(
    tok: Tokenizer, text: str, stop: tuple[str, ...], prompt: str = "Say: "
) -> tuple[list[str], IncrementalDetokenizer]:
    prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, prompt_ids, stop)
    pieces = []
    for token in ids:
        update = detok.add_token(token)
        pieces.append(update.text)
        if update.stop_string is not None:
            return pieces, detok
    pieces.append(detok.flush())
    return pieces, detok


def test_incremental_equals_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert len(ids) > 20  # the small vocabulary splits multi-byte characters across tokens
    pieces, _ = _stream(tok, TEXT, ())
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("stop", ["lazy dog", "fox —", "🙂", "y d"])
def test_stop_string_across_token_boundaries(tok: Tokenizer, stop: str) -> None:
    pieces, detok = _stream(tok, TEXT, ("never", stop))
    expected = TEXT[: TEXT.index(stop)]
    assert "".join(pieces) == expected
    assert detok.stopped == stop
    # No streamed prefix ever showed the beginning of the stop string past the cut.
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert expected.startswith(emitted)


def test_held_back_text_is_released_when_no_stop_follows(tok: Tokenizer) -> None:
    pieces, detok = _stream(tok, "the lazy cat", ("lazy dog",))
    assert detok.stopped is None
    assert "".join(pieces) == "the lazy cat"
    # Fed "the lazy" alone, "lazy" (a prefix of the stop string) is held back.
    detok = IncrementalDetokenizer(tok, [], ("lazy dog",))
    emitted = "".join(detok.add_token(t).text for t in tok.encode("the lazy").ids)
    assert emitted == "the "
    assert detok.flush() == "lazy"


def test_earliest_stop_wins(tok: Tokenizer) -> None:
    pieces, detok = _stream(tok, TEXT, ("dog", "brown"))
    assert "".join(pieces) == "The quick " and detok.stopped == "brown"


def test_flush_releases_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🙂", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, [])
    emitted = "".join(detok.add_token(t).text for t in ids[:-1])
    assert "\ufffd" not in emitted  # the emoji's bytes are incomplete: nothing of it yet
    assert tok.decode(ids[:-1]).endswith("\ufffd")
    assert emitted + detok.flush() == tok.decode(ids[:-1])
