"""Engine fixtures: a tiny fp32 checkpoint, its transformers oracle, and shared executors."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from inference_svc.testing.models import ModelSpec, cached_model, load_reference

MAX_NEW = 8


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return cached_model(ModelSpec(family="llama", size="tiny", dtype="float32"))


@pytest.fixture(scope="session")
def hf_greedy(tiny_dir: Path) -> Callable[[list[int], int], list[int]]:
    """transformers' greedy continuation of one prompt alone, cut after the first EOS."""
    model = load_reference(tiny_dir, torch.float32)
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
        key = (tuple(prompt), max_new)
        if key not in cache:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new,
                    do_sample=False,
                    top_k=None,
                    top_p=None,
                    temperature=None,
                )
            new = out[0, len(prompt) :].tolist()
            for i, t in enumerate(new):
                if t in eos_ids:
                    new = new[: i + 1]
                    break
            cache[key] = new
        return cache[key]

    return run


@pytest.fixture(scope="session")
def executor(tiny_dir: Path) -> Iterator[Any]:
    from inference_svc.model.executor import create_executor

    ex = create_executor(tiny_dir, tensor_parallel_size=1, dtype=torch.float32)
    yield ex
    ex.shutdown()


@pytest.fixture(scope="session")
def tokenizer(tiny_dir: Path) -> Any:
    from inference_svc.loader.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="session")
def random_prompts() -> Callable[..., list[list[int]]]:
    def make(n: int, seed: int = 0, lo: int = 2, hi: int = 70) -> list[list[int]]:
        """Prompts of distinct lengths with ordinary token ids (not the 4 special ones)."""
        rng = random.Random(seed)
        lengths = rng.sample(range(lo, hi), n)
        return [[rng.randrange(4, 500) for _ in range(k)] for k in lengths]

    return make
