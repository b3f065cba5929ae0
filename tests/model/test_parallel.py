"""Parallel layers' weight loaders: in place when possible, one padded copy otherwise, and
refusal of a parameter or shard id they do not own."""

from __future__ import annotations

import pytest
import torch

from inference_svc.model.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    TPGroup,
    materialize,
    padded_vocab_size,
)


def test_column_parallel_linear_uses_the_loaded_tensor_in_place() -> None:
    layer = ColumnParallelLinear(4, 3, bias=True, dtype=torch.float32)
    w, b = torch.randn(3, 4), torch.randn(3)
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    assert layer.weight.data_ptr() == w.data_ptr()
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), x @ w.T + b)


def test_materialize_casts_and_pads_with_zeros() -> None:
    param = torch.nn.Parameter(torch.empty(4, 2, dtype=torch.bfloat16, device="meta"))
    out = materialize(param, torch.ones(3, 2))
    assert out.dtype == torch.bfloat16 and out.tolist() == [[1, 1], [1, 1], [1, 1], [0, 0]]
    with pytest.raises(ValueError, match="does not fit"):
        materialize(param, torch.ones(3, 3))
    with pytest.raises(ValueError, match="5 rows"):
        materialize(param, torch.ones(5, 2))


def test_merged_layer_checks_the_shard_id() -> None:
    layer = MergedColumnParallelLinear(4, {"gate": 2, "up": 2}, bias=False, dtype=torch.float32)
    with pytest.raises(KeyError, match="'up'"):
        layer.weight_loader(layer.weight["gate"], torch.ones(2, 4), "up")
    layer.weight_loader(layer.weight["gate"], torch.ones(2, 4), "gate")
    layer.weight_loader(layer.weight["up"], 2 * torch.ones(2, 4), "up")
    gate, up = layer(torch.ones(1, 4))
    assert gate.tolist() == [[4.0, 4.0]] and up.tolist() == [[8.0, 8.0]]


def test_a_foreign_parameter_is_refused() -> None:
    layer = ColumnParallelLinear(4, 3, bias=False, dtype=torch.float32)
    other = ColumnParallelLinear(4, 3, bias=False, dtype=torch.float32)
    with pytest.raises(KeyError, match="does not own"):
        layer.weight_loader(other.weight, torch.ones(3, 4))


def test_lm_head_trims_padding_and_returns_float32() -> None:
    head = ParallelLMHead(5, 4, TPGroup(), torch.bfloat16)
    head.weight_loader(head.weight, torch.randn(5, 4).bfloat16())
    logits = head.logits(torch.randn(2, 4).bfloat16())
    assert logits is not None and logits.shape == (2, 5) and logits.dtype == torch.float32
    assert padded_vocab_size(5, 2) == 128 and padded_vocab_size(129, 2) == 256
