"""Kernel tests: run Triton's interpreter on CPU unless a CUDA device is present.

The interpreter is chosen when a kernel is decorated, so the variable is set here, before any test
module imports `kernels.paged_attention`. The PyTorch reference does not use Triton at all.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
