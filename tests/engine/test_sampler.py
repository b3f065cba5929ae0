"""Sampler: exact masks for top-k/top-p/min-p/typical-p, penalties, bans, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from inference_svc.engine.sampler import (
    SamplingRow,
    apply_repetition_penalty,
    min_p_mask,
    sample,
    top_k_mask,
    top_p_mask,
    typical_p_mask,
)
from inference_svc.engine.sampling_params import InvalidSamplingParams, SamplingParams

NEG = float("-inf")


def _logits_for(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs).log()


def _kept(masked: torch.Tensor) -> list[list[int]]:
    return [[i for i, v in enumerate(row) if v != NEG] for row in masked.tolist()]


def test_top_k_mask_per_row() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0], [5.0, 1.0, 5.0, 0.0]])
    assert _kept(top_k_mask(logits, torch.tensor([2, 0, 1]))) == [[1, 2], [0, 1, 2, 3], [0, 2]]


def test_top_p_mask_keeps_smallest_set_reaching_p() -> None:
    logits = _logits_for([[0.5, 0.3, 0.15, 0.05]] * 3)
    out = top_p_mask(logits, torch.tensor([0.5, 0.8, 0.81]))
    assert _kept(out) == [[0], [0, 1], [0, 1, 2]]
    # The top token survives even for a tiny p.
    assert _kept(top_p_mask(logits[:1], torch.tensor([1e-6]))) == [[0]]


def test_min_p_mask_relative_to_top_probability() -> None:
    logits = _logits_for([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    assert _kept(min_p_mask(logits, torch.tensor([0.5, 0.2]))) == [[0, 1], [0, 1, 2]]


def test_typical_p_mask_prefers_tokens_near_the_entropy() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    entropy = -sum(p * math.log(p) for p in probs)  # 1.2799
    dev = [abs(-math.log(p) - entropy) for p in probs]  # 0.364, 0.076, 0.330, 1.022
    order = sorted(range(4), key=lambda i: dev[i])
    assert order == [1, 2, 0, 3]
    out = typical_p_mask(_logits_for([probs, probs]), torch.tensor([0.45, 0.9]))
    assert _kept(out) == [[1, 2], [0, 1, 2]]


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def _row(params: SamplingParams, n_out: int = 0, gen: torch.Generator | None = None) -> SamplingRow:
    return SamplingRow(params, [0, 1], n_out, (3,), gen)


def test_greedy_bans_eos_before_min_tokens_and_reports_logprobs() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0], [0.0, 1.0, 2.0, 5.0]])
    rows = [
        _row(SamplingParams(temperature=0, min_tokens=2, logprobs=2), n_out=1),
        _row(SamplingParams(temperature=0, min_tokens=2, logprobs=0), n_out=2),
    ]
    out = sample(logits, rows)
    assert out.token_ids == [2, 3]
    lp = logits.log_softmax(dim=1)[0]
    assert out.logprobs[0] == pytest.approx(lp[2].item())
    assert out.top_logprobs[0] == [
        (3, pytest.approx(lp[3].item())),
        (2, pytest.approx(lp[2].item())),
    ]
    assert out.top_logprobs[1] == []


def test_seeded_rows_reproduce_regardless_of_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_rows: int) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        tokens = []
        for _ in range(20):
            rows = [_row(params, gen=gen)] + [_row(SamplingParams()) for _ in range(batch_rows - 1)]
            tokens.append(sample(logits[:batch_rows], rows).token_ids[0])
        return tokens

    alone, batched = draws(1), draws(3)
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def test_sampling_respects_masks_and_distribution() -> None:
    logits = _logits_for([[0.1, 0.6, 0.3, 0.0001]])
    gen = torch.Generator().manual_seed(0)
    counts = [0] * 4
    rows = [_row(SamplingParams(temperature=1.0, top_k=2, ignore_eos=True), gen=gen)]
    for _ in range(2000):
        counts[sample(logits, rows).token_ids[0]] += 1
    assert counts[0] == 0 and counts[3] == 0
    assert 0.6 < counts[1] / 2000 < 0.73  # 0.6/0.9 = 0.667 expected


def test_invalid_params_are_named() -> None:
    with pytest.raises(InvalidSamplingParams, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidSamplingParams, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
    with pytest.raises(InvalidSamplingParams, match="stop strings"):
        SamplingParams(stop=("",))
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(3))
def test_masks_agree_with_transformers_warpers(seed: int) -> None:
    """Each transform against the transformers logits processor of the same name, row by row."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 300, generator=gen) * 3
    ids = torch.randint(0, 300, (4, 20), generator=gen)
    for k in (1, 5, 40):
        ours = top_k_mask(logits, torch.full((4,), k))
        assert torch.equal(ours, TopKLogitsWarper(k)(ids, logits.clone()))
    for p in (0.1, 0.5, 0.9):
        ours = top_p_mask(logits, torch.full((4,), p))
        assert torch.equal(ours.isinf(), TopPLogitsWarper(p)(ids, logits.clone()).isinf())
    for m in (0.05, 0.3):
        ours = min_p_mask(logits, torch.full((4,), m))
        assert torch.equal(ours.isinf(), MinPLogitsWarper(m)(ids, logits.clone()).isinf())
    for mass in (0.2, 0.7, 0.95):
        ours = typical_p_mask(logits, torch.full((4,), mass))
        theirs = TypicalLogitsWarper(mass)(ids, logits.clone())
        assert torch.equal(ours.isinf(), theirs.isinf())
    seen = torch.zeros(4, 300, dtype=torch.bool).scatter(1, ids, True)
    ours = apply_repetition_penalty(logits, seen, torch.full((4,), 1.3))
    assert torch.allclose(ours, RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone()))


def test_greedy_row_ignores_typical_p_alone_or_beside_sampled_rows() -> None:
    # The top token (0.4) is less typical than the 60 small ones, so typical-p would drop it.
    logits = _logits_for([[0.4] + [0.01] * 60] * 2)
    greedy = _row(SamplingParams(temperature=0, typical_p=0.2))
    sampled = _row(SamplingParams(temperature=1.0, seed=1), gen=torch.Generator().manual_seed(1))
    assert _kept(typical_p_mask(logits[:1], torch.tensor([0.2])))[0][0] != 0
    assert sample(logits[:1], [greedy]).token_ids == [0]
    assert sample(logits, [greedy, sampled]).token_ids[0] == 0
