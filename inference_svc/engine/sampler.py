"""Batched sampling: each transform is a pure function over (B, V) logits and per-row parameters.

Order: repetition penalty, banned tokens (EOS/stop ids before min_tokens), temperature, top-k,
top-p, min-p, typical-p, then greedy argmax or a draw from each row's own generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference_svc.engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """CTRL-style penalty: seen tokens' positive logits divided by it, negative ones multiplied."""
    p = penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalised, logits)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    # Greedy rows (temperature 0) are divided by 1: their argmax is taken from the raw logits.
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / t.unsqueeze(1)


def top_k_mask(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value kept); k == 0 keeps all."""
    vocab = logits.shape[1]
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
    sorted_logits = logits.sort(dim=1, descending=True).values
    threshold = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < threshold, _NEG_INF)


def top_p_mask(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches p (the top one always)."""
    sorted_logits, order = logits.sort(dim=1, descending=True)
    probs = sorted_logits.softmax(dim=1)
    before = probs.cumsum(dim=1) - probs  # mass of strictly better tokens
    drop_sorted = before >= p.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, _NEG_INF)


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=1)
    threshold = probs.max(dim=1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def typical_p_mask(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling: keep tokens whose surprisal is closest to the entropy, up to `mass`."""
    logp = logits.log_softmax(dim=1)
    probs = logp.exp()
    entropy = -(probs * logp.nan_to_num(neginf=0.0)).sum(dim=1, keepdim=True)
    deviation = (-logp - entropy).abs()
    _sorted_dev, order = deviation.sort(dim=1)
    sorted_probs = probs.gather(1, order)
    before = sorted_probs.cumsum(dim=1) - sorted_probs
    drop_sorted = before >= mass.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, _NEG_INF)


def sample_from(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One draw per row (Gumbel-free exponential race); seeded rows use only their generator."""
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        q[unseeded] = torch.empty(
            (len(unseeded), probs.shape[1]), device=probs.device
        ).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return (probs / q).argmax(dim=1)


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs about one request this step."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt + output, for the repetition penalty
    num_output_tokens: int
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: the sampled token's logprob and the top-n (token, logprob), when asked for.
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def _banned(row: SamplingRow) -> tuple[int, ...]:
    if row.num_output_tokens >= row.params.min_tokens:
        return ()
    eos = () if row.params.ignore_eos else row.eos_token_ids
    return eos + row.params.stop_token_ids


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    """Sample one token per row of float32 `logits` (B, V)."""
    batch, vocab = logits.shape
    device = logits.device
    params = [r.params for r in rows]
    raw = logits
    banned = [_banned(r) for r in rows]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.zeros((batch, vocab), dtype=torch.bool, device=device)
        for i, r in enumerate(rows):
            if r.params.repetition_penalty != 1.0 and r.token_ids:
                seen[i, torch.tensor(list(r.token_ids), device=device)] = True
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
        logits = apply_repetition_penalty(logits, seen, penalty)
    if any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, list(ids)] = _NEG_INF
    greedy = [p.greedy for p in params]
    # Greedy rows take the argmax before the sampling masks: typical-p can drop the top token,
    # and a greedy answer must not depend on whether sampled rows share the batch.
    argmax = logits.argmax(dim=1)
    if all(greedy):
        tokens = argmax
    else:
        logits = apply_temperature(
            logits, torch.tensor([p.temperature for p in params], device=device)
        )
        if any(p.top_k > 0 for p in params):
            logits = top_k_mask(logits, torch.tensor([p.top_k for p in params], device=device))
        if any(p.top_p < 1.0 for p in params):
            logits = top_p_mask(logits, torch.tensor([p.top_p for p in params], device=device))
        if any(p.min_p > 0.0 for p in params):
            logits = min_p_mask(logits, torch.tensor([p.min_p for p in params], device=device))
        if any(p.typical_p < 1.0 for p in params):
            logits = typical_p_mask(
                logits, torch.tensor([p.typical_p for p in params], device=device)
            )
        drawn = sample_from(logits.softmax(dim=1), [r.generator for r in rows])
        tokens = torch.where(torch.tensor(greedy, device=device), argmax, drawn)
    token_list = tokens.tolist()
    logprobs: list[float | None] = [None] * batch
    top: list[list[tuple[int, float]] | None] = [None] * batch
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        lp = raw[want].log_softmax(dim=1)
        n = max(params[i].logprobs or 0 for i in want)
        top_vals, top_ids = lp.topk(n, dim=1) if n else (lp[:, :0], lp[:, :0].long())
        chosen = lp.gather(1, tokens[want].unsqueeze(1)).squeeze(1).tolist()
        for j, i in enumerate(want):
            logprobs[i] = chosen[j]
            k = params[i].logprobs or 0
            top[i] = list(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True))
    return SamplerOutput(token_list, logprobs, top)
