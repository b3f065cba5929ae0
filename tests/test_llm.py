"""Offline API: `from inference_svc import LLM, SamplingParams` generates what transformers does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inference_svc import LLM, SamplingParams
from inference_svc.engine.request import StopReason
from inference_svc.loader.tokenizer import load_tokenizer
from inference_svc.testing.models import ModelSpec, cached_model, load_reference


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_model(ModelSpec(family="qwen2", size="tiny", dtype="float32"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(
        model_dir, dtype="float32", kv_cache_memory="1MiB", max_model_len=256, max_waiting=4
    ) as engine:
        yield engine


def test_generate_text_and_token_prompts_match_transformers(llm: LLM, model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    ref = load_reference(model_dir, torch.float32)
    prompts: list[str | list[int]] = ["Hello there, how", "The quick brown fox", [5, 6, 7, 8, 9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    assert len(outs) == 3
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.prompt_token_ids == ids
        with torch.inference_mode():
            expected = ref.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=10,
                do_sample=False,
                top_k=None,
                top_p=None,
                temperature=None,
            )[0, len(ids) :].tolist()
        eos = ref.generation_config.eos_token_id
        if eos in expected:
            expected = expected[: expected.index(eos) + 1]
        assert out.token_ids == expected
        assert out.text == tok.decode(out.token_ids)
        assert out.usage.prompt_tokens == len(ids)
        assert out.usage.completion_tokens == len(expected)
        assert out.stop_reason is (
            StopReason.EOS_TOKEN if expected[-1] == eos else StopReason.LENGTH
        )


def test_single_prompt_per_prompt_params_and_logprobs(llm: LLM) -> None:
    [one] = llm.generate(
        [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True)
    )
    assert len(one.token_ids) == 3
    assert one.logprobs is not None and len(one.logprobs) == 3
    assert one.top_logprobs is not None and [len(t) for t in one.top_logprobs] == [2, 2, 2]
    # Greedy picks the top-1 token, so its logprob is the top entry.
    assert [t[0][0] for t in one.top_logprobs] == one.token_ids
    a, b = llm.generate(
        ["abc", "abc"],
        [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)],
    )  # fmt: skip
    assert len(a.token_ids) == 2 and b.token_ids[:2] == a.token_ids
    assert b.usage.cached_prompt_tokens == 0  # a 1-token prompt has no full block to share


def test_bad_arguments_are_clear(llm: LLM, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["x"], [SamplingParams(), SamplingParams()])
    with pytest.raises(TypeError, match="unknown engine options"):
        LLM(model_dir, max_num_sequences=3)
    with pytest.raises(ValueError, match="not a compute dtype"):
        LLM(model_dir, dtype="int8")


def test_more_prompts_than_the_waiting_queue_holds(llm: LLM) -> None:
    prompts = [[5 + i, 6, 7] for i in range(10)]  # max_waiting is 4 in this fixture
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.token_ids) == 2 for o in outs)
    assert outs[3].token_ids == llm.generate(prompts[3], greedy)[0].token_ids
