"""Planner: hand-computed figures (MHA, GQA, TP, replicated KV heads) and the refusal message."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from inference_svc.engine import plan_cli
from inference_svc.engine.planner import (
    GIB,
    InsufficientMemoryError,
    ModelShape,
    PlanError,
    PlanInputs,
    kv_bytes_per_token,
    parse_bytes,
    plan_memory,
    weight_bytes_per_rank,
)

LLAMA2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
# Llama-3-8B: GQA with 8 KV heads.
LLAMA3_8B = {
    **LLAMA2_7B,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}


def test_7b_weights_match_the_seed_figures() -> None:
    shape = ModelShape.from_hf_config(LLAMA2_7B)
    assert shape.num_parameters() == 6_738_415_616  # Llama-2-7b's published count
    fp16 = weight_bytes_per_rank(shape, 1, "float16")
    assert fp16 == 13_476_831_232  # ≈ 14 GB
    assert weight_bytes_per_rank(shape, 1, "int8") == fp16 // 2  # ≈ 7 GB
    assert weight_bytes_per_rank(shape, 1, "int4") == fp16 // 4  # ≈ 3.5 GB


def test_kv_bytes_per_token_mha_gqa_and_tp() -> None:
    mha = ModelShape.from_hf_config(LLAMA2_7B)
    assert kv_bytes_per_token(mha, 1, "float16") == 2 * 32 * 32 * 128 * 2  # 512 KiB
    assert kv_bytes_per_token(mha, 2, "float16") == 2 * 32 * 16 * 128 * 2
    gqa = ModelShape.from_hf_config(LLAMA3_8B)
    assert kv_bytes_per_token(gqa, 1, "bfloat16") == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert kv_bytes_per_token(gqa, 4, "bfloat16") == 2 * 32 * 2 * 128 * 2
    # TP=16 > 8 KV heads: each rank keeps one replicated head.
    assert gqa.kv_heads_per_rank(16) == 1
    assert kv_bytes_per_token(gqa, 16, "bfloat16") == 2 * 32 * 1 * 128 * 2
    assert kv_bytes_per_token(gqa, 1, "float32") == 2 * 32 * 8 * 128 * 4


def test_tp_weight_split_by_hand() -> None:
    shape = ModelShape.from_hf_config(LLAMA3_8B)
    h, layers = 4096, 32
    # TP=2: q/o 16 heads, k/v 4 heads, MLP 7168, vocab 64128, norms replicated.
    per_layer = h * 16 * 128 * 2 + 2 * h * 4 * 128 + 3 * h * 7168 + 2 * h
    expected = layers * per_layer + 2 * 64128 * h + h
    assert shape.weight_elements_per_rank(2) == expected
    assert weight_bytes_per_rank(shape, 2, "bf16") == 2 * expected


def test_attention_bias_counts_q_k_v_and_o_by_hand() -> None:
    h, layers = 4096, 32
    biased = ModelShape.from_hf_config({**LLAMA2_7B, "attention_bias": True})
    assert biased.qkv_bias and biased.o_bias
    # q, k, v and o each add a bias of hidden_size per layer.
    assert biased.num_parameters() == 6_738_415_616 + layers * 4 * h
    # TP=2 on the GQA model: q bias 16 heads, k/v 4 heads each; o's bias is replicated whole.
    gqa = ModelShape.from_hf_config({**LLAMA3_8B, "attention_bias": True})
    plain = ModelShape.from_hf_config(LLAMA3_8B)
    extra = layers * (16 * 128 + 2 * 4 * 128 + h)
    assert gqa.weight_elements_per_rank(2) == plain.weight_elements_per_rank(2) + extra
    # Qwen2 biases q/k/v only; Mistral ignores attention_bias, as transformers does.
    qwen2 = ModelShape.from_hf_config({**LLAMA2_7B, "model_type": "qwen2"})
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)
    assert qwen2.num_parameters() == 6_738_415_616 + layers * 3 * h
    mistral = ModelShape.from_hf_config(
        {**LLAMA2_7B, "model_type": "mistral", "attention_bias": True}
    )
    assert mistral.num_parameters() == 6_738_415_616


@pytest.mark.parametrize(
    ("family", "attention_bias"),
    [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True), ("mistral", False)],
)
def test_parameter_count_matches_transformers(family: str, attention_bias: bool) -> None:
    """The count transformers gives for the same config, built on the meta device."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    kwargs = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        intermediate_size=96,
        vocab_size=300,
        tie_word_embeddings=False,
    )
    if family in ("llama", "qwen3"):
        kwargs["attention_bias"] = attention_bias
    config = config_cls(**kwargs)
    with torch.device("meta"):
        model = model_cls(config)
    shape = ModelShape.from_hf_config(config.to_dict())
    assert shape.num_parameters() == sum(p.numel() for p in model.parameters())


