"""Engine against the transformers oracle: 32 concurrent greedy requests, preemption, prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from inference_svc.engine.engine import Engine, EngineConfig
from inference_svc.engine.outputs import RequestOutput
from inference_svc.engine.planner import InsufficientMemoryError, ModelShape, kv_bytes_per_token
from inference_svc.engine.request import StopReason
from inference_svc.engine.sampling_params import SamplingParams

MAX_NEW = 8
HFGreedy = Callable[[list[int], int], list[int]]
Prompts = Callable[..., list[list[int]]]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)


def make_engine(
    executor: Any, num_blocks: int = 1024, block_size: int = 4, tokenizer: Any = None, **kw: Any
) -> Engine:
    per_token = kv_bytes_per_token(
        ModelShape.from_model_config(executor.config), executor.tp_size, "float32"
    )
    options: dict[str, Any] = {
        "max_num_seqs": 32,
        "max_num_batched_tokens": 256,
        "max_model_len": 128,
        "long_prefill_threshold": 32,
        **kw,
    }
    config = EngineConfig(
        block_size=block_size, kv_cache_memory=num_blocks * block_size * per_token, **options
    )
    return Engine(executor, tokenizer, config)


def run_all(
    engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> dict[str, RequestOutput | list[int]]:
    """Submit everything at once, step to the end; returns id -> tokens and id/final -> output."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    tokens: dict[str, Any] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                tokens[out.request_id + "/final"] = out
    return tokens


def assert_pool_empty(engine: Engine) -> None:
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_32_concurrent_requests_match_transformers(
    executor: Any, hf_greedy: HFGreedy, random_prompts: Prompts
) -> None:
    engine = make_engine(executor)
    prompts = random_prompts(32)
    assert max(map(len, prompts)) > 32  # some prefills are chunked across steps
    got = run_all(engine, prompts)
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(prompt, MAX_NEW), f"prompt {i} (len {len(prompt)})"
        final = got[f"{i}/final"]
        assert isinstance(final, RequestOutput)
        assert final.usage.prompt_tokens == len(prompt)
        assert final.usage.completion_tokens == len(got[str(i)])
        assert final.stop_reason in (StopReason.LENGTH, StopReason.EOS_TOKEN)
    stats = engine.stats()
    assert stats.num_finished == 32 and stats.running == 0 and stats.waiting == 0
    assert_pool_empty(engine)


def test_preemption_keeps_outputs_exact(
    executor: Any, hf_greedy: HFGreedy, random_prompts: Prompts
) -> None:
    # 40 blocks of 4 tokens cannot hold 32 sequences of up to 77 tokens: preemption must happen.
    engine = make_engine(executor, num_blocks=40, max_model_len=80)
    prompts = random_prompts(32, seed=1)
    got = run_all(engine, prompts)
    assert engine.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(prompt, MAX_NEW), f"prompt {i}"
    assert_pool_empty(engine)


def test_shared_prefix_hits_cache_and_changes_nothing(
    executor: Any, hf_greedy: HFGreedy, random_prompts: Prompts
) -> None:
    prefix = random_prompts(1, seed=2, lo=41, hi=42)[0]
    prompts = [prefix + tail for tail in random_prompts(8, seed=3, lo=1, hi=20)]
    engine = make_engine(executor)
    first = run_all(engine, prompts[:1])
    rest = run_all(engine, prompts[1:])
    for i, prompt in enumerate(prompts[1:]):
        final = rest[f"{i}/final"]
        assert isinstance(final, RequestOutput)
        assert final.usage.cached_prompt_tokens == 40  # 10 full blocks of the 41-token prefix
        assert rest[str(i)] == hf_greedy(prompt, MAX_NEW)
    assert first["0"] == hf_greedy(prompts[0], MAX_NEW)
    stats = engine.stats()
    assert stats.prefix_hit_tokens == 7 * 40
    assert_pool_empty(engine)
    uncached = make_engine(executor, enable_prefix_caching=False)
    plain = run_all(uncached, prompts[1:])
    assert all(plain[str(i)] == rest[str(i)] for i in range(7))
    assert uncached.stats().prefix_hit_tokens == 0


