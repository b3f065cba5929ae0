"""Triton RMSNorm over the last dimension, rounding exactly like the model's PyTorch RMSNorm.

`rms_norm_ref` is the PyTorch reference (the formula of `inference_svc.model.layers.RMSNorm`):
normalize in float32, round to x's dtype, then scale by the weight in x's dtype.
On CPU this runs only under Triton's interpreter (TRITON_INTERPRET=1 set before import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    stride_x,  # row strides; the last dimension is contiguous
    stride_o,
    n_cols,
    eps,
    BLOCK: tl.constexpr,  # n_cols rounded up to a power of two: one row per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    # Round to x's dtype before the weight multiply, as the PyTorch module does. The product of
    # two 16-bit floats is exact in float32, so one rounding at the store matches torch's bf16 mul
    # (and the interpreter gets no bf16 arithmetic, which it computes wrongly).
    y = h.to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The PyTorch reference: x / rms(x) * weight over the last dimension."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., N) with weight (N,), both of one dtype; returns x's shape and dtype."""
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"x and weight must share a dtype among {_DTYPES}: {x.dtype}, {weight.dtype}"
        )
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device}, weight on {weight.device}")
    if x.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError("x and weight need a contiguous last dimension")
    if (x.device.type == "cpu") != INTERPRETED:
        raise ValueError(
            f"tensors on {x.device.type} but the kernel was built "
            f"{'for the interpreter' if INTERPRETED else 'compiled'}: use rms_norm_ref on CPU"
        )
    n = x.shape[-1]
    rows = x.reshape(-1, n)  # a view unless the leading dimensions are not collapsible
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or n == 0:
        return out.view(x.shape)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0],)](
        out,
        rows,
        weight,
        rows.stride(0),
        out.stride(0),
        n,
        eps,
        BLOCK=block,
        num_warps=max(1, min(16, block // 512)),
    )
    return out.view(x.shape)
