"""Deterministic checkpoint factory: Llama-family models with random weights, made at test time.

Each checkpoint is a Hugging Face model directory: `config.json`, `generation_config.json`,
several safetensors shards with `model.safetensors.index.json`, and a tokenizer with a chat template.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference_svc.testing.tokenizer import (
    CORPUS_PATH,
    TokenizerInfo,
    tokenizer_info,
    write_tokenizer,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SIZES = ("tiny", "bench")
DTYPES = ("float32", "bfloat16")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CACHE_ENV = "LLM_FIXTURE_CACHE"
# Bump when the factory's output changes for an unchanged spec: it is part of the cache key.
FACTORY_VERSION = 2

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class _SizeShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    tokenizer_vocab: int  # BPE training target; the corpus caps the result
    dtype: str
    # Tiny models use a wide init so top-2 logit margins dwarf fp32 reordering error: greedy
    # decoding by another implementation then matches transformers token for token.
    initializer_range: float


_SHAPES = {
    "tiny": _SizeShape(64, 2, 4, 2, 128, 512, 512, "float32", 0.1),
    # ~122M parameters, ~245 MB in bf16.
    "bench": _SizeShape(768, 16, 12, 4, 2560, 2048, 32000, "bfloat16", 0.02),
}


@dataclass(frozen=True)
class ModelSpec:
    """What to build; equal specs give byte-identical checkpoints."""

    family: str = "llama"
    size: str = "tiny"
    dtype: str | None = None  # default by size: tiny float32, bench bfloat16
    seed: int = 0
    tie_word_embeddings: bool = False
    num_key_value_heads: int | None = None
    vocab_size: int | None = None  # >= the tokenizer's vocabulary; larger pads the embedding
    num_shards: int = 3  # 1: a single model.safetensors, no index
    max_position_embeddings: int | None = None
    rope_scaling: dict[str, Any] | None = None  # hub layout, e.g. {"rope_type": "llama3", ...}
    head_dim: int | None = None  # default hidden_size // num_attention_heads

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; expected one of {FAMILIES}")
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}; expected one of {SIZES}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {DTYPES}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        heads = self.shape.num_attention_heads
        kv = self.kv_heads
        if kv < 1 or heads % kv:
            raise ValueError(f"num_key_value_heads={kv} must divide num_attention_heads={heads}")
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ValueError("rope_scaling needs a 'rope_type' key")

    @property
    def shape(self) -> _SizeShape:
        return _SHAPES[self.size]

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.shape.num_key_value_heads

    @property
    def torch_dtype_name(self) -> str:
        return self.dtype or self.shape.dtype

    def cache_key(self) -> str:
        """Content key: the spec plus everything else that shapes the output bytes."""
        payload = {
            "spec": asdict(self),
            "factory": FACTORY_VERSION,
            "corpus": hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest(),
            "torch": metadata.version("torch"),
            "transformers": metadata.version("transformers"),
            "tokenizers": metadata.version("tokenizers"),
            "safetensors": metadata.version("safetensors"),
        }
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        return f"{self.family}-{self.size}-{digest[:16]}"


def _make_config(spec: ModelSpec, tok: TokenizerInfo) -> PretrainedConfig:
    import transformers

    shape = spec.shape
    vocab = spec.vocab_size if spec.vocab_size is not None else tok.vocab_size
    if vocab < tok.vocab_size:
        raise ValueError(f"vocab_size={vocab} is smaller than the tokenizer's {tok.vocab_size}")
    rope_theta = 1_000_000.0 if spec.family in ("qwen2", "qwen3") else 10_000.0
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if spec.rope_scaling is not None:
        rope_parameters = {**spec.rope_scaling, "rope_theta": rope_theta}
    kwargs: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim or shape.hidden_size // shape.num_attention_heads,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings or shape.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "initializer_range": shape.initializer_range,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "rope_parameters": rope_parameters,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "architectures": [_ARCHITECTURES[spec.family]],
        "dtype": spec.torch_dtype_name,
    }
    if spec.family == "mistral":
        kwargs["sliding_window"] = None
    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    return classes[spec.family](**kwargs)


def build_model(spec: ModelSpec) -> tuple[PreTrainedModel, TokenizerInfo]:
    """The in-memory model `make_model` saves (eval mode, CPU, the spec's dtype)."""
    import torch
    from transformers import AutoModelForCausalLM

    tok_info = tokenizer_info(spec.shape.tokenizer_vocab)
    config = _make_config(spec, tok_info)
    # fork_rng: seeding must not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        # Initialise in float32, then cast: bf16 values are the rounded fp32 ones.
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="eager"
        )
        _randomize_trivial_params(model, spec.shape.initializer_range)
    dtype = getattr(torch, spec.torch_dtype_name)
    # Parameters only: rotary inv_freq buffers stay float32, as from_pretrained keeps them.
    for param in model.parameters():
        param.data = param.data.to(dtype)
    model.eval()
    model.config.dtype = dtype  # from_config recorded the float32 it initialised in
    return model, tok_info


