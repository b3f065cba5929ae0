"""The Triton RMSNorm against its PyTorch reference and the model's RMSNorm module.

On CPU it runs under Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels.rms_norm as triton_norm
from inference_svc.model.layers import RMSNorm

if not triton_norm.INTERPRETED and not torch.cuda.is_available():
    raise RuntimeError(
        "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1 and there is "
        "no CUDA device: set TRITON_INTERPRET=1 in the environment"
    )
DEVICE = "cpu" if triton_norm.INTERPRETED else "cuda"


def _inputs(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = 1 + 0.1 * torch.randn(shape[-1], generator=g)
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (3, 2, 96), (1, 1000), (7, 16)])
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, w = _inputs(shape, dtype)
    out = triton_norm.rms_norm(x, w, 1e-6)
    expected = triton_norm.rms_norm_ref(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    # Same math in float32 and the same two roundings, but a last-bit difference in the sum can
    # flip the first rounding: up to two ulps of x's dtype (bf16: 2**-7 relative each).
    atol, rtol = {
        torch.float32: (1e-5, 1e-5),
        torch.float16: (1e-3, 2e-3),
        torch.bfloat16: (1e-2, 2**-6),
    }[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def test_reference_is_the_models_rmsnorm() -> None:
    x, w = _inputs((4, 32), torch.bfloat16)
    module = RMSNorm(32, 1e-5, torch.bfloat16)
    module.weight = torch.nn.Parameter(w.cpu(), requires_grad=False)
    assert torch.equal(module(x.cpu()), triton_norm.rms_norm_ref(x.cpu(), w.cpu(), 1e-5))


def test_strided_rows_and_empty_input() -> None:
    x, w = _inputs((6, 128), torch.float32)
    view = x[::2, :64]  # row stride 256, contiguous columns
    torch.testing.assert_close(
        triton_norm.rms_norm(view, w[:64].contiguous(), 1e-6),
        triton_norm.rms_norm_ref(view, w[:64], 1e-6),
        atol=1e-5,
        rtol=1e-5,
    )
    assert triton_norm.rms_norm(x[:0], w, 1e-6).shape == (0, 128)


def test_kernel_compiles_for_hopper_without_a_device() -> None:
    # The interpreter is lax about what the compiler rejects; a fresh process, as the interpreter
    # patches triton.language in this one.
    script = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from kernels.rms_norm import _rms_norm_kernel as k\n"
        "sig = {'out_ptr': '*bf16', 'x_ptr': '*bf16', 'w_ptr': '*bf16', 'stride_x': 'i32',\n"
        "       'stride_o': 'i32', 'n_cols': 'i32', 'eps': 'fp32', 'BLOCK': 'constexpr'}\n"
        "src = ASTSource(k, sig, {'BLOCK': 8192})\n"
        "assert triton.compile(src, target=GPUTarget('cuda', 90, 32)).asm['cubin']\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(
    ("x", "w", "message"),
    [
        (torch.ones(4, 8), torch.ones(4), "does not match"),
        (torch.ones(4, 8), torch.ones(8, dtype=torch.float64), "share a dtype"),
        (torch.ones(4, 8, dtype=torch.int32), torch.ones(8, dtype=torch.int32), "share a dtype"),
        (torch.ones(8, 4).t(), torch.ones(8), "contiguous last dimension"),
    ],
)
def test_bad_inputs_raise_value_error(x: torch.Tensor, w: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        triton_norm.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(
    triton_norm.INTERPRETED or not torch.cuda.is_available(),
    reason="needs a CUDA device and the compiled (not interpreted) kernel",
)
@pytest.mark.parametrize("hidden", [2048, 4096, 5120, 8192])
def test_compiled_kernel_on_cuda_model_sizes(hidden: int) -> None:
    x, w = _inputs((300, hidden), torch.bfloat16)
    torch.testing.assert_close(
        triton_norm.rms_norm(x, w, 1e-5),
        triton_norm.rms_norm_ref(x, w, 1e-5),
        atol=1e-2,
        rtol=2**-6,
    )
