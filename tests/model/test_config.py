"""config.json parsing: each family, both rope layouts, and refusals by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from inference_svc.model.config import ModelConfig, ModelConfigError
from inference_svc.testing.models import ModelSpec, cached_model

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_fixture_configs_parse(family: str) -> None:
    model_dir = cached_model(ModelSpec(family=family))
    cfg = ModelConfig.from_dir(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    assert cfg.family == family and cfg.architecture == raw["architectures"][0]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (2, 64, 4, 2)
    assert cfg.head_dim == 16 and cfg.vocab_size == raw["vocab_size"]
    assert cfg.dtype == torch.float32
    assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    assert cfg.rope.theta == raw["rope_theta"]
    assert raw["eos_token_id"] in cfg.eos_token_ids


def test_both_rope_layouts_give_the_same_llama3_config() -> None:
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}  # fmt: skip
    old = ModelConfig.from_dict(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **llama3}}
    )
    new = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **llama3}}
    )
    assert old.rope == new.rope and old.rope.rope_type == "llama3" and old.rope.factor == 8.0
    legacy = ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.rope.rope_type == "linear"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
        ({"architectures": []}, "exactly one"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"dtype": "float64"}, "unsupported dtype 'float64'"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"hidden_size": 0}, "hidden_size must be positive"),
        ({"vocab_size": "many"}, "bad value"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_attention_heads": 0}, "bad value"),  # head_dim = hidden // heads
        ({"architectures": [["LlamaForCausalLM"]]}, "unsupported architecture"),
        ({"layer_types": 3}, "unsupported layer_types"),
    ],
)
def test_unsupported_options_are_refused_by_name(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(")):
        ModelConfig.from_dict({**BASE, **change})


def test_missing_key_and_files(tmp_path: Path) -> None:
    raw = dict(BASE)
    del raw["vocab_size"]
    with pytest.raises(ModelConfigError, match="missing required key 'vocab_size'"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


def test_mistral_sliding_window_caps_the_context() -> None:
    cfg = ModelConfig.from_dict(
        {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 256,
         "max_position_embeddings": 4096}
    )  # fmt: skip
    assert cfg.max_position_embeddings == 256 and cfg.sliding_window == 256


def test_generation_config_eos_ids_are_merged(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 7)


@pytest.mark.parametrize(
    ("arch", "flag", "qkv", "o"),
    [
        ("LlamaForCausalLM", True, True, True),
        ("LlamaForCausalLM", False, False, False),
        ("Qwen3ForCausalLM", True, True, True),
        ("Qwen2ForCausalLM", False, True, False),
        ("Qwen2ForCausalLM", True, True, False),
        ("MistralForCausalLM", True, False, False),
    ],
)
def test_biases_follow_each_family(arch: str, flag: bool, qkv: bool, o: bool) -> None:
    cfg = ModelConfig.from_dict({**BASE, "architectures": [arch], "attention_bias": flag})
    assert (cfg.qkv_bias, cfg.o_bias) == (qkv, o)
