"""fmaas.GenerationService matches the upstream TGIS contract on the wire.

Bytes are built by hand with the field numbers of the upstream generation.proto
(IBM text-generation-inference / vllm-tgis-adapter), then decoded by field name
with our stubs; and our messages are encoded and read back as raw
(field number, wire type, value) triples. A renumbered field fails both ways.
"""

from __future__ import annotations

import struct

from protos.fmaas import generation_pb2 as pb

# ---- a minimal protobuf wire codec (enough for these messages) -------------

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(number: int, value: int | float | bytes | str, wire: int | None = None) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, bytes):
        return _varint(number << 3 | LEN) + _varint(len(value)) + value
    if isinstance(value, float) or wire == FIXED32:
        return _varint(number << 3 | FIXED32) + struct.pack("<f", value)
    return _varint(number << 3 | VARINT) + _varint(value)


def decode(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """Raw (field number, wire type, value) triples in wire order."""
    out: list[tuple[int, int, int | bytes]] = []
    i = 0

    def read_varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            b = data[i]
            i += 1
            result |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return result

    while i < len(data):
        key = read_varint()
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == VARINT:
            value = read_varint()
        elif wire == LEN:
            n = read_varint()
            value = data[i : i + n]
            i += n
        elif wire == FIXED32:
            value = data[i : i + 4]
            i += 4
        elif wire == FIXED64:
            value = data[i : i + 8]
            i += 8
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        out.append((number, wire, value))
    return out


def f32(raw: int | bytes) -> float:
    assert isinstance(raw, bytes)
    return float(struct.unpack("<f", raw)[0])


# ---- upstream numbers, written out by hand ---------------------------------


def upstream_parameters() -> bytes:
    sampling = field(1, 0.5) + field(2, 40) + field(3, 0.9) + field(4, 0.95) + field(5, 1234)
    stopping = (
        field(1, 64)
        + field(2, 3)
        + field(3, 1500)
        + field(4, "\n\n")
        + field(4, "END")
        + field(5, 1)  # include_stop_sequence
    )
    response = field(1, 1) + field(2, 1) + field(3, 1) + field(4, 1) + field(5, 1) + field(6, 5)
    length_penalty = field(1, 10) + field(2, 1.5)
    decoding = field(1, 1.2) + field(2, length_penalty) + field(5, "[a-z]+")
    return (
        field(1, 1)  # method = SAMPLE
        + field(2, sampling)
        + field(3, stopping)
        + field(4, response)
        + field(5, decoding)
        + field(6, 512)
    )


def test_single_generation_request_decodes_by_name() -> None:
    wire = (
        field(1, "my-model")
        + field(2, "old-prefix")
        + field(4, "adapter-a")
        + field(3, field(2, "Hello there"))
        + field(10, upstream_parameters())
    )
    req = pb.SingleGenerationRequest.FromString(wire)
    assert req.model_id == "my-model"
    assert req.prefix_id == "old-prefix"
    assert req.adapter_id == "adapter-a"
    assert req.request.text == "Hello there"
    p = req.params
    assert p.method == pb.DecodingMethod.SAMPLE
    assert p.sampling.HasField("temperature") and abs(p.sampling.temperature - 0.5) < 1e-7
    assert p.sampling.top_k == 40
    assert abs(p.sampling.top_p - 0.9) < 1e-6 and abs(p.sampling.typical_p - 0.95) < 1e-6
    assert p.sampling.seed == 1234
    assert p.stopping.max_new_tokens == 64 and p.stopping.min_new_tokens == 3
    assert p.stopping.time_limit_millis == 1500
    assert list(p.stopping.stop_sequences) == ["\n\n", "END"]
    assert p.stopping.HasField("include_stop_sequence") and p.stopping.include_stop_sequence
    r = p.response
    assert (r.input_text, r.generated_tokens, r.input_tokens) == (True, True, True)
    assert (r.token_logprobs, r.token_ranks, r.top_n_tokens) == (True, True, 5)
    assert abs(p.decoding.repetition_penalty - 1.2) < 1e-6
    assert p.decoding.length_penalty.start_index == 10
    assert p.decoding.length_penalty.decay_factor == 1.5
    assert p.decoding.WhichOneof("guided") == "regex" and p.decoding.regex == "[a-z]+"
    assert p.truncate_input_tokens == 512


def test_batched_generation_request_decodes_by_name() -> None:
    wire = (
        field(1, "m")
        + field(3, field(2, "first"))
        + field(3, field(2, "second"))
        + field(10, field(1, 0))
    )
    req = pb.BatchedGenerationRequest.FromString(wire)
    assert [r.text for r in req.requests] == ["first", "second"]
    assert req.params.method == pb.DecodingMethod.GREEDY
    assert not req.HasField("adapter_id")


def test_generation_response_encodes_upstream_numbers() -> None:
    top = pb.TokenInfo.TopToken(text="b", logprob=-0.25)
    resp = pb.GenerationResponse(
        input_token_count=7,
        generated_token_count=3,
        text="abc",
        stop_reason=pb.StopReason.STOP_SEQUENCE,
        stop_sequence="c",
        seed=99,
        tokens=[pb.TokenInfo(text="a", logprob=-0.5, rank=2, top_tokens=[top])],
        input_tokens=[pb.TokenInfo(text="x")],
    )
    raw = {n: v for n, _, v in decode(resp.SerializeToString())}
    assert raw[6] == 7 and raw[2] == 3 and raw[4] == b"abc"
    assert raw[7] == 5  # STOP_SEQUENCE
    assert raw[11] == b"c" and raw[10] == 99
    token = {n: v for n, _, v in decode(raw[8])}  # type: ignore[arg-type]
    assert token[2] == b"a" and f32(token[3]) == -0.5 and token[4] == 2
    top_raw = {n: v for n, _, v in decode(token[5])}  # type: ignore[arg-type]
    assert top_raw[2] == b"b" and f32(top_raw[3]) == -0.25
    assert {n: v for n, _, v in decode(raw[9])}[2] == b"x"  # type: ignore[arg-type]
    batched = pb.BatchedGenerationResponse(responses=[resp]).SerializeToString()
    assert decode(batched)[0][0] == 1


def test_stop_reason_and_method_numbers() -> None:
    expected = {
        "NOT_FINISHED": 0,
        "MAX_TOKENS": 1,
        "EOS_TOKEN": 2,
        "CANCELLED": 3,
        "TIME_LIMIT": 4,
        "STOP_SEQUENCE": 5,
        "TOKEN_LIMIT": 6,
        "ERROR": 7,
    }
    assert dict(pb.StopReason.items()) == expected
    assert dict(pb.DecodingMethod.items()) == {"GREEDY": 0, "SAMPLE": 1}
    kinds = pb.ModelInfoResponse.ModelKind
    assert dict(kinds.items()) == {"DECODER_ONLY": 0, "ENCODER_DECODER": 1}


def test_tokenize_messages() -> None:
    wire = (
        field(1, "m")
        + field(2, field(1, "hello world"))
        + field(3, 1)
        + field(4, 1)
        + field(5, 8)
        + field(7, "adapter-b")
    )
    req = pb.BatchedTokenizeRequest.FromString(wire)
    assert req.model_id == "m" and req.requests[0].text == "hello world"
    assert req.return_tokens and req.return_offsets and req.truncate_input_tokens == 8
    assert req.adapter_id == "adapter-b"
    resp = pb.BatchedTokenizeResponse(
        responses=[
            pb.TokenizeResponse(
                token_count=2,
                tokens=["hello", " world"],
                offsets=[pb.TokenizeResponse.Offset(start=0, end=5)],
            )
        ]
    )
    inner = decode(decode(resp.SerializeToString())[0][2])  # type: ignore[arg-type]
    assert inner[0] == (1, VARINT, 2)
    assert [(n, v) for n, _, v in inner[1:3]] == [(2, b"hello"), (2, b" world")]
    # proto3 leaves zero-valued scalars off the wire, so start=0 is absent
    assert decode(inner[3][2]) == [(2, VARINT, 5)]  # type: ignore[arg-type]


def test_model_info_messages() -> None:
    assert pb.ModelInfoRequest.FromString(field(1, "m")).model_id == "m"
    resp = pb.ModelInfoResponse(
        model_kind=pb.ModelInfoResponse.ENCODER_DECODER,
        max_sequence_length=4096,
        max_new_tokens=1024,
    )
    assert decode(resp.SerializeToString()) == [(1, 0, 1), (2, 0, 4096), (3, 0, 1024)]


def test_service_methods_match_upstream() -> None:
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    assert service.full_name == "fmaas.GenerationService"
    shapes = {
        m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods
    }
    assert shapes == {
        "Generate": ("BatchedGenerationRequest", "BatchedGenerationResponse", False),
        "GenerateStream": ("SingleGenerationRequest", "GenerationResponse", True),
        "Tokenize": ("BatchedTokenizeRequest", "BatchedTokenizeResponse", False),
        "ModelInfo": ("ModelInfoRequest", "ModelInfoResponse", False),
    }