def _inputs(**kw: object) -> PlanInputs:
    base: dict[str, object] = dict(
        shape=ModelShape.from_hf_config(LLAMA2_7B),
        tp_size=1,
        weight_dtype="float16",
        kv_dtype="float16",
        memory_budget_bytes=24 * GIB,
        activation_peak_bytes=GIB,
        runtime_overhead_bytes=GIB,
        max_model_len=4096,
    )
    base.update(kw)
    return PlanInputs(**base)  # type: ignore[arg-type]


def test_plan_blocks_and_capacity() -> None:
    plan = plan_memory(_inputs())
    free = 24 * GIB - 13_476_831_232 - 2 * GIB
    block = 512 * 1024 * 16
    assert plan.num_blocks == free // block == 1209
    assert plan.kv_pool_bytes == 1209 * block
    assert plan.max_sequences(4096) == 1209 // 256 == 4
    assert plan.max_sequences(100) == 1209 // 7
    assert plan.to_dict((100,))["max_sequences"] == {"100": 172}


def test_refusal_names_the_largest_length_that_fits() -> None:
    with pytest.raises(InsufficientMemoryError) as err:
        plan_memory(_inputs(memory_budget_bytes=16 * GIB))
    free = 16 * GIB - 13_476_831_232 - 2 * GIB
    blocks = free // (512 * 1024 * 16)
    assert err.value.advised_max_model_len == blocks * 16 == 2960
    assert "max_model_len=2960" in str(err.value)


def test_measured_weights_and_explicit_kv_pool_override_estimates() -> None:
    plan = plan_memory(_inputs(measured_weight_bytes=GIB, kv_cache_bytes=8 * 2**20 * 300))
    assert plan.weight_bytes == GIB
    assert plan.num_blocks == 300


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GB", 80 * 10**9), ("16GiB", 16 * GIB), ("512MiB", 512 * 2**20), ("1e9", 10**9)],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_bad_input_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="cannot parse"):
        parse_bytes("lots")
    with pytest.raises(PlanError, match="unknown dtype"):
        _inputs(weight_dtype="fp7")
    with pytest.raises(PlanError, match="not divisible"):
        _inputs(tp_size=3)
    with pytest.raises(PlanError, match="lacks required key 'hidden_size'"):
        ModelShape.from_hf_config({"num_attention_heads": 2})


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    rc = plan_cli.run(parser.parse_args(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_from_config_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    argv = ["--config", str(tmp_path), "--tp", "2", "--memory", "80GB", "--dtype", "bf16"]
    rc, out, _ = _cli([*argv, "--activation", "1GiB", "--json", "--lengths", "1000"], capsys)
    assert rc == 0
    figures = json.loads(out)
    shape = ModelShape.from_hf_config(LLAMA3_8B)
    weights = weight_bytes_per_rank(shape, 2, "bfloat16")
    budget = int(80e9 * 0.9)
    per_token = 2 * 32 * 4 * 128 * 2
    assert figures["weight_bytes_per_rank"] == weights
    assert figures["kv_bytes_per_token"] == per_token
    assert figures["num_blocks"] == (budget - weights - 2 * GIB) // (16 * per_token)
    assert figures["max_sequences"]["1000"] == figures["num_blocks"] // 63
    rc, out, _ = _cli(argv, capsys)
    assert rc == 0 and "KV bytes per token  65536 B (bfloat16)" in out


def test_cli_refusal_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    rc, out, _ = _cli(["--config", str(tmp_path), "--memory", "16GB", "--json"], capsys)
    assert rc == 2
    assert json.loads(out)["advised_max_model_len"] == 0
    rc, _, err = _cli(["--config", str(tmp_path / "nope"), "--memory", "16GB"], capsys)
    assert rc == 1 and "config file not found" in err


def test_inference_svc_plan_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from inference_svc.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    rc = main(["plan", "--config", str(tmp_path / "config.json"), "--memory", "40GB", "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert figures["weight_bytes_per_rank"] == 13_476_831_232
    assert figures["kv_bytes_per_token"] == 524_288
    assert figures["num_parameters"] == 6_738_415_616


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("dtype", "bfloat16", "bfloat16"),
        ("torch_dtype", "float32", "float32"),
        (None, None, "float16"),
    ],
)
def test_cli_dtype_defaults_to_the_checkpoints(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    key: str | None,
    value: str | None,
    expected: str,
) -> None:
    config = {k: v for k, v in LLAMA2_7B.items() if k not in ("dtype", "torch_dtype")}
    if key is not None:
        config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, out, _ = _cli(["--config", str(tmp_path), "--memory", "80GB", "--json"], capsys)
    figures = json.loads(out)
    assert rc == 0 and figures["weight_dtype"] == expected
    shape = ModelShape.from_hf_config(config)
    assert figures["weight_bytes_per_rank"] == weight_bytes_per_rank(shape, 1, expected)


@pytest.mark.parametrize("lengths", ["abc", "0", "512,-1", "512,"])
def test_cli_bad_lengths_are_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lengths: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    argv = ["--config", str(tmp_path), "--memory", "80GB", "--lengths", lengths]
    rc, _, err = _cli(argv, capsys)
    assert rc == 1 and "--lengths must be comma-separated positive integers" in err
