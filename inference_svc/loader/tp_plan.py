"""The tensor-parallel plan: for a checkpoint tensor and a rank, the slice to read and where it goes.

A pure function of (name, shape, config, tp_size, rank), so it can be tested exhaustively.
Column-parallel (q, k, v, gate, up) slices rows: a contiguous byte range. Row-parallel (o, down)
slices columns: a strided piece of every row. Embedding and lm_head split padded vocabulary rows.
KV heads are replicated when TP exceeds their count.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from inference_svc.model.config import ModelConfig
from inference_svc.model.parallel import padded_vocab_size


class TensorPlanError(ValueError):
    """A checkpoint tensor the model does not know, or one of the wrong shape."""


class Split(enum.Enum):
    REPLICATE = "replicate"
    COLUMN = "column"  # output rows split: dim 0
    ROW = "row"  # input columns split: dim 1
    VOCAB = "vocab"  # rows split over the padded vocabulary; the last ranks may get fewer


@dataclass(frozen=True)
class TensorPlan:
    name: str  # checkpoint tensor
    shape: tuple[int, ...]  # its full shape in the checkpoint
    module: str  # module owning the destination (its weight_loader installs it)
    param: str  # destination parameter, e.g. model.layers.0.self_attn.qkv_proj.weight.q
    shard_id: str | None
    split: Split
    start: int = 0  # range read along the split dim (dim 0 for COLUMN/VOCAB, dim 1 for ROW)
    stop: int = 0

    @property
    def dim(self) -> int | None:
        if self.split is Split.REPLICATE:
            return None
        return 1 if self.split is Split.ROW else 0

    @property
    def index(self) -> tuple[slice, ...]:
        """Index into the full tensor selecting this rank's part."""
        if self.dim is None:
            return ()
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)

    @property
    def slice_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        s = list(self.shape)
        s[self.dim] = self.stop - self.start
        return tuple(s)

    def nbytes(self, itemsize: int) -> int:
        return math.prod(self.slice_shape) * itemsize


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# checkpoint suffix -> (module suffix, parameter suffix, shard id)
_LAYER_TENSORS: dict[str, tuple[str, str, str | None]] = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj", "weight.q", "q"),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj", "weight.k", "k"),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj", "weight.v", "v"),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj", "bias.q", "q"),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj", "bias.k", "k"),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj", "bias.v", "v"),
    "self_attn.o_proj.weight": ("self_attn.o_proj", "weight", None),
    "self_attn.o_proj.bias": ("self_attn.o_proj", "bias", None),
    "self_attn.q_norm.weight": ("self_attn.q_norm", "weight", None),
    "self_attn.k_norm.weight": ("self_attn.k_norm", "weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj", "weight.gate", "gate"),
    "mlp.up_proj.weight": ("mlp.gate_up_proj", "weight.up", "up"),
    "mlp.down_proj.weight": ("mlp.down_proj", "weight", None),
    "input_layernorm.weight": ("input_layernorm", "weight", None),
    "post_attention_layernorm.weight": ("post_attention_layernorm", "weight", None),
}
# Buffers some exporters write; they are recomputed, not loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_name(param: str) -> str:
    """The checkpoint tensor a model parameter is loaded from (for messages)."""
    m = _LAYER.fullmatch(param)
    if m is not None:
        for suffix, (module_suffix, param_suffix, _) in _LAYER_TENSORS.items():
            if m.group(2) == f"{module_suffix}.{param_suffix}":
                return f"model.layers.{m.group(1)}.{suffix}"
    return param


