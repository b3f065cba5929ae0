"""The CUDA path: pinned staging in the loader, the Triton attention kernel, NCCL at TP=2."""

from __future__ import annotations

import pytest
import torch

from inference_svc.model.attention import AttentionMetadata
from inference_svc.model.executor import create_executor
from inference_svc.testing.models import ModelSpec, cached_model

from .conftest import PROMPTS, greedy, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SPEC = ModelSpec(family="qwen2", num_key_value_heads=1, vocab_size=515)


def prefill_logits(ex: object) -> torch.Tensor:
    ids = torch.cat([torch.tensor(p) for p in PROMPTS])
    positions = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    meta = AttentionMetadata.for_prefill([len(p) for p in PROMPTS], 4)
    ex.allocate_kv_cache(64, 4)  # type: ignore[attr-defined]
    return ex.execute(ids, positions, meta, torch.arange(len(ids))).cpu()  # type: ignore[attr-defined]


def test_cuda_fp32_equals_cpu() -> None:
    model_dir = cached_model(SPEC)
    cpu = create_executor(model_dir)
    gpu = create_executor(model_dir, device="cuda")
    try:
        assert gpu.load_reports[0].bytes_read == cpu.load_reports[0].bytes_read
        assert all(p.is_cuda for p in gpu._rank.model.parameters())
        assert rel_err(prefill_logits(gpu), prefill_logits(cpu)) < 1e-3  # TF32 matmuls allowed
        assert greedy(gpu, PROMPTS, 16) == greedy(cpu, PROMPTS, 16)
    finally:
        gpu.shutdown()
        cpu.shutdown()


def test_cuda_bf16_close_to_fp32() -> None:
    model_dir = cached_model(SPEC)
    ref = create_executor(model_dir)
    gpu = create_executor(model_dir, device="cuda", dtype=torch.bfloat16)
    try:
        assert rel_err(prefill_logits(gpu), prefill_logits(ref)) < 0.05
    finally:
        gpu.shutdown()
        ref.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_tp2_nccl_equals_tp1() -> None:
    model_dir = cached_model(SPEC)
    tp1 = create_executor(model_dir, device="cuda")
    tp2 = create_executor(model_dir, device="cuda", tensor_parallel_size=2)
    try:
        assert rel_err(prefill_logits(tp2), prefill_logits(tp1)) < 1e-3
    finally:
        tp2.shutdown()
        tp1.shutdown()
