"""The executor at TP=2 (two gloo processes) against TP=1: replicated KV heads, a vocabulary
not divisible by 2 or 64, tied embeddings; chunked prefill against transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inference_svc.model.attention import AttentionMetadata
from inference_svc.model.executor import Executor, create_executor
from inference_svc.testing.models import ModelSpec, cached_model, load_reference

from .conftest import PROMPTS, PagedBatch, greedy, rel_err

TP_SPECS = {
    # 1 KV head over 2 ranks (replicated), qkv bias, vocabulary 515 = odd and not a multiple of 64.
    "qwen2-kv1-vocab515": ModelSpec(family="qwen2", num_key_value_heads=1, vocab_size=515),
    # KV heads split, q/k norms, tied embeddings (vocab-parallel lm_head shares the rows).
    "qwen3-tied": ModelSpec(family="qwen3", tie_word_embeddings=True, vocab_size=577),
}


@pytest.fixture(scope="module", params=list(TP_SPECS))
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Path, Executor, Executor]]:
    model_dir = cached_model(TP_SPECS[request.param])
    tp1 = create_executor(model_dir)
    tp2 = create_executor(model_dir, tensor_parallel_size=2)
    try:
        yield model_dir, tp1, tp2
    finally:
        tp2.shutdown()
        tp1.shutdown()


def test_tp2_logits_equal_tp1(pair: tuple[Path, Executor, Executor]) -> None:
    _, tp1, tp2 = pair
    ids = torch.cat([torch.tensor(p) for p in PROMPTS])
    positions = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    meta = AttentionMetadata.for_prefill([len(p) for p in PROMPTS], 4)
    every = torch.arange(len(ids))
    outs = []
    for ex in (tp1, tp2):
        ex.allocate_kv_cache(64, 4)
        outs.append(ex.execute(ids, positions, meta, every))
    assert outs[1].shape == outs[0].shape == (len(ids), tp1.config.vocab_size)
    assert rel_err(outs[1], outs[0]) < 1e-5


def test_tp2_greedy_equals_tp1(pair: tuple[Path, Executor, Executor]) -> None:
    _, tp1, tp2 = pair
    assert greedy(tp2, PROMPTS, 32) == greedy(tp1, PROMPTS, 32)


def test_chunked_prefill_then_decode_matches_transformers(
    pair: tuple[Path, Executor, Executor],
) -> None:
    model_dir, _, tp2 = pair
    ref = load_reference(model_dir, torch.float32)
    prompt = PROMPTS[2]
    with torch.inference_mode():
        want = ref(torch.tensor([prompt])).logits[0]
    tp2.allocate_kv_cache(32, 4)
    batch = PagedBatch(32, 4, seed=3)
    a, b = batch.add(prompt), batch.add(PROMPTS[0])
    # Chunks of 6, then 5 alongside another sequence's whole prefill, then single tokens.
    got = [batch.step(tp2, {a: prompt[:6]})[a]]
    got.append(batch.step(tp2, {a: prompt[6:11], b: PROMPTS[0]})[a])
    for i in range(11, len(prompt)):
        got.append(batch.step(tp2, {a: [prompt[i]]})[a])
    want_rows = want[[5, 10, *range(11, len(prompt))]]
    assert rel_err(torch.stack(got), want_rows) < 1e-4


def test_tp2_splits_the_weights_and_reports_each_rank(
    pair: tuple[Path, Executor, Executor],
) -> None:
    _, tp1, tp2 = pair
    assert tp2.tp_size == 2 and [r.rank for r in tp2.load_reports] == [0, 1]
    assert tp2.weight_bytes_per_rank() < 0.75 * tp1.weight_bytes_per_rank()
    total = tp1.load_reports[0].bytes_read
    for report in tp2.load_reports:
        assert report.tp_size == 2 and report.checkpoint_bytes == total
        assert 0.3 * total < report.bytes_read < 0.7 * total
        assert report.peak_rss_bytes > 0 and report.seconds > 0


def test_profile_measures_activation_growth(pair: tuple[Path, Executor, Executor]) -> None:
    _, tp1, tp2 = pair
    small, large = (tp1.profile_peak_activation_bytes(n, 2) for n in (8, 128))
    assert 0 < small < large
    # Per rank, the sharded activations are smaller than at TP=1 (hidden states replicated).
    assert 0 < tp2.profile_peak_activation_bytes(128, 2) < large


def test_tp1_is_zero_copy_on_cpu() -> None:
    with create_executor(cached_model(TP_SPECS["qwen2-kv1-vocab515"])) as ex:
        report = ex.load_reports[0]
        assert report.bytes_in_place == report.bytes_read == report.checkpoint_bytes


def test_a_second_dtype_is_cast_with_one_copy() -> None:
    model_dir = cached_model(TP_SPECS["qwen2-kv1-vocab515"])
    with create_executor(model_dir, dtype=torch.bfloat16) as ex:
        report = ex.load_reports[0]
        assert report.bytes_in_place == 0 and report.bytes_read == report.checkpoint_bytes
        ex.allocate_kv_cache(16, 4)
        meta = AttentionMetadata.for_prefill([len(PROMPTS[0])], 4)
        logits = ex.execute(
            torch.tensor(PROMPTS[0]), torch.arange(len(PROMPTS[0])), meta, torch.tensor([8])
        )
    ref = load_reference(model_dir, torch.float32)
    with torch.inference_mode():
        want = ref(torch.tensor([PROMPTS[0]])).logits[0, 8]
    assert logits.dtype == torch.float32
    assert rel_err(logits[0], want) < 0.05  # bf16 weights: close, not equal


def test_refuses_tp_sizes_the_heads_cannot_split() -> None:
    from inference_svc.model.config import ModelConfigError

    with pytest.raises(ModelConfigError, match="attention heads"):
        create_executor(cached_model(TP_SPECS["qwen3-tied"]), tensor_parallel_size=3)


def test_inconsistent_steps_are_refused_before_any_rank_runs(
    pair: tuple[Path, Executor, Executor],
) -> None:
    _, _, tp2 = pair
    tp2.allocate_kv_cache(8, 4)
    meta = AttentionMetadata.for_prefill([3], 4)
    ids, pos, last = torch.tensor([1, 2, 3]), torch.arange(3), torch.tensor([2])
    bad = [
        (torch.tensor([1, 2, 10**6]), pos, meta, last, "token ids"),
        (ids, torch.arange(4), meta, last, "must all be"),
        (ids, pos, meta, torch.tensor([3]), "logits_indices"),
        (ids, pos, AttentionMetadata.for_prefill([3], 2), last, "block_size"),
    ]
    short = AttentionMetadata.for_prefill([3], 4)
    short.seq_lens = torch.tensor([2])  # 3 new tokens in a context of 2
    bad.append((ids, pos, short, last, "3 new tokens, context 2"))
    big = AttentionMetadata.for_prefill([3], 4)
    big.slot_mapping = torch.tensor([0, 1, 99])
    bad.append((ids, pos, big, last, "slot_mapping points past"))
    for i, p, m, li, message in bad:
        with pytest.raises(ValueError, match=message):
            tp2.execute(i, p, m, li)
    # The group is still in step: a good step after the refusals works.
    assert tp2.execute(ids, pos, meta, last).shape == (1, tp2.config.vocab_size)


def test_a_dead_worker_is_reported_not_waited_on() -> None:
    with create_executor(cached_model(TP_SPECS["qwen3-tied"]), tensor_parallel_size=2) as ex:
        worker = ex._workers[0]
        worker.kill()
        worker.join()
        with pytest.raises(RuntimeError, match="TP worker exited"):
            ex.allocate_kv_cache(8, 4)
    assert not worker.is_alive()


def test_a_failure_on_rank_0_mid_step_stops_the_group_instead_of_hanging() -> None:
    with create_executor(cached_model(TP_SPECS["qwen3-tied"]), tensor_parallel_size=2) as ex:
        ex.allocate_kv_cache(8, 4)
        meta = AttentionMetadata.for_prefill([3], 4)
        args = (torch.tensor([1, 2, 3]), torch.arange(3), meta, torch.tensor([2]))

        def fail(*_: object) -> None:
            raise RuntimeError("injected fault after the first all-reduce")

        # Fault injection into rank 0 only: rank 1 is left inside a collective of layer 1.
        ex._rank.model.model.layers[1].mlp.forward = fail  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="injected"):
            ex.execute(*args)
        with pytest.raises(RuntimeError, match="TP group stopped after a failed step"):
            ex.execute(*args)
    assert not any(w.is_alive() for w in ex._workers)


def test_bad_cache_and_profile_sizes_are_refused_before_the_followers_see_them(
    pair: tuple[Path, Executor, Executor],
) -> None:
    _, _, tp2 = pair
    with pytest.raises(ValueError, match="positive num_blocks"):
        tp2.allocate_kv_cache(0, 4)
    with pytest.raises(ValueError, match="num_tokens >= num_seqs"):
        tp2.profile_peak_activation_bytes(1, 2)
    # Every rank is still alive and in step.
    tp2.allocate_kv_cache(8, 4)
    meta = AttentionMetadata.for_prefill([3], 4)
    logits = tp2.execute(torch.tensor([1, 2, 3]), torch.arange(3), meta, torch.tensor([2]))
    assert logits.shape == (1, tp2.config.vocab_size)
