"""Request validation for both APIs: llm.v1 and TGIS requests become a prompt and SamplingParams.

Every failure is one `Invalid` member whose message says what to fix; the servicers map it to a
gRPC status (INVALID_ARGUMENT, or FAILED_PRECONDITION when the model cannot do what was asked).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from inference_svc.engine.sampling_params import InvalidSamplingParams, SamplingParams
from protos.fmaas import generation_pb2 as tgis_pb2
from protos.llm.v1 import inference_pb2 as pb


class Invalid(enum.Enum):
    """One member per way a request can be wrong; the value is the message template."""

    EMPTY_PROMPT = "the prompt is empty: set text, token_ids or chat with at least one token"
    TOKEN_OUT_OF_RANGE = (
        "token_ids[{index}]={value} is outside the vocabulary: ids must be in [0, {vocab})"
    )
    EMPTY_CHAT = "chat.messages is empty: send at least one message"
    CHAT_ROLE = "chat.messages[{index}].role is empty: use system, user or assistant"
    NO_CHAT_TEMPLATE = "this model has no chat template: send text or token_ids instead"
    CHAT_TEMPLATE = "the chat template could not render the messages: {detail}"
    PROMPT_TOO_LONG = (
        "the prompt has {tokens} tokens but max_model_len is {max_len}: shorten it to at most "
        "{limit} tokens or set {field}"
    )
    TRUNCATE_TOO_LARGE = "{field}={value} must be < max_model_len ({max_len})"
    TEMPERATURE = "temperature must be >= 0 (0 or unset is greedy), got {value}"
    TOP_P = "top_p must be in (0, 1] (1 or unset disables), got {value}"
    TOP_K = "top_k must be >= 0 (0 disables), got {value}"
    MIN_P = "min_p must be in [0, 1] (0 or unset disables), got {value}"
    TYPICAL_P = "typical_p must be in (0, 1] (1 or unset disables), got {value}"
    REPETITION_PENALTY = "repetition_penalty must be > 0 (1 or unset disables), got {value}"
    MAX_NEW_TOKENS_ZERO = "max_new_tokens must be >= 1 when set"
    MAX_NEW_TOKENS = (
        "max_new_tokens={value} does not fit: the prompt has {prompt} tokens and max_model_len "
        "is {max_len}, so at most {limit} new tokens can be generated"
    )
    MIN_NEW_TOKENS = "min_new_tokens ({min_new}) must be <= max_new_tokens ({max_new})"
    TOO_MANY_STOP_SEQUENCES = "{count} stop sequences given; at most {limit} are allowed"
    EMPTY_STOP_SEQUENCE = "stop_sequences[{index}] is empty: remove it"
    STOP_SEQUENCE_TOO_LONG = "stop_sequences[{index}] has {length} characters; at most {limit}"
    TOO_MANY_STOP_TOKENS = "{count} stop_token_ids given; at most {limit} are allowed"
    STOP_TOKEN_OUT_OF_RANGE = "stop_token_ids[{index}]={value} is outside [0, {vocab})"
    TOP_LOGPROBS = "top_logprobs must be <= {limit}, got {value}"
    REQUEST_ID_TOO_LONG = "request_id has {length} characters; at most {limit}"
    UNSUPPORTED = "{feature} is not supported by this server"
    OUT_OF_RANGE = "{detail}"

    def error(self, **details: Any) -> ValidationError:
        return ValidationError(self, self.value.format(**details))


# Problems the client cannot fix by changing values, only by asking another model.
_PRECONDITION = {Invalid.NO_CHAT_TEMPLATE, Invalid.UNSUPPORTED}


class ValidationError(ValueError):
    """A bad request; `str()` is the message the client gets."""

    def __init__(self, kind: Invalid, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def status(self) -> grpc.StatusCode:
        if self.kind in _PRECONDITION:
            return grpc.StatusCode.FAILED_PRECONDITION
        return grpc.StatusCode.INVALID_ARGUMENT


class PromptTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(frozen=True)
class ModelLimits:
    """What the served model and this server accept."""

    vocab_size: int
    max_model_len: int
    default_max_new_tokens: int = 256
    max_stop_sequences: int = 16
    max_stop_sequence_chars: int = 256
    max_stop_token_ids: int = 64
    max_top_logprobs: int = 20
    max_request_id_chars: int = 256

    def __post_init__(self) -> None:
        if self.max_model_len < 2 or self.vocab_size < 1 or self.default_max_new_tokens < 1:
            raise ValueError(f"unusable model limits: {self}")


@dataclass(frozen=True)
class GenerationInput:
    """A validated request, ready for `AsyncEngine.submit`."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    include_stop_text: bool = False
    truncated_tokens: int = 0  # prompt tokens dropped by truncate_prompt_tokens


