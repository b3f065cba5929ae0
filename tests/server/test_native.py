"""llm.v1.Inference over a real loopback channel: stream order, parity with the offline LLM,
errors, cancellation, deadlines, overload, Abort and the control RPCs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from inference_svc.engine.sampling_params import SamplingParams
from inference_svc.llm import LLM
from inference_svc.loader.tokenizer import load_tokenizer
from protos.fmaas import generation_pb2 as tg
from protos.fmaas import generation_pb2_grpc as tg_grpc
from protos.llm.v1 import inference_pb2 as pb
from protos.llm.v1 import inference_pb2_grpc as pb_grpc

from .conftest import long_request, wait_idle, wait_until

PROMPTS = ["The quick brown fox", "hello world, this is a longer prompt for the engine"]


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, dtype="float32", kv_cache_memory=4 * 1024**2, max_num_seqs=4) as llm:
        yield llm


def _kinds(events: list[pb.GenerateEvent]) -> list[str]:
    return [str(e.WhichOneof("event")) for e in events]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stream_order_and_greedy_parity_with_offline_llm(
    stub: pb_grpc.InferenceStub, offline: LLM, prompt: str
) -> None:
    req = pb.GenerateRequest(text=prompt, stopping=pb.StoppingParams(max_new_tokens=12))
    events = list(stub.Generate(req, timeout=60))
    kinds = _kinds(events)
    assert kinds[0] == "accepted" and kinds[-1] == "finished"
    assert set(kinds[1:-1]) == {"token"}
    (expected,) = offline.generate(prompt, SamplingParams(max_tokens=12, temperature=0))
    ids = [t for e in events[1:-1] for t in e.token.token_ids]
    assert ids == expected.token_ids
    assert "".join(e.token.text for e in events[1:-1]) == expected.text
    accepted, finished = events[0].accepted, events[-1].finished
    assert accepted.prompt_tokens == len(expected.prompt_token_ids)
    assert accepted.request_id  # the server made one
    assert finished.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert finished.usage.completion_tokens == len(ids)
    reason = {"length": pb.STOP_REASON_MAX_TOKENS, "eos_token": pb.STOP_REASON_EOS_TOKEN}
    assert finished.stop_reason == reason[expected.stop_reason.value]
    t = finished.timing
    assert 0 <= t.queued_s <= t.time_to_first_token_s and t.decode_s >= 0


def test_accepted_reports_prompt_and_cached_prompt_tokens(stub: pb_grpc.InferenceStub) -> None:
    """Accepted leads each stream; the second of two prompts sharing a prefix hears, in its
    Accepted, how much of it the prefix cache serves (whole blocks)."""
    block = stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).kv_block_size
    prefix = [(37 * i) % 400 + 50 for i in range(3 * block)]  # ids no other test sends
    results = []
    for tail in ([11, 12], [21, 22, 23]):
        req = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prefix + tail), stopping=pb.StoppingParams(max_new_tokens=3)
        )
        events = list(stub.Generate(req, timeout=60))
        kinds = _kinds(events)
        assert kinds[0] == "accepted" and kinds[-1] == "finished"
        assert set(kinds[1:-1]) == {"token"} and all(e.token.token_ids for e in events[1:-1])
        accepted, usage = events[0].accepted, events[-1].finished.usage
        assert accepted.prompt_tokens == usage.prompt_tokens == len(prefix) + len(tail)
        assert accepted.cached_prompt_tokens == usage.cached_prompt_tokens
        results.append(accepted.cached_prompt_tokens)
    assert results == [0, 3 * block]


def test_token_ids_and_chat_prompts(
    stub: pb_grpc.InferenceStub, offline: LLM, model_dir: Path
) -> None:
    tok = load_tokenizer(model_dir)
    messages = [pb.ChatMessage(role="user", content="Tell me about foxes")]
    chat_ids = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Tell me about foxes"}]),
        add_special_tokens=False,
    )
    tokenized = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatPrompt(messages=messages)), timeout=10)
    assert list(tokenized.token_ids) == chat_ids
    (expected,) = offline.generate(chat_ids, SamplingParams(max_tokens=8, temperature=0))
    for req in (
        pb.GenerateRequest(chat=pb.ChatPrompt(messages=messages)),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=chat_ids)),
    ):
        req.stopping.max_new_tokens = 8
        events = list(stub.Generate(req, timeout=60))
        assert [t for e in events if e.HasField("token") for t in e.token.token_ids] == (
            expected.token_ids
        )


def test_logprobs_and_stop_sequence(stub: pb_grpc.InferenceStub, offline: LLM) -> None:
    prompt = PROMPTS[0]
    (full,) = offline.generate(prompt, SamplingParams(max_tokens=12, temperature=0, logprobs=3))
    req = pb.GenerateRequest(
        text=prompt,
        stopping=pb.StoppingParams(max_new_tokens=12),
        output=pb.OutputOptions(logprobs=True, top_logprobs=3),
    )
    tokens = [e.token for e in stub.Generate(req, timeout=60) if e.HasField("token")]
    lps = [lp for t in tokens for lp in t.logprobs]
    assert [lp.token_id for lp in lps] == full.token_ids
    assert full.logprobs is not None and full.top_logprobs is not None
    assert [lp.logprob for lp in lps] == pytest.approx(full.logprobs, abs=1e-5)
    assert [[a.token_id for a in lp.top] for lp in lps] == [
        [t for t, _ in top] for top in full.top_logprobs
    ]
    # Greedy: the sampled token is the most likely one.
    assert all(lp.rank == 1 for lp in lps)
    # Stop on a piece of the text generated above; the stop text is left out unless asked for.
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), full.text
    for include in (False, True):
        req = pb.GenerateRequest(
            text=prompt,
            stopping=pb.StoppingParams(
                max_new_tokens=12, stop_sequences=[stop], include_stop_text=include
            ),
        )
        events = list(stub.Generate(req, timeout=60))
        text = "".join(e.token.text for e in events if e.HasField("token"))
        finished = events[-1].finished
        assert finished.stop_reason == pb.STOP_REASON_STOP_SEQUENCE
        assert finished.stop_sequence == stop
        head = full.text[: full.text.index(stop)]
        assert text == (head + stop if include else head)


INVALID: list[tuple[dict[str, Any], str]] = [
    ({}, "the prompt is empty"),
    ({"text": ""}, "the prompt is empty"),
    ({"token_ids": pb.TokenIds(ids=[1, 2, 99999])}, "token_ids[2]=99999 is outside the vocab"),
    ({"sampling": pb.SamplingParams(temperature=-0.5)}, "temperature must be >= 0"),
    ({"sampling": pb.SamplingParams(temperature=float("nan"))}, "temperature must be >= 0"),
    ({"sampling": pb.SamplingParams(top_p=0.0)}, "top_p must be in (0, 1]"),
    ({"sampling": pb.SamplingParams(top_p=1.5)}, "top_p must be in (0, 1]"),
    ({"sampling": pb.SamplingParams(min_p=2.0)}, "min_p must be in [0, 1]"),
    ({"sampling": pb.SamplingParams(repetition_penalty=0.0)}, "repetition_penalty must be > 0"),
    ({"stopping": pb.StoppingParams(max_new_tokens=5000)}, "max_new_tokens=5000 does not fit"),
    ({"stopping": pb.StoppingParams(max_new_tokens=0)}, "max_new_tokens must be >= 1"),
    ({"stopping": pb.StoppingParams(min_new_tokens=20)}, "min_new_tokens (20) must be <="),
    ({"stopping": pb.StoppingParams(stop_sequences=["x"] * 17)}, "17 stop sequences given"),
    ({"stopping": pb.StoppingParams(stop_sequences=["a", ""])}, "stop_sequences[1] is empty"),
    ({"stopping": pb.StoppingParams(stop_token_ids=[600])}, "stop_token_ids[0]=600 is outside"),
    ({"output": pb.OutputOptions(top_logprobs=21)}, "top_logprobs must be <= 20"),
    ({"token_ids": pb.TokenIds(ids=[5] * 4096)}, "the prompt has 4096 tokens"),
    ({"chat": pb.ChatPrompt()}, "chat.messages is empty"),
    ({"chat": pb.ChatPrompt(messages=[pb.ChatMessage(content="hi")])}, "role is empty"),
]


@pytest.mark.parametrize(("fields", "message"), INVALID)
def test_invalid_requests_are_invalid_argument(
    stub: pb_grpc.InferenceStub, fields: dict[str, Any], message: str
) -> None:
    req = pb.GenerateRequest(**fields)
    if "text" not in fields and "token_ids" not in fields and "chat" not in fields and fields:
        req.text = "a valid prompt"
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_truncation_keeps_the_last_tokens(stub: pb_grpc.InferenceStub) -> None:
    ids = list(range(10, 4110))  # too long for max_model_len=4096, fine after truncation
    ids = [t % 500 + 4 for t in ids]
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        truncate_prompt_tokens=100,
        stopping=pb.StoppingParams(max_new_tokens=2),
    )
    events = list(stub.Generate(req, timeout=60))
    assert events[0].accepted.prompt_tokens == 100
    assert events[-1].finished.usage.prompt_tokens == 100


def test_client_cancel_aborts_and_frees_blocks(stub: pb_grpc.InferenceStub) -> None:
    call = stub.Generate(long_request(), timeout=120)
    first = next(call)
    assert first.HasField("accepted")
    assert next(call).HasField("token")
    # Load is a snapshot taken after each engine step: wait for one that shows the request.
    wait_until(
        lambda: stub.GetLoad(pb.GetLoadRequest(), timeout=5).kv_usage > 0, "KV blocks in use"
    )
    call.cancel()
    load = wait_idle(stub)
    assert (load.running, load.waiting, load.kv_usage) == (0, 0, 0.0)


def test_deadline_aborts_the_request(stub: pb_grpc.InferenceStub) -> None:
    events = []
    with pytest.raises(grpc.RpcError) as info:
        for event in stub.Generate(long_request(), timeout=2.0):
            events.append(event)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The server had started it (events arrived) and no Finished was sent.
    assert _kinds(events)[0] == "accepted" and "finished" not in _kinds(events)
    wait_idle(stub)


def test_abort_rpc_ends_the_stream_cancelled(stub: pb_grpc.InferenceStub) -> None:
    assert not stub.Abort(pb.AbortRequest(request_id="nobody"), timeout=5).found
    call = stub.Generate(long_request("abort-me"), timeout=120)
    assert next(call).accepted.request_id == "abort-me"
    # A second request with the same id while the first runs is refused.
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(long_request("abort-me"), timeout=30))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert stub.Abort(pb.AbortRequest(request_id="abort-me"), timeout=5).found
    rest = list(call)
    assert rest[-1].finished.stop_reason == pb.STOP_REASON_CANCELLED
    wait_idle(stub)


def test_overload_is_resource_exhausted(stub: pb_grpc.InferenceStub, channel: grpc.Channel) -> None:
    # max_num_seqs=4 running, max_waiting=4 queued: the ninth request is refused.
    calls = []
    errors: list[grpc.RpcError] = []

    def drain(call: Any) -> None:
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            errors.append(e)

    threads = []
    try:
        for i in range(8):
            call = stub.Generate(long_request(f"load-{i}"), timeout=120)
            calls.append(call)
            threads.append(threading.Thread(target=drain, args=(call,), daemon=True))
            threads[-1].start()
            want = (min(i + 1, 4), max(i - 3, 0))

            def reached(want: tuple[int, int] = want) -> bool:
                load = stub.GetLoad(pb.GetLoadRequest(), timeout=5)
                return (load.running, load.waiting) == want

            wait_until(reached, f"running/waiting {want}")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(long_request("one-too-many"), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "overloaded" in info.value.details()
        # The TGIS stream is refused the same way, before any message is sent.
        tgis = tg_grpc.GenerationServiceStub(channel)
        received: list[tg.GenerationResponse] = []
        tg_req = tg.SingleGenerationRequest(request=tg.GenerationRequest(text="hi"))
        with pytest.raises(grpc.RpcError) as info:
            received.extend(tgis.GenerateStream(tg_req, timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and received == []
        # Health and control RPCs still answer under overload.
        assert stub.GetLoad(pb.GetLoadRequest(), timeout=5).max_waiting == 4
    finally:
        for call in calls:
            call.cancel()
        for t in threads:
            t.join(30)
    assert all(e.code() == grpc.StatusCode.CANCELLED for e in errors)
    wait_idle(stub)


def test_model_info_and_tokenize(stub: pb_grpc.InferenceStub, model_dir: Path) -> None:
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=5)
    assert info.architecture == "LlamaForCausalLM"
    assert info.max_model_len == 4096 and info.vocab_size == 512
    assert info.max_new_tokens == 16 and info.dtype == "float32"
    assert info.kv_block_size == 16 and info.kv_blocks == 8 * 4096 * 512 // (16 * 512)
    assert {"chat", "logprobs", "prefix_caching"} <= set(info.capabilities)
    tok = load_tokenizer(model_dir)
    resp = stub.Tokenize(pb.TokenizeRequest(text="hello world", return_tokens=True), timeout=5)
    ids = tok.encode("hello world", add_special_tokens=False)
    assert list(resp.token_ids) == ids and resp.token_count == len(ids)
    assert list(resp.tokens) == [tok.decode([t], skip_special_tokens=False) for t in ids]


def test_tokenize_reports_a_chat_longer_than_max_model_len(stub: pb_grpc.InferenceStub) -> None:
    """Tokenize is how clients learn a prompt is too long: chat prompts too, not only text."""
    max_len = stub.ModelInfo(pb.ModelInfoRequest(), timeout=5).max_model_len
    messages = [pb.ChatMessage(role="user", content="fox " * (max_len + 10))]
    resp = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatPrompt(messages=messages)), timeout=10)
    assert resp.token_count > max_len
