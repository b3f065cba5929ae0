"""validation.py without a server: defaults, clipping, truncation, chat rendering, each message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from inference_svc.loader.tokenizer import Tokenizer, load_tokenizer
from inference_svc.server.validation import (
    Invalid,
    ModelLimits,
    ValidationError,
    validate_generate,
    validate_tgis,
)
from protos.fmaas import generation_pb2 as tg
from protos.llm.v1 import inference_pb2 as pb

LIMITS = ModelLimits(vocab_size=512, max_model_len=64, default_max_new_tokens=16)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return load_tokenizer(model_dir)


def test_defaults_are_greedy_and_clip_to_the_room_left(tok: Tokenizer) -> None:
    gen = validate_generate(pb.GenerateRequest(text="hello"), tok, LIMITS)
    assert list(gen.prompt_token_ids) == tok.encode("hello")
    p = gen.params
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens) == (0.0, 0, 1.0, 0.0, 16)
    assert (p.seed, p.logprobs, p.stop, p.time_limit_s, p.skip_special_tokens) == (
        None,
        None,
        (),
        None,
        True,
    )
    # 60 prompt tokens leave 4: the default shrinks, an explicit larger value is refused.
    long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 60))
    assert validate_generate(long, tok, LIMITS).params.max_tokens == 4
    long.stopping.max_new_tokens = 4
    assert validate_generate(long, tok, LIMITS).params.max_tokens == 4
    long.stopping.max_new_tokens = 5
    with pytest.raises(ValidationError) as info:
        validate_generate(long, tok, LIMITS)
    assert info.value.kind is Invalid.MAX_NEW_TOKENS
    assert str(info.value) == (
        "max_new_tokens=5 does not fit: the prompt has 60 tokens and max_model_len is 64, "
        "so at most 4 new tokens can be generated"
    )


def test_every_field_reaches_the_sampling_params(tok: Tokenizer) -> None:
    req = pb.GenerateRequest(
        text="hi",
        sampling=pb.SamplingParams(
            temperature=0.7,
            top_k=5,
            top_p=0.9,
            min_p=0.05,
            typical_p=0.8,
            repetition_penalty=1.2,
            seed=42,
        ),
        stopping=pb.StoppingParams(
            max_new_tokens=10,
            min_new_tokens=2,
            stop_sequences=["\n\n"],
            stop_token_ids=[3],
            ignore_eos=True,
            time_limit_ms=1500,
            include_stop_text=True,
        ),
        output=pb.OutputOptions(top_logprobs=4, skip_special_tokens=False),
    )
    gen = validate_generate(req, tok, LIMITS)
    p = gen.params
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p) == pytest.approx(
        (0.7, 5, 0.9, 0.05, 0.8)
    )
    assert (p.repetition_penalty, p.seed, p.max_tokens, p.min_tokens) == pytest.approx(
        (1.2, 42, 10, 2)
    )
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.time_limit_s) == (("\n\n",), (3,), True, 1.5)
    assert (p.logprobs, p.skip_special_tokens, gen.include_stop_text) == (4, False, True)


def test_truncation_keeps_the_tail(tok: Tokenizer) -> None:
    ids = list(range(10, 110))
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), truncate_prompt_tokens=20)
    gen = validate_generate(req, tok, LIMITS)
    assert list(gen.prompt_token_ids) == ids[-20:] and gen.truncated_tokens == 80
    req.truncate_prompt_tokens = 64
    with pytest.raises(ValidationError, match="truncate_prompt_tokens=64 must be < max_model_len"):
        validate_generate(req, tok, LIMITS)


def test_chat_is_rendered_by_the_template_without_a_second_bos(tok: Tokenizer) -> None:
    msgs = [("system", "be brief"), ("user", "hi")]
    req = pb.GenerateRequest(
        chat=pb.ChatPrompt(messages=[pb.ChatMessage(role=r, content=c) for r, c in msgs])
    )
    rendered = tok.apply_chat_template([{"role": r, "content": c} for r, c in msgs])
    ids = list(validate_generate(req, tok, LIMITS).prompt_token_ids)
    assert ids == tok.encode(rendered, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1 and tok.decode(ids).endswith("assistant\n")
    req.chat.add_generation_prompt = False
    assert not tok.decode(list(validate_generate(req, tok, LIMITS).prompt_token_ids)).endswith(
        "assistant\n"
    )


def test_no_chat_template_is_failed_precondition(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.backend, None, tok.special_tokens, tok.eos_token_ids, tok.generation)
    req = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user")]))
    with pytest.raises(ValidationError) as info:
        validate_generate(req, bare, LIMITS)
    assert info.value.kind is Invalid.NO_CHAT_TEMPLATE
    assert info.value.status == grpc.StatusCode.FAILED_PRECONDITION


CASES: list[tuple[dict[str, Any], Invalid]] = [
    ({"sampling": pb.SamplingParams(top_k=0, typical_p=0.0)}, Invalid.TYPICAL_P),
    ({"sampling": pb.SamplingParams(min_p=-0.1)}, Invalid.MIN_P),
    ({"sampling": pb.SamplingParams(top_p=float("nan"))}, Invalid.TOP_P),
    ({"request_id": "x" * 300}, Invalid.REQUEST_ID_TOO_LONG),
    ({"stopping": pb.StoppingParams(stop_sequences=["y" * 300])}, Invalid.STOP_SEQUENCE_TOO_LONG),
    ({"stopping": pb.StoppingParams(stop_token_ids=list(range(65)))}, Invalid.TOO_MANY_STOP_TOKENS),
    ({"token_ids": pb.TokenIds(ids=[7] * 64)}, Invalid.PROMPT_TOO_LONG),
]


@pytest.mark.parametrize(("fields", "kind"), CASES)
def test_each_failure_is_its_own_kind(
    tok: Tokenizer, fields: dict[str, Any], kind: Invalid
) -> None:
    req = pb.GenerateRequest(**fields)
    if req.WhichOneof("prompt") is None:
        req.text = "ok"
    with pytest.raises(ValidationError) as info:
        validate_generate(req, tok, LIMITS)
    assert info.value.kind is kind
    assert info.value.status == grpc.StatusCode.INVALID_ARGUMENT


def test_tgis_zero_means_unset_and_sample_defaults_to_temperature_one(tok: Tokenizer) -> None:
    greedy = validate_tgis("hello", tg.Parameters(), tok, LIMITS)
    assert (greedy.params.temperature, greedy.params.max_tokens) == (0.0, 16)
    assert greedy.include_stop_text  # TGIS includes the stop sequence unless told not to
    sample = validate_tgis(
        "hello",
        tg.Parameters(
            method=tg.SAMPLE,
            sampling=tg.SamplingParameters(top_p=0.0, typical_p=0.0, seed=7),
            decoding=tg.DecodingParameters(repetition_penalty=0.0),
            response=tg.ResponseOptions(token_ranks=True),
        ),
        tok,
        LIMITS,
    )
    p = sample.params
    assert (p.temperature, p.top_p, p.typical_p, p.repetition_penalty, p.seed) == (
        1.0,
        1.0,
        1.0,
        1.0,
        7,
    )
    assert p.logprobs == 20  # ranks need the alternatives above the sampled token
    with pytest.raises(ValidationError, match=r"decoding\.length_penalty is not supported"):
        validate_tgis(
            "hello",
            tg.Parameters(
                decoding=tg.DecodingParameters(length_penalty=tg.DecodingParameters.LengthPenalty())
            ),
            tok,
            LIMITS,
        )


def test_tgis_messages_name_the_tgis_truncation_field(tok: Tokenizer) -> None:
    with pytest.raises(ValidationError, match=r"or set truncate_input_tokens$"):
        validate_tgis("hello " * 200, tg.Parameters(), tok, LIMITS)
    with pytest.raises(ValidationError, match=r"^truncate_input_tokens=64 must be < max_model_len"):
        validate_tgis("hello", tg.Parameters(truncate_input_tokens=64), tok, LIMITS)
