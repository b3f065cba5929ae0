"""fmaas.GenerationService answered to a client built from our fmaas stubs (TGIS wire API)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from inference_svc.loader.tokenizer import load_tokenizer
from protos.fmaas import generation_pb2 as tg
from protos.fmaas import generation_pb2_grpc as tg_grpc
from protos.llm.v1 import inference_pb2 as pb
from protos.llm.v1 import inference_pb2_grpc as pb_grpc

from .conftest import wait_idle

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tgis(channel: grpc.Channel) -> tg_grpc.GenerationServiceStub:
    return tg_grpc.GenerationServiceStub(channel)


def _native(stub: pb_grpc.InferenceStub, text: str, max_new: int) -> tuple[str, list[int]]:
    req = pb.GenerateRequest(text=text, stopping=pb.StoppingParams(max_new_tokens=max_new))
    tokens = [e.token for e in stub.Generate(req, timeout=60) if e.HasField("token")]
    return "".join(t.text for t in tokens), [i for t in tokens for i in t.token_ids]


def _params(max_new: int, **response: bool | int) -> tg.Parameters:
    return tg.Parameters(
        method=tg.GREEDY,
        stopping=tg.StoppingCriteria(max_new_tokens=max_new),
        response=tg.ResponseOptions(**response),  # type: ignore[arg-type]
    )


def test_generate_stream_follows_tgis_rules(
    tgis: tg_grpc.GenerationServiceStub, stub: pb_grpc.InferenceStub
) -> None:
    text, ids = _native(stub, PROMPT, 10)
    req = tg.SingleGenerationRequest(
        request=tg.GenerationRequest(text=PROMPT),
        params=_params(10, generated_tokens=True, token_logprobs=True, token_ranks=True),
    )
    msgs = list(tgis.GenerateStream(req, timeout=60))
    first, body, last = msgs[0], msgs[1:], msgs[-1]
    assert first.input_token_count == len(load_tokenizer_for(stub).encode(PROMPT))
    assert (first.text, first.generated_token_count, list(first.tokens)) == ("", 0, [])
    assert first.stop_reason == tg.NOT_FINISHED
    assert all(m.stop_reason == tg.NOT_FINISHED and m.input_token_count == 0 for m in body[:-1])
    assert len(ids) == 10  # this prompt runs to max_new_tokens (else the checks below change)
    assert last.stop_reason == tg.MAX_TOKENS and last.generated_token_count == 10
    counts = [m.generated_token_count for m in body]
    assert counts == sorted(counts)
    assert "".join(m.text for m in body) == text
    infos = [t for m in body for t in m.tokens]
    assert len(infos) == 10 and all(t.rank == 1 and t.logprob <= 0 for t in infos)
    assert last.seed == 0  # greedy


def load_tokenizer_for(stub: pb_grpc.InferenceStub):  # type: ignore[no-untyped-def]
    return load_tokenizer(Path(stub.ModelInfo(pb.ModelInfoRequest(), timeout=5).model_id))


def test_batched_generate_matches_native(
    tgis: tg_grpc.GenerationServiceStub, stub: pb_grpc.InferenceStub
) -> None:
    prompts = [PROMPT, "hello world", "a third prompt"]
    req = tg.BatchedGenerationRequest(
        requests=[tg.GenerationRequest(text=p) for p in prompts],
        params=_params(8, input_text=True),
    )
    resp = tgis.Generate(req, timeout=60)
    assert len(resp.responses) == 3
    for prompt, r in zip(prompts, resp.responses, strict=True):
        text, ids = _native(stub, prompt, 8)
        assert r.text == prompt + text  # input_text: the prompt comes first
        assert r.generated_token_count == len(ids)
        assert r.stop_reason == (tg.MAX_TOKENS if len(ids) == 8 else tg.EOS_TOKEN)
        assert r.input_token_count > 0


def test_sampling_reports_its_seed_and_reproduces(tgis: tg_grpc.GenerationServiceStub) -> None:
    params = tg.Parameters(
        method=tg.SAMPLE,
        sampling=tg.SamplingParameters(temperature=1.5, top_k=50),
        stopping=tg.StoppingCriteria(max_new_tokens=12),
    )
    req = tg.BatchedGenerationRequest(requests=[tg.GenerationRequest(text=PROMPT)], params=params)
    (first,) = tgis.Generate(req, timeout=60).responses
    assert first.seed != 0
    req.params.sampling.seed = first.seed
    (again,) = tgis.Generate(req, timeout=60).responses
    assert (again.text, again.seed) == (first.text, first.seed)


def test_stop_sequence_included_by_default(
    tgis: tg_grpc.GenerationServiceStub, stub: pb_grpc.InferenceStub
) -> None:
    text, _ = _native(stub, PROMPT, 12)
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    params = _params(12)
    params.stopping.stop_sequences.append(stop)
    req = tg.BatchedGenerationRequest(requests=[tg.GenerationRequest(text=PROMPT)], params=params)
    (r,) = tgis.Generate(req, timeout=60).responses
    assert r.stop_reason == tg.STOP_SEQUENCE and r.stop_sequence == stop
    assert r.text == text[: text.index(stop)] + stop
    req.params.stopping.include_stop_sequence = False
    (r,) = tgis.Generate(req, timeout=60).responses
    assert r.text == text[: text.index(stop)]


@pytest.mark.parametrize(
    ("params", "code", "message"),
    [
        (
            tg.Parameters(response=tg.ResponseOptions(top_n_tokens=6)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_logprobs must be <= 5",
        ),
        (
            tg.Parameters(method=tg.SAMPLE, sampling=tg.SamplingParameters(temperature=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature must be >= 0",
        ),
        (
            tg.Parameters(decoding=tg.DecodingParameters(regex="a+")),
            grpc.StatusCode.FAILED_PRECONDITION,
            "guided decoding (decoding.regex) is not supported",
        ),
    ],
)
def test_invalid_parameters(
    tgis: tg_grpc.GenerationServiceStub, params: tg.Parameters, code: grpc.StatusCode, message: str
) -> None:
    req = tg.SingleGenerationRequest(request=tg.GenerationRequest(text=PROMPT), params=params)
    with pytest.raises(grpc.RpcError) as info:
        list(tgis.GenerateStream(req, timeout=30))
    assert info.value.code() == code
    assert message in info.value.details()


def test_batch_error_names_the_request(tgis: tg_grpc.GenerationServiceStub) -> None:
    req = tg.BatchedGenerationRequest(
        requests=[tg.GenerationRequest(text="fine"), tg.GenerationRequest(text="")],
        params=_params(4),
    )
    with pytest.raises(grpc.RpcError) as info:
        tgis.Generate(req, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("requests[1]: the prompt is empty")


def test_stream_cancel_frees_the_request(
    tgis: tg_grpc.GenerationServiceStub, stub: pb_grpc.InferenceStub
) -> None:
    params = _params(4000)
    req = tg.SingleGenerationRequest(request=tg.GenerationRequest(text=PROMPT), params=params)
    call = tgis.GenerateStream(req, timeout=60)
    next(call)
    next(call)
    call.cancel()
    wait_idle(stub)


def test_tokenize_and_model_info(
    tgis: tg_grpc.GenerationServiceStub, stub: pb_grpc.InferenceStub, model_dir: Path
) -> None:
    backend = load_tokenizer(model_dir).backend
    texts = ["hello world", "The quick brown fox jumps"]
    req = tg.BatchedTokenizeRequest(
        requests=[tg.TokenizeRequest(text=t) for t in texts],
        return_tokens=True,
        return_offsets=True,
    )
    resp = tgis.Tokenize(req, timeout=10)
    for text, r in zip(texts, resp.responses, strict=True):
        enc = backend.encode(text)
        assert r.token_count == len(enc.ids)
        assert list(r.tokens) == enc.tokens
        assert [(o.start, o.end) for o in r.offsets] == enc.offsets
        assert "".join(text[o.start : o.end] for o in r.offsets).replace(" ", "") == text.replace(
            " ", ""
        )
    req.truncate_input_tokens = 2
    for text, r in zip(texts, tgis.Tokenize(req, timeout=10).responses, strict=True):
        assert r.token_count == 2 and list(r.tokens) == backend.encode(text).tokens[-2:]
    info = tgis.ModelInfo(tg.ModelInfoRequest(model_id="anything"), timeout=5)
    assert info.model_kind == tg.ModelInfoResponse.DECODER_ONLY
    assert (info.max_sequence_length, info.max_new_tokens) == (4096, 16)
