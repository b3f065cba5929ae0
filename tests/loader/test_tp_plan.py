"""The TP plan, checked exhaustively over head layouts and TP sizes: slices partition each
tensor, KV heads follow their query heads, vocabulary rows are all owned exactly once."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from inference_svc.loader.tp_plan import (
    Split,
    TensorPlan,
    TensorPlanError,
    checkpoint_name,
    expected_shape,
    kv_head_range,
    plan_tensor,
)
from inference_svc.model.config import ModelConfig, ModelConfigError, RopeConfig
from inference_svc.model.parallel import padded_vocab_size


def make_config(heads: int, kv: int, vocab: int, *, bias: bool = False, qk_norm: bool = False,
                tied: bool = False) -> ModelConfig:  # fmt: skip
    return ModelConfig(
        architecture="Qwen3ForCausalLM" if qk_norm else "Qwen2ForCausalLM",
        family="qwen3" if qk_norm else "qwen2",
        num_layers=2,
        hidden_size=heads * 4,
        intermediate_size=48,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=4,
        vocab_size=vocab,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        dtype=torch.float32,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=qk_norm,
        tie_word_embeddings=tied,
    )


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": (cfg.hidden_size,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    suffixes = [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.o_proj.bias", "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight",
    ]  # fmt: skip
    for layer in range(cfg.num_layers):
        for s in suffixes:
            shape = expected_shape(s, cfg)
            if shape is not None:
                shapes[f"model.layers.{layer}.{s}"] = shape
    return shapes


LAYOUTS = [(h, kv) for h in (1, 2, 4, 8, 16) for kv in (1, 2, 4, 8, 16) if kv <= h and h % kv == 0]
TP_SIZES = (1, 2, 4, 8)
VOCABS = (64, 100, 513)


def valid(cfg: ModelConfig, tp: int) -> bool:
    try:
        cfg.check_tp(tp)
    except ModelConfigError:
        return False
    return True


@pytest.mark.parametrize(("heads", "kv"), LAYOUTS)
def test_every_tensor_is_partitioned_or_replicated_exactly(heads: int, kv: int) -> None:
    for vocab, tp, flags in itertools.product(
        VOCABS, TP_SIZES, [(False, False, False), (True, True, True)]
    ):
        cfg = make_config(heads, kv, vocab, bias=flags[0], qk_norm=flags[1], tied=flags[2])
        if not valid(cfg, tp):
            continue
        for name, shape in checkpoint_shapes(cfg).items():
            plans = [plan_tensor(name, shape, cfg, tp, r) for r in range(tp)]
            assert all(p is not None for p in plans), name
            check_partition(cfg, tp, [p for p in plans if p is not None])


def check_partition(cfg: ModelConfig, tp: int, plans: list[TensorPlan]) -> None:
    first = plans[0]
    if first.split is Split.REPLICATE:
        assert all(p.slice_shape == p.shape and p.index == () for p in plans)
        return
    assert first.dim is not None
    extent = first.shape[first.dim]
    ranges = [(p.start, p.stop) for p in plans]
    if first.shard_id in ("k", "v") and cfg.num_kv_heads < tp:
        # Replicated: each rank holds one whole head; every head is held by tp/kv ranks.
        d = cfg.head_dim
        assert all(hi - lo == d and lo % d == 0 for lo, hi in ranges)
        heads = [lo // d for lo, _ in ranges]
        assert sorted(set(heads)) == list(range(cfg.num_kv_heads))
        assert all(heads.count(h) == tp // cfg.num_kv_heads for h in set(heads))
        return
    if first.split is Split.VOCAB:
        rows = padded_vocab_size(cfg.vocab_size, tp) // tp
        assert all(hi - lo <= rows for lo, hi in ranges)
        assert all(p.start == min(r * rows, extent) for r, p in enumerate(plans))
    # Consecutive, non-overlapping, equal (except vocabulary tails), covering [0, extent).
    assert ranges[0][0] == 0 and ranges[-1][1] == extent
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    if first.split is not Split.VOCAB:
        assert len({hi - lo for lo, hi in ranges}) == 1


@pytest.mark.parametrize(("heads", "kv"), LAYOUTS)
def test_each_rank_holds_the_kv_heads_its_query_heads_use(heads: int, kv: int) -> None:
    for tp in TP_SIZES:
        cfg = make_config(heads, kv, 64)
        if not valid(cfg, tp):
            continue
        q_per_rank = heads // tp
        for rank in range(tp):
            lo, hi = kv_head_range(kv, tp, rank)
            local_kv = hi - lo
            for j in range(q_per_rank):  # local query head j attends local kv head j // group
                global_q = rank * q_per_rank + j
                local_kv_head = j // (q_per_rank // local_kv)
                assert lo + local_kv_head == global_q // (heads // kv)


def test_row_parallel_slices_columns_and_column_parallel_rows() -> None:
    cfg = make_config(8, 2, 100)
    o = plan_tensor("model.layers.1.self_attn.o_proj.weight", (32, 32), cfg, 4, 3)
    assert o is not None and o.split is Split.ROW and o.index == (slice(None), slice(24, 32))
    assert o.module == "model.layers.1.self_attn.o_proj" and o.param.endswith("o_proj.weight")
    up = plan_tensor("model.layers.0.mlp.up_proj.weight", (48, 32), cfg, 4, 1)
    assert up is not None and up.split is Split.COLUMN and up.index == (slice(12, 24),)
    assert up.param == "model.layers.0.mlp.gate_up_proj.weight.up" and up.shard_id == "up"
    assert up.nbytes(2) == 12 * 32 * 2


def test_vocab_not_divisible_pads_and_last_rank_gets_the_tail() -> None:
    cfg = make_config(4, 2, 513)
    plans = [plan_tensor("lm_head.weight", (513, 16), cfg, 2, r) for r in range(2)]
    assert padded_vocab_size(513, 2) == 640
    assert [(p.start, p.stop) for p in plans if p] == [(0, 320), (320, 513)]
    assert padded_vocab_size(513, 1) == 513  # TP=1: used as is


def test_checkpoint_name_inverts_the_plan() -> None:
    cfg = make_config(4, 2, 64, bias=True, qk_norm=True)
    for name, shape in checkpoint_shapes(cfg).items():
        plan = plan_tensor(name, shape, cfg, 2, 1)
        assert plan is not None and checkpoint_name(plan.param) == name


def test_refuses_unknown_tensors_and_wrong_shapes() -> None:
    cfg = make_config(4, 2, 64)
    with pytest.raises(TensorPlanError, match="not part of"):
        plan_tensor("model.layers.0.self_attn.rotary.weight", (4,), cfg, 1, 0)
    with pytest.raises(TensorPlanError, match="not part of"):
        plan_tensor("model.layers.2.input_layernorm.weight", (16,), cfg, 1, 0)  # 2 layers
    with pytest.raises(TensorPlanError, match="shape"):
        plan_tensor("model.layers.0.mlp.up_proj.weight", (47, 16), cfg, 1, 0)
    llama = dataclasses.replace(cfg, qkv_bias=False)
    with pytest.raises(TensorPlanError, match="not used"):
        plan_tensor("model.layers.0.self_attn.q_proj.bias", (16,), llama, 1, 0)
    assert plan_tensor("model.layers.0.self_attn.rotary_emb.inv_freq", (2,), cfg, 1, 0) is None
    tied = dataclasses.replace(cfg, tie_word_embeddings=True)
    assert plan_tensor("lm_head.weight", (64, 16), tied, 1, 0) is None
    with pytest.raises(ValueError, match="rank"):
        plan_tensor("model.norm.weight", (16,), cfg, 2, 2)


def test_check_tp_refuses_layouts_that_cannot_split() -> None:
    with pytest.raises(ModelConfigError, match="attention heads"):
        make_config(4, 2, 64).check_tp(8)
    with pytest.raises(ModelConfigError, match="KV heads"):
        make_config(12, 3, 64).check_tp(2)
