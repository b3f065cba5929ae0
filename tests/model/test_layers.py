"""RoPE inverse frequencies against transformers' own initialisers, and RMSNorm."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from inference_svc.model.config import ModelConfig
from inference_svc.model.layers import RMSNorm, rope_inv_freq
from inference_svc.model.parallel import materialize

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_inv_freq_matches_transformers(scaling: dict[str, object] | None) -> None:
    params = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    hf_cfg = LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=1024, rope_parameters=params
    )
    rope_type = str(params["rope_type"])
    if rope_type == "default":  # transformers computes it inline, not through the table
        hf_inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 32, 2, dtype=torch.int64).float() / 32))
        scale = 1.0
    else:
        hf_inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10,
        "rope_parameters": params,
    })  # fmt: skip
    assert scale == 1.0
    torch.testing.assert_close(rope_inv_freq(cfg.rope, 32), hf_inv_freq.float())


def test_rms_norm_matches_the_formula() -> None:
    norm = RMSNorm(8, 1e-6, torch.float32)
    norm._parameters["weight"] = materialize(norm.weight, torch.linspace(0.5, 1.5, 8))
    x = torch.randn(3, 8)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.linspace(0.5, 1.5, 8)
    torch.testing.assert_close(norm(x), want)
