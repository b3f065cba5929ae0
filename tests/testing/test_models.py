"""The checkpoint factory: reload equality with transformers, shards, tokenizer, determinism, cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from inference_svc.testing import FAMILIES, ModelSpec, build_model, cached_model, load_reference
from inference_svc.testing import models as factory
from inference_svc.testing.models import INDEX_NAME, make_model

PROMPTS = (
    [0, 2, 300, 17, 99, 3],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 200, 511],
)


def _weight_names(model_dir: Path) -> dict[str, str]:
    """Every tensor name in the shard files, mapped to its file."""
    names: dict[str, str] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert key not in names, f"{key} in two shards"
                names[key] = shard.name
    return names


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {fam: make_model(ModelSpec(family=fam), root / fam) for fam in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_reload_gives_identical_logits(family: str, tiny_dirs: dict[str, Path]) -> None:
    in_memory, _ = build_model(ModelSpec(family=family))
    reloaded = load_reference(tiny_dirs[family])
    assert type(reloaded).__name__ == factory._ARCHITECTURES[family]
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = in_memory(ids).logits
            got = reloaded(ids).logits
        assert got.shape == (1, len(prompt), 512)
        assert torch.equal(got, expected)
        # Not a degenerate model: positions and prompts give different distributions.
        assert not torch.equal(got[0, 0], got[0, -1])


@pytest.mark.parametrize("family", FAMILIES)
def test_shards_and_index_agree(family: str, tiny_dirs: dict[str, Path]) -> None:
    model_dir = tiny_dirs[family]
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((model_dir / INDEX_NAME).read_text())
    on_disk = _weight_names(model_dir)
    assert index["weight_map"] == on_disk
    total = 0
    for shard in shards:
        with safe_open(str(model_dir / shard), framework="pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118
    assert index["metadata"]["total_size"] == total
    assert "lm_head.weight" in on_disk
    assert not list(model_dir.glob("*.bin")) and not list(model_dir.glob("*.pt"))


def test_family_specific_weights(tiny_dirs: dict[str, Path]) -> None:
    qwen2 = _weight_names(tiny_dirs["qwen2"])
    qwen3 = _weight_names(tiny_dirs["qwen3"])
    llama = _weight_names(tiny_dirs["llama"])
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.1.self_attn.{proj}.bias" in qwen2
    assert "model.layers.1.self_attn.o_proj.bias" not in qwen2
    assert "model.layers.0.self_attn.q_norm.weight" in qwen3
    assert "model.layers.0.self_attn.k_norm.weight" in qwen3
    assert not any("bias" in k or "q_norm" in k for k in llama)
    # GQA: 2 KV heads of 16 dims against 4 query heads.
    with safe_open(
        str(tiny_dirs["llama"] / llama["model.layers.0.self_attn.k_proj.weight"]), "pt"
    ) as f:
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [32, 64]


def test_biases_and_norms_are_not_trivial(tiny_dirs: dict[str, Path]) -> None:
    # A loader that dropped them must not still match the oracle.
    names = _weight_names(tiny_dirs["qwen3"]) | {}
    for name in ("model.layers.0.self_attn.q_norm.weight", "model.norm.weight"):
        with safe_open(str(tiny_dirs["qwen3"] / names[name]), "pt") as f:
            assert not torch.equal(f.get_tensor(name), torch.ones(16 if "q_norm" in name else 64))
    bias = "model.layers.0.self_attn.k_proj.bias"
    with safe_open(str(tiny_dirs["qwen2"] / _weight_names(tiny_dirs["qwen2"])[bias]), "pt") as f:
        assert f.get_tensor(bias).abs().sum() > 0


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec(family="qwen2", dtype="bfloat16", num_shards=2),
        ModelSpec(family="qwen3", head_dim=32),  # head_dim != hidden / heads, as in real Qwen3
        ModelSpec(family="llama", num_key_value_heads=1),  # multi-query
        ModelSpec(family="mistral", num_key_value_heads=4),  # no grouping
    ],
    ids=["bf16", "head_dim", "mqa", "mha"],
)
def test_variants_reload_identically(spec: ModelSpec, tmp_path: Path) -> None:
    model_dir = make_model(spec, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["dtype"] == spec.torch_dtype_name
    assert config["num_key_value_heads"] == spec.kv_heads
    dtype = getattr(torch, spec.torch_dtype_name)
    reloaded = load_reference(model_dir, dtype=dtype)
    in_memory, _ = build_model(spec)
    assert all(p.dtype == dtype for p in reloaded.parameters())
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, in_memory(ids).logits)


def test_build_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(ModelSpec())
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tied_embeddings_store_no_lm_head(family: str, tmp_path: Path) -> None:
    spec = ModelSpec(family=family, tie_word_embeddings=True, vocab_size=515, num_shards=2)
    model_dir = make_model(spec, tmp_path)
    names = _weight_names(model_dir)
    assert "lm_head.weight" not in names
    assert len({*names.values()}) == 2
    config = json.loads((model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 515
    reloaded = load_reference(model_dir)
    in_memory, _ = build_model(spec)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, in_memory(ids).logits)
    assert torch.equal(reloaded.lm_head.weight, reloaded.model.embed_tokens.weight)


def test_tokenizer_round_trip_and_chat_template(tiny_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    model_dir = tiny_dirs["llama"]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert len(tok) <= config["vocab_size"]
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == config["eos_token_id"] == gen["eos_token_id"]
    assert tok.bos_token_id == config["bos_token_id"] == gen["bos_token_id"]
    text = "The keeper wrote 12:58 in the log, ünïcode and emoji 🙂 too."
    ids = tok(text)["input_ids"]
    assert len(ids) < len(text.encode())  # BPE merged something
    assert tok.decode(ids) == text
    messages = [{"role": "user", "content": "Hello there"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|begin_of_text|><|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")
    chat_ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert chat_ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<|im_start|>")]


def test_same_spec_is_byte_identical(tmp_path: Path) -> None:
    spec = ModelSpec(family="qwen3", seed=7)
    a = make_model(spec, tmp_path / "a")
    b = make_model(spec, tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        digest_a = hashlib.sha256((a / name).read_bytes()).hexdigest()
        assert digest_a == hashlib.sha256((b / name).read_bytes()).hexdigest(), name
    other = make_model(ModelSpec(family="qwen3", seed=8), tmp_path / "c")
    shard = "model-00002-of-00003.safetensors"
    assert (other / shard).read_bytes() != (a / shard).read_bytes()


def test_tokenizer_training_is_deterministic() -> None:
    from inference_svc.testing import tokenizer

    # Bypass the per-process cache: two real training runs.
    first = tokenizer._trained_json.__wrapped__(512)
    assert first == tokenizer._trained_json.__wrapped__(512)
    assert json.loads(first)["model"]["merges"]


def test_cached_model_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ModelSpec(family="mistral", num_shards=2)
    first = cached_model(spec, tmp_path)
    assert first.parent == tmp_path and first.name == spec.cache_key()
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}

    def no_rebuild(*_: object) -> Path:
        raise AssertionError("cached_model rebuilt an existing checkpoint")

    monkeypatch.setattr(factory, "make_model", no_rebuild)
    assert cached_model(spec, tmp_path) == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamps
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [first.name]
    assert ModelSpec(family="mistral", num_shards=3).cache_key() != spec.cache_key()


def test_cached_model_replaces_a_dead_builders_temp_dir(tmp_path: Path) -> None:
    spec = ModelSpec(num_shards=1)
    stale = tmp_path / f".{spec.cache_key()}.abandoned"
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"half written")
    built = cached_model(spec, tmp_path)
    assert not stale.exists()
    # One shard: the unindexed single-file layout.
    assert [p.name for p in built.glob("*.safetensors")] == ["model.safetensors"]
    assert not (built / INDEX_NAME).exists()
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[0]])
        assert torch.equal(load_reference(built)(ids).logits, build_model(spec)[0](ids).logits)


def test_cache_root_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(factory.CACHE_ENV, str(tmp_path / "env-cache"))
    assert factory.default_cache_root() == tmp_path / "env-cache"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"family": "gpt2"}, "unknown family"),
        ({"size": "huge"}, "unknown size"),
        ({"dtype": "float16"}, "unknown dtype"),
        ({"num_key_value_heads": 3}, "must divide"),
        ({"num_shards": 0}, "num_shards"),
    ],
)
def test_invalid_specs_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelSpec(**kwargs)  # type: ignore[arg-type]


def test_vocab_smaller_than_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_model(ModelSpec(vocab_size=100), tmp_path)


def test_llama3_rope_scaling_round_trips(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    spec = ModelSpec(rope_scaling=rope, max_position_embeddings=1024)
    model_dir = make_model(spec, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_scaling"] == rope and config["rope_theta"] == 10_000.0
    assert config["max_position_embeddings"] == 1024
    ids = torch.tensor([list(range(4, 200))])
    in_memory, _ = build_model(spec)
    plain, _ = build_model(ModelSpec(max_position_embeddings=1024))
    with torch.no_grad():
        scaled_logits = load_reference(model_dir)(ids).logits
        assert torch.equal(scaled_logits, in_memory(ids).logits)
        # Same weights, different rope: the scaling is really applied.
        assert not torch.allclose(scaled_logits, plain(ids).logits)


@pytest.mark.slow
def test_bench_model_builds_and_loads() -> None:
    model_dir = cached_model(ModelSpec(family="llama", size="bench"))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["hidden_size"] == 768
    index = json.loads((model_dir / INDEX_NAME).read_text())
    assert 200e6 < index["metadata"]["total_size"] < 300e6
    model = load_reference(model_dir, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    assert 100e6 < n_params < 150e6