def _check_finite(value: float, ok: bool, kind: Invalid) -> None:
    if math.isnan(value) or not ok:
        raise kind.error(value=value)


def encode_prompt(
    tokenizer: PromptTokenizer,
    limits: ModelLimits,
    *,
    text: str | None = None,
    token_ids: Sequence[int] | None = None,
    chat: Sequence[tuple[str, str]] | None = None,
    add_generation_prompt: bool = True,
    truncate: int = 0,
    truncate_field: str = "truncate_prompt_tokens",
    check_length: bool = True,
) -> tuple[list[int], int]:
    """Token ids of exactly one of text / token_ids / chat, truncated; returns (ids, dropped).

    `truncate_field` names the request's truncation field in messages (the APIs differ);
    `check_length=False` skips the max_model_len check (Tokenize reports any length).
    """
    if truncate >= limits.max_model_len:
        raise Invalid.TRUNCATE_TOO_LARGE.error(
            field=truncate_field, value=truncate, max_len=limits.max_model_len
        )
    if chat is not None:
        if not chat:
            raise Invalid.EMPTY_CHAT.error()
        for i, (role, _) in enumerate(chat):
            if not role:
                raise Invalid.CHAT_ROLE.error(index=i)
        messages = [{"role": role, "content": content} for role, content in chat]
        try:
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt)
        except ValueError as e:  # TokenizerError: no template, or it refused the messages
            if "no chat template" in str(e):
                raise Invalid.NO_CHAT_TEMPLATE.error() from None
            raise Invalid.CHAT_TEMPLATE.error(detail=e) from None
        # The template writes its own special tokens (BOS); encoding must not add them again.
        ids = tokenizer.encode(rendered, add_special_tokens=False)
    elif token_ids is not None:
        ids = [int(t) for t in token_ids]
        for i, t in enumerate(ids):
            if not 0 <= t < limits.vocab_size:
                raise Invalid.TOKEN_OUT_OF_RANGE.error(index=i, value=t, vocab=limits.vocab_size)
    else:
        ids = tokenizer.encode(text or "") if text else []
    if not ids:
        raise Invalid.EMPTY_PROMPT.error()
    dropped = 0
    if truncate and len(ids) > truncate:
        dropped = len(ids) - truncate
        ids = ids[-truncate:]
    if check_length and len(ids) >= limits.max_model_len:
        raise Invalid.PROMPT_TOO_LONG.error(
            tokens=len(ids),
            max_len=limits.max_model_len,
            limit=limits.max_model_len - 1,
            field=truncate_field,
        )
    return ids, dropped


def max_new_tokens(limits: ModelLimits, prompt_len: int, requested: int | None) -> int:
    """The request's max_new_tokens: the server default clipped to the room left, or an error."""
    room = limits.max_model_len - prompt_len
    if requested is None:
        return max(1, min(limits.default_max_new_tokens, room))
    if requested < 1:
        raise Invalid.MAX_NEW_TOKENS_ZERO.error()
    if requested > room:
        raise Invalid.MAX_NEW_TOKENS.error(
            value=requested, prompt=prompt_len, max_len=limits.max_model_len, limit=room
        )
    return requested