def expected_shape(suffix: str, cfg: ModelConfig) -> tuple[int, ...] | None:
    """Full checkpoint shape of a per-layer tensor, or None if this config has no such tensor."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (cfg.q_size, h),
        "self_attn.k_proj.weight": (cfg.kv_size, h),
        "self_attn.v_proj.weight": (cfg.kv_size, h),
        "self_attn.o_proj.weight": (h, cfg.q_size),
        "mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "mlp.up_proj.weight": (cfg.intermediate_size, h),
        "mlp.down_proj.weight": (h, cfg.intermediate_size),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if cfg.qkv_bias:
        shapes.update(
            {
                "self_attn.q_proj.bias": (cfg.q_size,),
                "self_attn.k_proj.bias": (cfg.kv_size,),
                "self_attn.v_proj.bias": (cfg.kv_size,),
            }
        )
    if cfg.o_bias:
        shapes["self_attn.o_proj.bias"] = (h,)  # added once after the all-reduce: replicated
    if cfg.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    return shapes.get(suffix)


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """KV heads [lo, hi) this rank holds: split when there are enough, else one replicated head."""
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return rank * per, (rank + 1) * per
    head = rank * num_kv_heads // tp_size
    return head, head + 1


def plan_tensor(
    name: str, shape: tuple[int, ...], cfg: ModelConfig, tp_size: int, rank: int
) -> TensorPlan | None:
    """This rank's plan for one checkpoint tensor; None for tensors that are not loaded."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside TP={tp_size}")
    if name.endswith(IGNORED_SUFFIXES):
        return None
    shape = tuple(shape)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None  # tied: the output projection shares the embedding's rows
        _check_shape(name, shape, (cfg.vocab_size, cfg.hidden_size))
        rows = padded_vocab_size(cfg.vocab_size, tp_size) // tp_size
        start = min(rank * rows, cfg.vocab_size)
        stop = min((rank + 1) * rows, cfg.vocab_size)
        module = name.rsplit(".", 1)[0]
        return TensorPlan(name, shape, module, name, None, Split.VOCAB, start, stop)
    if name == "model.norm.weight":
        _check_shape(name, shape, (cfg.hidden_size,))
        return TensorPlan(name, shape, "model.norm", name, None, Split.REPLICATE)
    m = _LAYER.fullmatch(name)
    if m is None or int(m.group(1)) >= cfg.num_layers or m.group(2) not in _LAYER_TENSORS:
        raise TensorPlanError(f"tensor {name!r} is not part of a {cfg.architecture}")
    layer, suffix = int(m.group(1)), m.group(2)
    want = expected_shape(suffix, cfg)
    if want is None:
        raise TensorPlanError(f"tensor {name!r} is not used by this {cfg.architecture} config")
    _check_shape(name, shape, want)
    module_suffix, param_suffix, shard_id = _LAYER_TENSORS[suffix]
    prefix = f"model.layers.{layer}."
    module, param = prefix + module_suffix, f"{prefix}{module_suffix}.{param_suffix}"
    d = cfg.head_dim
    if shard_id == "q":
        per = cfg.q_size // tp_size
        return TensorPlan(
            name, shape, module, param, "q", Split.COLUMN, rank * per, (rank + 1) * per
        )
    if shard_id in ("k", "v"):
        lo, hi = kv_head_range(cfg.num_kv_heads, tp_size, rank)
        return TensorPlan(name, shape, module, param, shard_id, Split.COLUMN, lo * d, hi * d)
    if shard_id in ("gate", "up"):
        per = cfg.intermediate_size // tp_size
        return TensorPlan(
            name, shape, module, param, shard_id, Split.COLUMN, rank * per, (rank + 1) * per
        )
    if suffix == "self_attn.o_proj.weight":
        per = cfg.q_size // tp_size
        return TensorPlan(name, shape, module, param, None, Split.ROW, rank * per, (rank + 1) * per)
    if suffix == "mlp.down_proj.weight":
        per = cfg.intermediate_size // tp_size
        return TensorPlan(name, shape, module, param, None, Split.ROW, rank * per, (rank + 1) * per)
    return TensorPlan(name, shape, module, param, None, Split.REPLICATE)


def _check_shape(name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    if shape != want:
        raise TensorPlanError(
            f"tensor {name!r} has shape {list(shape)}, the config implies {list(want)}"
        )
