"""Memory planner: a pure function from model shape, dtypes, TP size and a budget to a KV-pool size.

This module is the one home of the KV-bytes-per-token formula; everything else calls it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bytes per element of each supported storage type. int4 packs two values per byte.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "int4": 0.5,
}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}

GIB = 1024**3
MIB = 1024**2


class PlanError(ValueError):
    """The inputs to the planner are invalid (bad size string, unknown dtype, missing config key)."""


class InsufficientMemoryError(RuntimeError):
    """One request of the maximum length cannot fit; `advised_max_model_len` is the largest that would."""

    def __init__(self, message: str, advised_max_model_len: int) -> None:
        super().__init__(message)
        self.advised_max_model_len = advised_max_model_len


def normalize_dtype(name: str) -> str:
    """Canonical dtype name ("bf16" -> "bfloat16"); raises PlanError for unknown names."""
    key = name.strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_BYTES)}")
    return key


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kmgtKMGT]?)(i?)[bB]?\s*$")


def parse_bytes(text: str) -> int:
    """Parse "80GB", "16GiB", "512MiB", "1e9" or "123456" into bytes (GB = 1e9, GiB = 2**30)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise PlanError(f"cannot parse memory size {text!r}; use e.g. 80GB, 16GiB, 512MiB or bytes")
    number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3)
    power = " KMGT".index(unit) if unit else 0
    base = 1024 if binary else 1000
    return int(number * base**power)


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder config the planner needs (Llama, Mistral, Qwen2, Qwen3)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v
    o_bias: bool = False  # Llama/Qwen3 `attention_bias` also biases o_proj
    qk_norm: bool = False  # Qwen3 normalises q and k per head

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise PlanError(f"config value {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise PlanError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelShape:
        """Read a Hugging Face `config.json` dict."""
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            model_type = str(cfg.get("model_type", ""))
            # As transformers: Llama/Qwen3 `attention_bias` covers q/k/v and o, Qwen2 always
            # biases q/k/v only, Mistral never.
            attention_bias = bool(cfg.get("attention_bias", False)) and model_type in (
                "llama",
                "qwen3",
            )
            return cls(
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=attention_bias,
                qk_norm=model_type == "qwen3",
            )
        except KeyError as exc:
            raise PlanError(f"config.json lacks required key {exc.args[0]!r}") from exc

    @classmethod
    def from_model_config(cls, cfg: Any) -> ModelShape:
        """From a parsed `inference_svc.model.config.ModelConfig` (same field names)."""
        return cls(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(cfg, "qkv_bias", False)),
            o_bias=bool(getattr(cfg, "o_bias", False)),
            qk_norm=bool(getattr(cfg, "qk_norm", False)),
        )

    @classmethod
    def from_config_file(cls, path: Path) -> ModelShape:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise PlanError(f"config file not found: {path}") from exc
        except json.JSONDecodeError as exc:
            raise PlanError(f"config file {path} is not valid JSON: {exc}") from exc
        if not isinstance(cfg, dict):
            raise PlanError(f"config file {path} must hold a JSON object")
        # Multimodal wrappers keep the decoder under text_config.
        return cls.from_hf_config(cfg.get("text_config", cfg))

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads each rank stores: split across ranks, replicated when TP exceeds their count."""
        return max(1, self.num_kv_heads // tp_size)

    def num_parameters(self) -> int:
        """Total parameter count of the unsharded model."""
        return self.weight_elements_per_rank(1)

    def weight_elements_per_rank(self, tp_size: int) -> int:
        """Parameters one rank holds: parallel linears split, KV heads replicated, norms replicated."""
        h, d, tp = self.hidden_size, self.head_dim, tp_size
        q_heads = math.ceil(self.num_heads / tp)
        kv_heads = self.kv_heads_per_rank(tp)
        inter = math.ceil(self.intermediate_size / tp)
        vocab = math.ceil(self.vocab_size / tp)
        attn = h * q_heads * d + 2 * h * kv_heads * d + q_heads * d * h
        if self.qkv_bias:
            attn += q_heads * d + 2 * kv_heads * d
        if self.o_bias:
            attn += h  # replicated: every rank adds it once, after the all-reduce
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * h * inter
        per_layer = attn + mlp + 2 * h  # two RMSNorms
        embeddings = vocab * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h  # + final norm


def kv_bytes_per_token(shape: ModelShape, tp_size: int, kv_dtype: str) -> int:
    """KV bytes per token on one rank = 2 × layers × kv_heads_per_rank × head_dim × bytes/element."""
    per_elem = DTYPE_BYTES[normalize_dtype(kv_dtype)]
    return math.ceil(
        2 * shape.num_layers * shape.kv_heads_per_rank(tp_size) * shape.head_dim * per_elem
    )


def weight_bytes_per_rank(shape: ModelShape, tp_size: int, weight_dtype: str) -> int:
    """Estimated weight bytes on one rank when every parameter is stored in `weight_dtype`."""
    per_elem = DTYPE_BYTES[normalize_dtype(weight_dtype)]
    return math.ceil(shape.weight_elements_per_rank(tp_size) * per_elem)


def estimate_activation_bytes(
    shape: ModelShape, tp_size: int, dtype: str, max_num_tokens: int, max_num_seqs: int
) -> int:
    """Rough activation peak of one forward over `max_num_tokens` tokens when none can be measured.

    Live at once inside a layer: the residual and normed hidden states, q/k/v, the attention output
    and the gate/up/act MLP intermediates; plus float32 logits for every sequence.
    """
    per_elem = DTYPE_BYTES[normalize_dtype(dtype)]
    tp = tp_size
    per_token = (
        3 * shape.hidden_size
        + (math.ceil(shape.num_heads / tp) * 2 + 2 * shape.kv_heads_per_rank(tp)) * shape.head_dim
        + 3 * math.ceil(shape.intermediate_size / tp)
    )
    logits = max_num_seqs * shape.vocab_size * 4
    return math.ceil(max_num_tokens * per_token * per_elem) + logits


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan depends on; sizes are bytes per rank."""

    shape: ModelShape
    tp_size: int
    weight_dtype: str
    kv_dtype: str
    memory_budget_bytes: int
    activation_peak_bytes: int
    runtime_overhead_bytes: int
    max_model_len: int
    block_size: int = 16
    # Measured weight bytes (from the loaded executor) replace the estimate from the config.
    measured_weight_bytes: int | None = None
    # An explicit KV pool size replaces "budget minus the rest".
    kv_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise PlanError(f"tensor parallel size must be >= 1, got {self.tp_size}")
        if self.block_size < 1:
            raise PlanError(f"block size must be >= 1, got {self.block_size}")
        if self.max_model_len < 1:
            raise PlanError(f"max model length must be >= 1, got {self.max_model_len}")
        if self.max_model_len > self.shape.max_position_embeddings:
            raise PlanError(
                f"max model length {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.shape.max_position_embeddings}"
            )
        if self.shape.num_heads % self.tp_size:
            raise PlanError(
                f"num_attention_heads ({self.shape.num_heads}) is not divisible by "
                f"tensor parallel size {self.tp_size}"
            )
        for name in ("memory_budget_bytes", "activation_peak_bytes", "runtime_overhead_bytes"):
            if getattr(self, name) < 0:
                raise PlanError(f"{name} must be >= 0, got {getattr(self, name)}")
        normalize_dtype(self.weight_dtype)
        normalize_dtype(self.kv_dtype)


