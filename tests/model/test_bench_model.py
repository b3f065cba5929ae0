"""The bench-size checkpoint (bf16, 16 layers) against transformers in bf16: slow."""

from __future__ import annotations

import pytest
import torch

from inference_svc.model.attention import AttentionMetadata
from inference_svc.model.executor import create_executor
from inference_svc.testing.models import ModelSpec, cached_model, load_reference

from .conftest import rel_err

pytestmark = pytest.mark.slow


def test_bench_model_bf16_close_to_transformers_and_zero_copy() -> None:
    model_dir = cached_model(ModelSpec(family="llama", size="bench"))
    ex = create_executor(model_dir)
    try:
        report = ex.load_reports[0]
        assert ex.dtype == torch.bfloat16
        assert report.bytes_in_place == report.bytes_read == report.checkpoint_bytes
        prompt = list(range(100, 164))
        ex.allocate_kv_cache(16, 16)
        meta = AttentionMetadata.for_prefill([len(prompt)], 16)
        ours = ex.execute(torch.tensor(prompt), torch.arange(64), meta, torch.arange(64))
    finally:
        ex.shutdown()
    ref = load_reference(model_dir, torch.bfloat16)
    with torch.inference_mode():
        want = ref(torch.tensor([prompt])).logits[0].float()
    assert rel_err(ours, want) < 0.03
    agree = (ours.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree > 0.9
