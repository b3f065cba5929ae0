"""The engine over a TP=2 executor (two gloo ranks) matches transformers, with preemption and
prefix hits; one executor serves every test here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from inference_svc.engine.engine import Engine, EngineConfig
from inference_svc.engine.planner import ModelShape, kv_bytes_per_token
from inference_svc.engine.sampling_params import SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)


@pytest.fixture(scope="module")
def tp2_executor(tiny_dir: Path) -> Iterator[Any]:
    from inference_svc.model.executor import create_executor

    ex = create_executor(tiny_dir, tensor_parallel_size=2, dtype=torch.float32)
    yield ex
    ex.shutdown()


def _engine(executor: Any, num_blocks: int, max_model_len: int = 128) -> Engine:
    shape = ModelShape.from_model_config(executor.config)
    per_token = kv_bytes_per_token(shape, 2, "float32")
    # Two KV heads over two ranks: one head per rank, half the bytes per token.
    assert per_token == 2 * shape.num_layers * 1 * shape.head_dim * 4
    config = EngineConfig(
        block_size=4,
        kv_cache_memory=num_blocks * 4 * per_token,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        max_model_len=max_model_len,
        long_prefill_threshold=32,
    )
    return Engine(executor, None, config)


def _run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, GREEDY, request_id=str(i))
    tokens: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            tokens[int(out.request_id)].extend(out.new_token_ids)
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    return tokens


def test_tp2_concurrent_preempted_and_prefix_cached(
    tp2_executor: Any,
    hf_greedy: Callable[[list[int], int], list[int]],
    random_prompts: Callable[..., list[list[int]]],
) -> None:
    assert tp2_executor.tp_size == 2
    prompts = random_prompts(32, seed=10)
    roomy = _engine(tp2_executor, num_blocks=1024)
    assert _run(roomy, prompts) == [hf_greedy(p, MAX_NEW) for p in prompts]

    tight = _engine(tp2_executor, num_blocks=40, max_model_len=80)
    assert _run(tight, prompts) == [hf_greedy(p, MAX_NEW) for p in prompts]
    assert tight.stats().num_preemptions > 0

    prefix = list(range(100, 141))
    shared = [prefix + p[:5] for p in prompts[:8]]
    cached = _engine(tp2_executor, num_blocks=1024)
    assert _run(cached, shared[:1]) == [hf_greedy(shared[0], MAX_NEW)]
    assert _run(cached, shared[1:]) == [hf_greedy(p, MAX_NEW) for p in shared[1:]]
    assert cached.stats().prefix_hit_tokens == 7 * 40