@dataclass(frozen=True)
class MemoryPlan:
    """The breakdown of one rank's memory; `num_blocks` is the KV pool the engine allocates."""

    budget_bytes: int
    weight_bytes: int
    activation_bytes: int
    overhead_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def kv_token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, length: int) -> int:
        return math.ceil(length / self.block_size)

    def max_sequences(self, length: int) -> int:
        """How many sequences of `length` tokens fit in the pool at once."""
        return self.num_blocks // self.blocks_for(length)

    def to_dict(self, lengths: tuple[int, ...] = ()) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "weight_bytes_per_rank": self.weight_bytes,
            "activation_bytes": self.activation_bytes,
            "overhead_bytes": self.overhead_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "kv_pool_bytes": self.kv_pool_bytes,
            "kv_token_capacity": self.kv_token_capacity,
            "max_model_len": self.max_model_len,
            "max_sequences": {str(n): self.max_sequences(n) for n in lengths},
        }


def plan_memory(inputs: PlanInputs) -> MemoryPlan:
    """Size the KV pool; raise InsufficientMemoryError if one max-length request cannot fit."""
    per_token = kv_bytes_per_token(inputs.shape, inputs.tp_size, inputs.kv_dtype)
    block_bytes = per_token * inputs.block_size
    weights = (
        inputs.measured_weight_bytes
        if inputs.measured_weight_bytes is not None
        else weight_bytes_per_rank(inputs.shape, inputs.tp_size, inputs.weight_dtype)
    )
    if inputs.kv_cache_bytes is not None:
        pool = inputs.kv_cache_bytes
    else:
        pool = (
            inputs.memory_budget_bytes
            - weights
            - inputs.activation_peak_bytes
            - inputs.runtime_overhead_bytes
        )
    num_blocks = max(0, pool // block_bytes)
    plan = MemoryPlan(
        budget_bytes=inputs.memory_budget_bytes,
        weight_bytes=weights,
        activation_bytes=inputs.activation_peak_bytes,
        overhead_bytes=inputs.runtime_overhead_bytes,
        kv_bytes_per_token=per_token,
        block_size=inputs.block_size,
        num_blocks=num_blocks,
        max_model_len=inputs.max_model_len,
    )
    needed = plan.blocks_for(inputs.max_model_len)
    if num_blocks < needed:
        advised = num_blocks * inputs.block_size
        lack = needed * block_bytes - pool
        hint = (
            f"the largest length that fits is {advised} tokens (set max_model_len={advised})"
            if advised > 0
            else "no KV cache fits at all: raise the memory budget, lower the activation peak "
            "(fewer batched tokens) or use more tensor-parallel ranks"
        )
        source = (
            f"the KV cache memory of {inputs.kv_cache_bytes} bytes"
            if inputs.kv_cache_bytes is not None
            else f"budget {inputs.memory_budget_bytes} - weights {weights} - activations "
            f"{inputs.activation_peak_bytes} - overhead {inputs.runtime_overhead_bytes}"
        )
        raise InsufficientMemoryError(
            f"one request of max_model_len={inputs.max_model_len} tokens needs {needed} KV blocks "
            f"({needed * block_bytes} bytes) but only {num_blocks} fit ({source}); "
            f"{lack} more bytes are needed; {hint}",
            advised_max_model_len=advised,
        )
    return plan


def cpu_memory_budget(fraction_of_ram: float = 0.8) -> int:
    """CPU budget when none is given: the cgroup memory limit, else a fraction of physical RAM."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        # cgroup v1 reports "no limit" as a huge page-aligned number; v2 as "max".
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(ram * fraction_of_ram)