def _randomize_trivial_params(model: torch.nn.Module, std: float) -> None:
    """Give biases and norm scales random values: transformers initialises them to 0 and 1,
    so an implementation that skipped loading them would still match the oracle."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, std)
            elif "norm" in name.rsplit(".", 2)[-2]:
                param.uniform_(0.5, 1.5)


def make_model(spec: ModelSpec, out_dir: Path) -> Path:
    """Write the checkpoint for `spec` into `out_dir` (created if missing) and return it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, _ = build_model(spec)
    max_len = spec.max_position_embeddings or spec.shape.max_position_embeddings
    tok = write_tokenizer(spec.shape.tokenizer_vocab, out_dir, model_max_length=max_len)
    _write_config(model.config, out_dir / "config.json")
    _write_generation_config(tok, out_dir / "generation_config.json")
    save_sharded(model.state_dict(), out_dir, spec.num_shards, spec.tie_word_embeddings)
    return out_dir


def save_sharded(
    state_dict: dict[str, torch.Tensor], out_dir: Path, num_shards: int, tied: bool
) -> None:
    """Split tensors in state-dict order into `num_shards` files of similar size, plus the index.

    One shard is written as `model.safetensors` without an index, as `save_pretrained` does.
    """
    from safetensors.torch import save_file

    tensors = {
        name: t.detach().contiguous()
        for name, t in state_dict.items()
        # Tied checkpoints carry only the embedding, as transformers writes them.
        if not (tied and name == "lm_head.weight")
    }
    if num_shards == 1:
        save_file(tensors, str(out_dir / SINGLE_FILE), {"format": "pt"})
        return
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    total = sum(sizes.values())
    n = min(num_shards, len(tensors))
    groups: list[list[str]] = [[] for _ in range(n)]
    acc = 0
    for name in tensors:
        # Shard i takes tensors whose byte offset midpoint falls in its 1/n of the total.
        idx = min(n - 1, (acc + sizes[name] // 2) * n // max(total, 1))
        groups[idx].append(name)
        acc += sizes[name]
    groups = [g for g in groups if g]
    weight_map: dict[str, str] = {}
    for i, names in enumerate(groups):
        file_name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(out_dir / file_name), {"format": "pt"})
        weight_map.update(dict.fromkeys(names, file_name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out_dir / INDEX_NAME, index)


def _write_config(config: PretrainedConfig, path: Path) -> None:
    """config.json in the hub layout most published checkpoints use (`rope_theta`, `rope_scaling`)."""
    data = config.to_diff_dict()
    rope = dict(data.pop("rope_parameters", None) or {})
    data["rope_theta"] = rope.pop("rope_theta", 10_000.0)
    data["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    data.pop("transformers_version", None)  # keeps the bytes stable across library upgrades
    _write_json(path, data)


def _write_generation_config(tok: TokenizerInfo, path: Path) -> None:
    gen = {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "max_new_tokens": 64,
    }
    _write_json(path, gen)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def default_cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".cache" / "models"


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    # One builder per key across processes; the others wait and then reuse its result.
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_model(spec: ModelSpec, cache_root: Path | None = None) -> Path:
    """The checkpoint for `spec` under a content-keyed directory, built once and then reused.

    The directory appears only complete: it is built in a temporary sibling and renamed.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / spec.cache_key()
    if final.is_dir():
        return final
    with _locked(root / f".{final.name}.lock"):
        if final.is_dir():
            return final
        # Holding the lock, any temp dir of this key was left by a builder that died.
        for stale in root.glob(f".{final.name}.*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        try:
            make_model(spec, tmp)
            # mkdtemp makes the directory private; the cache is shared.
            for path in tmp.iterdir():
                path.chmod(0o644)
            tmp.chmod(0o755)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_reference(model_dir: Path, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The transformers model for a checkpoint directory: CPU, eval mode, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=dtype if dtype is not None else torch.float32,
        attn_implementation="eager",
    )
    return model.eval()
