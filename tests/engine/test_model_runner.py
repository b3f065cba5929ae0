"""Step inputs: flat ids, positions, slots and metadata for a mix of prefill chunks and decodes."""

from __future__ import annotations

from inference_svc.engine.model_runner import build_step_inputs
from inference_svc.engine.request import Request
from inference_svc.engine.sampling_params import SamplingParams
from inference_svc.engine.scheduler import ScheduledRequest


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def test_prefill_chunk_then_decode_with_cached_prefix() -> None:
    # a: 6-token prompt, first chunk of 4 (no sampling); b: decode of its 7th token; c: a prompt
    # whose first 4 tokens came from the prefix cache, 2 new ones computed.
    a = _req("a", [10, 11, 12, 13, 14, 15])
    b = _req("b", [20, 21, 22, 23, 24, 25, 26])
    c = _req("c", [30, 31, 32, 33, 34, 35])
    step = build_step_inputs(
        [
            ScheduledRequest(a, 0, 4, (7,)),
            ScheduledRequest(b, 6, 1, (2, 5)),
            ScheduledRequest(c, 4, 2, (9, 3)),
        ],
        block_size=4,
    )
    assert step.input_ids.tolist() == [10, 11, 12, 13, 26, 34, 35]
    assert step.positions.tolist() == [0, 1, 2, 3, 6, 4, 5]
    assert step.meta.query_start_loc.tolist() == [0, 4, 5, 7]
    assert step.meta.seq_lens.tolist() == [4, 7, 6]
    assert step.meta.block_tables.tolist() == [[7, 0], [2, 5], [9, 3]]
    # slot = block_id * 4 + position % 4, through each sequence's own table
    assert step.meta.slot_mapping.tolist() == [28, 29, 30, 31, 22, 12, 13]
    # a is mid-prefill: only b and c sample, from their last new token
    assert step.logits_indices.tolist() == [4, 6]
    assert [s.request.request_id for s in step.sampled] == ["b", "c"]