def check_stops(
    limits: ModelLimits, stop_sequences: Sequence[str], stop_token_ids: Sequence[int] = ()
) -> None:
    if len(stop_sequences) > limits.max_stop_sequences:
        raise Invalid.TOO_MANY_STOP_SEQUENCES.error(
            count=len(stop_sequences), limit=limits.max_stop_sequences
        )
    for i, s in enumerate(stop_sequences):
        if not s:
            raise Invalid.EMPTY_STOP_SEQUENCE.error(index=i)
        if len(s) > limits.max_stop_sequence_chars:
            raise Invalid.STOP_SEQUENCE_TOO_LONG.error(
                index=i, length=len(s), limit=limits.max_stop_sequence_chars
            )
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise Invalid.TOO_MANY_STOP_TOKENS.error(
            count=len(stop_token_ids), limit=limits.max_stop_token_ids
        )
    for i, t in enumerate(stop_token_ids):
        if not 0 <= t < limits.vocab_size:
            raise Invalid.STOP_TOKEN_OUT_OF_RANGE.error(index=i, value=t, vocab=limits.vocab_size)


def check_sampling(
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float = 0.0,
    typical_p: float = 1.0,
    repetition_penalty: float = 1.0,
) -> None:
    _check_finite(temperature, temperature >= 0, Invalid.TEMPERATURE)
    if top_k < 0:
        raise Invalid.TOP_K.error(value=top_k)
    _check_finite(top_p, 0 < top_p <= 1, Invalid.TOP_P)
    _check_finite(min_p, 0 <= min_p <= 1, Invalid.MIN_P)
    _check_finite(typical_p, 0 < typical_p <= 1, Invalid.TYPICAL_P)
    _check_finite(repetition_penalty, repetition_penalty > 0, Invalid.REPETITION_PENALTY)


def _params(**kwargs: Any) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except InvalidSamplingParams as e:  # a rule the checks above do not know yet
        raise Invalid.OUT_OF_RANGE.error(detail=e) from None


def validate_generate(
    req: pb.GenerateRequest, tokenizer: PromptTokenizer, limits: ModelLimits
) -> GenerationInput:
    """Check an llm.v1 GenerateRequest and turn it into engine inputs."""
    if len(req.request_id) > limits.max_request_id_chars:
        raise Invalid.REQUEST_ID_TOO_LONG.error(
            length=len(req.request_id), limit=limits.max_request_id_chars
        )
    s, st, out = req.sampling, req.stopping, req.output
    temperature = s.temperature if s.HasField("temperature") else 0.0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    min_p = s.min_p if s.HasField("min_p") else 0.0
    typical_p = s.typical_p if s.HasField("typical_p") else 1.0
    rep = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    check_sampling(
        temperature=temperature,
        top_k=s.top_k,
        top_p=top_p,
        min_p=min_p,
        typical_p=typical_p,
        repetition_penalty=rep,
    )
    check_stops(limits, list(st.stop_sequences), list(st.stop_token_ids))
    if out.top_logprobs > limits.max_top_logprobs:
        raise Invalid.TOP_LOGPROBS.error(limit=limits.max_top_logprobs, value=out.top_logprobs)
    kind = req.WhichOneof("prompt")
    add_gen = not req.chat.HasField("add_generation_prompt") or req.chat.add_generation_prompt
    ids, dropped = encode_prompt(
        tokenizer,
        limits,
        text=req.text if kind == "text" else None,
        token_ids=list(req.token_ids.ids) if kind == "token_ids" else None,
        chat=[(m.role, m.content) for m in req.chat.messages] if kind == "chat" else None,
        add_generation_prompt=add_gen,
        truncate=req.truncate_prompt_tokens,
    )
    max_new = max_new_tokens(
        limits, len(ids), st.max_new_tokens if st.HasField("max_new_tokens") else None
    )
    if st.min_new_tokens > max_new:
        raise Invalid.MIN_NEW_TOKENS.error(min_new=st.min_new_tokens, max_new=max_new)
    want_logprobs = out.logprobs or out.top_logprobs > 0
    params = _params(
        max_tokens=max_new,
        min_tokens=st.min_new_tokens,
        temperature=temperature,
        top_k=s.top_k,
        top_p=top_p,
        min_p=min_p,
        typical_p=typical_p,
        repetition_penalty=rep,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(st.stop_sequences),
        stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
        logprobs=out.top_logprobs if want_logprobs else None,
        skip_special_tokens=(
            out.skip_special_tokens if out.HasField("skip_special_tokens") else True
        ),
        time_limit_s=st.time_limit_ms / 1000 if st.time_limit_ms else None,
    )
    return GenerationInput(tuple(ids), params, st.include_stop_text, dropped)


