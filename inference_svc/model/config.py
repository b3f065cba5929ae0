"""`ModelConfig`: the parts of a Hugging Face `config.json` the decoder needs, validated once.

Anything the decoder does not implement (an architecture, a rope type, an activation) is refused
by name here, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# architecture -> family. Biases follow transformers: Llama and Qwen3 put `attention_bias` on
# q/k/v and o; Qwen2 always biases q/k/v and never o; Mistral has none. Qwen3 norms q and k.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelConfigError(ValueError):
    """config.json is missing, malformed, or asks for something this decoder does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    dtype: torch.dtype
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_position_embeddings"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelConfigError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check_tp(self, tp_size: int) -> None:
        """Refuse a TP size the head layout cannot be split into."""
        if tp_size < 1:
            raise ModelConfigError(f"tensor_parallel_size must be >= 1, got {tp_size}")
        if self.num_heads % tp_size != 0:
            raise ModelConfigError(
                f"{self.num_heads} attention heads do not split over TP={tp_size}"
            )
        if self.intermediate_size % tp_size != 0:
            raise ModelConfigError(
                f"intermediate_size {self.intermediate_size} does not split over TP={tp_size}"
            )
        kv, tp = self.num_kv_heads, tp_size
        if (kv >= tp and kv % tp != 0) or (kv < tp and tp % kv != 0):
            raise ModelConfigError(
                f"{kv} KV heads can be neither split nor replicated over TP={tp}"
            )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ModelConfigError(f"{path}: no config.json in the model directory") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path}: top level is not an object")
        gen_eos: Any = None
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.exists():
            try:
                gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                raise ModelConfigError(f"{gen_path}: not a valid JSON object ({e})") from e
        try:
            return cls.from_dict(raw, extra_eos=gen_eos)
        except ModelConfigError as e:
            raise ModelConfigError(f"{path}: {e}") from e

    @classmethod
    def from_dict(cls, raw: dict[str, Any], extra_eos: Any = None) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or len(archs) != 1:
            raise ModelConfigError(f"expected exactly one entry in 'architectures', got {archs!r}")
        arch = archs[0]
        if not isinstance(arch, str) or arch not in ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        family = ARCHITECTURES[arch]
        attention_bias = bool(raw.get("attention_bias", False)) and family in ("llama", "qwen3")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU)")
        if raw.get("mlp_bias"):
            raise ModelConfigError("unsupported option mlp_bias=true")
        if raw.get("use_sliding_window"):
            raise ModelConfigError("unsupported option use_sliding_window=true")
        if raw.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelConfigError("unsupported option partial_rotary_factor != 1")
        layer_types = raw.get("layer_types") or []
        if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
            raise ModelConfigError(f"unsupported layer_types {layer_types!r}")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            head_dim = raw.get("head_dim") or hidden // heads
            max_pos = int(raw.get("max_position_embeddings", 2048))
            window = raw.get("sliding_window") if family == "mistral" else None
            if window is not None:
                # Without sliding-window attention, serve only the context that window covers.
                max_pos = min(max_pos, int(window))
            return cls(
                architecture=arch,
                family=family,
                num_layers=int(raw["num_hidden_layers"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                vocab_size=int(raw["vocab_size"]),
                max_position_embeddings=max_pos,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_parse_rope(raw),
                dtype=_parse_dtype(raw),
                qkv_bias=family == "qwen2" or attention_bias,
                o_bias=attention_bias,
                qk_norm=family == "qwen3",
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                eos_token_ids=_eos_ids(raw.get("eos_token_id"), extra_eos),
                bos_token_id=raw.get("bos_token_id"),
                sliding_window=None if window is None else int(window),
            )
        except KeyError as e:
            raise ModelConfigError(f"missing required key {e.args[0]!r}") from e
        except (TypeError, ValueError, ZeroDivisionError) as e:
            if isinstance(e, ModelConfigError):
                raise
            raise ModelConfigError(f"bad value: {e}") from e


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; 4.x wrote `rope_theta` + `rope_scaling`.
    params: dict[str, Any] = dict(raw.get("rope_parameters") or {})
    params.update(raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"unsupported rope type {rope_type!r}; supported: {ROPE_TYPES}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _parse_dtype(raw: dict[str, Any]) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ModelConfigError(f"unsupported dtype {name!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for v in values:
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def parse_dtype_name(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16, refusing anything else by name."""
    if name not in _DTYPES:
        raise ModelConfigError(f"unsupported dtype {name!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]