def test_abort_and_time_limit_free_blocks(executor: Any) -> None:
    engine = make_engine(executor)
    engine.add_request(list(range(4, 40)), SamplingParams(max_tokens=50, temperature=0), "a")
    engine.add_request(
        list(range(4, 30)), SamplingParams(max_tokens=50, temperature=0, time_limit_s=1e-9), "t"
    )
    outputs = engine.step()
    assert [(o.request_id, o.stop_reason) for o in outputs if o.finished] == [
        ("t", StopReason.TIME_LIMIT)
    ]
    engine.step()
    final = engine.abort("a")
    assert final is not None and final.finished and final.stop_reason is StopReason.ABORTED
    assert engine.abort("a") is None
    assert not engine.has_unfinished()
    assert_pool_empty(engine)


def test_seeded_sampling_is_reproducible_in_any_batch(
    executor: Any, random_prompts: Prompts
) -> None:
    engine = make_engine(executor)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=7, ignore_eos=True)
    alone = run_all(engine, [[5, 6, 7, 8]], seeded)["0"]
    others = SamplingParams(max_tokens=12, temperature=1.0)
    for i, prompt in enumerate(random_prompts(5, seed=4)):
        engine.add_request(prompt, others, request_id=f"other{i}")
    engine.add_request([5, 6, 7, 8], seeded, request_id="again")
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "again":
                tokens.extend(out.new_token_ids)
    assert tokens == alone and len(set(tokens)) > 1


def test_min_and_max_tokens_and_logprobs(executor: Any) -> None:
    engine = make_engine(executor)
    params = SamplingParams(max_tokens=5, min_tokens=5, temperature=0, logprobs=3)
    final = run_all(engine, [[9, 10, 11]], params)["0/final"]
    assert isinstance(final, RequestOutput)
    assert final.usage.completion_tokens == 5 and final.stop_reason is StopReason.LENGTH


def test_refuses_when_one_max_length_request_cannot_fit(executor: Any) -> None:
    with pytest.raises(InsufficientMemoryError) as err:
        make_engine(executor, num_blocks=10, max_model_len=128)
    assert err.value.advised_max_model_len == 40


def test_stop_string_never_emitted(executor: Any, tokenizer: Any) -> None:
    engine = make_engine(executor, tokenizer=tokenizer)
    prompt = tokenizer.encode("The quick brown fox")
    free = run_all(engine, [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    text = tokenizer.decode(free["0"])
    stop = text[6:10]
    assert len(stop.strip()) >= 2, text
    engine.add_request(
        prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,)), "s"
    )
    streamed = ""
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.new_text
            assert stop not in streamed
            final = out
    assert final is not None and final.stop_reason is StopReason.STOP_STRING
    assert final.stop_detail == stop
    assert streamed == text[: text.index(stop)]
    assert_pool_empty(engine)


def test_bounded_queue_rejects_with_queue_full(executor: Any) -> None:
    from inference_svc.engine.scheduler import QueueFullError

    engine = make_engine(executor, max_waiting=2)
    engine.add_request([5, 6], GREEDY, "a")
    engine.add_request([5, 7], GREEDY, "b")
    with pytest.raises(QueueFullError, match="limit 2"):
        engine.add_request([5, 8], GREEDY, "c")
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([-1], GREEDY, "d")