# TGIS limits that differ from ours (from the TGIS router's validation).
TGIS_MAX_TOP_N_TOKENS = 5


def validate_tgis(
    text: str,
    params: tgis_pb2.Parameters,
    tokenizer: PromptTokenizer,
    limits: ModelLimits,
) -> GenerationInput:
    """Check one TGIS prompt and its Parameters (TGIS defaults: zero means unset)."""
    dec = params.decoding
    if dec.HasField("length_penalty"):
        raise Invalid.UNSUPPORTED.error(feature="decoding.length_penalty")
    guided = dec.WhichOneof("guided")
    if guided is not None:
        raise Invalid.UNSUPPORTED.error(feature=f"guided decoding (decoding.{guided})")
    s, st, resp = params.sampling, params.stopping, params.response
    if params.method == tgis_pb2.SAMPLE:
        temperature = s.temperature if s.HasField("temperature") else 1.0
        top_k, top_p, typical_p = s.top_k, s.top_p or 1.0, s.typical_p or 1.0
    else:
        temperature, top_k, top_p, typical_p = 0.0, 0, 1.0, 1.0
    rep = dec.repetition_penalty or 1.0
    check_sampling(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        typical_p=typical_p,
        repetition_penalty=rep,
    )
    check_stops(limits, list(st.stop_sequences))
    if resp.top_n_tokens > TGIS_MAX_TOP_N_TOKENS:
        raise Invalid.TOP_LOGPROBS.error(limit=TGIS_MAX_TOP_N_TOKENS, value=resp.top_n_tokens)
    ids, dropped = encode_prompt(
        tokenizer,
        limits,
        text=text,
        truncate=params.truncate_input_tokens,
        truncate_field="truncate_input_tokens",
    )
    max_new = max_new_tokens(limits, len(ids), st.max_new_tokens or None)
    if st.min_new_tokens > max_new:
        raise Invalid.MIN_NEW_TOKENS.error(min_new=st.min_new_tokens, max_new=max_new)
    want_logprobs = resp.token_logprobs or resp.token_ranks or resp.top_n_tokens > 0
    seed = s.seed if params.method == tgis_pb2.SAMPLE and s.HasField("seed") else None
    engine_params = _params(
        max_tokens=max_new,
        min_tokens=st.min_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        typical_p=typical_p,
        repetition_penalty=rep,
        seed=seed,
        stop=tuple(st.stop_sequences),
        # A rank needs the alternatives above the sampled token: ask for the most we may.
        logprobs=(limits.max_top_logprobs if resp.token_ranks else resp.top_n_tokens)
        if want_logprobs
        else None,
        time_limit_s=st.time_limit_millis / 1000 if st.time_limit_millis else None,
    )
    include_stop = st.include_stop_sequence if st.HasField("include_stop_sequence") else True
    return GenerationInput(tuple(ids), engine_params, include_stop, dropped)