def test_pool_sized_from_budget_minus_weights_activations_overhead(executor: Any) -> None:
    shape = ModelShape.from_model_config(executor.config)
    block_bytes = 4 * kv_bytes_per_token(shape, 1, "float32")
    weights = executor.weight_bytes_per_rank()
    activation = executor.profile_peak_activation_bytes(64, 8)
    assert weights > 0 and activation > 0
    overhead = 1000
    budget = weights + activation + overhead + 50 * block_bytes + block_bytes // 2
    config = EngineConfig(
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
        memory_budget=budget,
        runtime_overhead=overhead,
        warmup=False,
    )
    engine = Engine(executor, None, config)
    assert engine.plan.num_blocks == 50
    assert engine.plan.activation_bytes == activation
    assert engine.plan.weight_bytes == weights
    with pytest.raises(InsufficientMemoryError, match="max_model_len=32"):
        Engine(
            executor,
            None,
            EngineConfig(**{**config.__dict__, "memory_budget": budget - 42 * block_bytes}),
        )


@pytest.mark.parametrize(
    "spec",
    [
        {"family": "qwen3"},  # q/k norms
        {"family": "mistral", "num_key_value_heads": 1},  # multi-query
        {"family": "qwen2", "tie_word_embeddings": True},  # q/k/v biases, tied head
    ],
    ids=["qwen3", "mistral-mqa", "qwen2-tied"],
)
def test_other_families_match_transformers(spec: dict[str, Any], random_prompts: Prompts) -> None:
    import torch

    from inference_svc.model.executor import create_executor
    from inference_svc.testing.models import ModelSpec, cached_model, load_reference

    model_dir = cached_model(ModelSpec(size="tiny", dtype="float32", **spec))
    ref = load_reference(model_dir, torch.float32)
    executor = create_executor(model_dir, dtype=torch.float32)
    try:
        # 30 blocks for 8 prompts of up to 77 tokens: chunked, preempted and prefix-cached.
        engine = make_engine(executor, num_blocks=30, max_model_len=80, max_num_seqs=8)
        prompts = random_prompts(8, seed=9)
        prompts[1] = prompts[0][:40] + prompts[1][:5]
        got = run_all(engine, prompts)
        eos = ref.generation_config.eos_token_id
        for i, prompt in enumerate(prompts):
            with torch.inference_mode():
                out = ref.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=MAX_NEW,
                    do_sample=False,
                    top_k=None,
                    top_p=None,
                    temperature=None,
                )[0, len(prompt) :].tolist()
            if eos in out:
                out = out[: out.index(eos) + 1]
            assert got[str(i)] == out, f"prompt {i}"
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
        assert_pool_empty(engine)
    finally:
        executor.shutdown()


def test_refused_stop_strings_leave_nothing_queued(executor: Any) -> None:
    engine = make_engine(executor, warmup=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, stop=["x"]), request_id="s")
    assert not engine.has_unfinished()
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), request_id="s")  # id is free


def test_stop_string_on_the_last_allowed_token_is_the_stop_reason(
    executor: Any, tokenizer: Any
) -> None:
    """The text is cut before the stop string, so the reason says so, not max_tokens."""
    engine = make_engine(executor, tokenizer=tokenizer)
    prompt = tokenizer.encode("The quick brown fox")
    free = run_all(engine, [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    ids: list[int] = free["0"]  # type: ignore[assignment]
    stop = tokenizer.decode(ids)[6:10]
    last = next(n for n in range(1, 25) if stop in tokenizer.decode(ids[:n]))
    params = SamplingParams(max_tokens=last, temperature=0, ignore_eos=True, stop=(stop,))
    result = run_all(engine, [prompt], params)
    final = result["0/final"]
    assert isinstance(final, RequestOutput)
    assert (final.stop_reason, final.stop_detail) == (StopReason.STOP_STRING, stop)
    assert_pool_empty(engine)


def test_stop_token_ids_outside_the_vocabulary_are_refused(executor: Any) -> None:
    engine = make_engine(executor, warmup=False)
    vocab = executor.config.vocab_size
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(vocab,))
    with pytest.raises(ValueError, match=r"stop_token_ids out of range \[0, "):
        engine.add_request([5, 6, 7], params, request_id="t")
    assert not engine.has_unfinished()
