"""Tokenizer, chat template and generation defaults against transformers on the same files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from inference_svc.loader.tokenizer import TokenizerError, load_tokenizer
from inference_svc.testing.models import ModelSpec, cached_model

TEXTS = ["hello world", "  leading spaces and ünïcödé ✓", "", "a\nb\tc", "<|im_end|> inside"]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "and again"},
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_model(ModelSpec(family="qwen3"))


def test_encode_decode_and_template_match_transformers(model_dir: Path) -> None:
    ours = load_tokenizer(model_dir)
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                )
    for gen in (True, False):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == (
            hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        )


def test_special_tokens_and_generation_defaults(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] in tok.eos_token_ids
    assert tok.backend.token_to_id("<|im_end|>") in tok.eos_token_ids
    assert tok.bos_token_id == gen["bos_token_id"]
    assert tok.generation.temperature == gen["temperature"]
    assert tok.generation.top_p == gen["top_p"] and tok.generation.top_k == gen["top_k"]
    assert tok.generation.max_new_tokens == gen["max_new_tokens"]
    assert tok.vocab_size == json.loads((model_dir / "config.json").read_text())["vocab_size"]


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(
    model_dir: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["vocab_size"] = 100
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="model's vocabulary has 100 rows"):
        load_tokenizer(copy)
    with pytest.raises(TokenizerError, match="has 10 rows"):
        load_tokenizer(model_dir, model_vocab_size=10)


def test_missing_or_broken_files(model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if %}"
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="chat template does not compile"):
        load_tokenizer(copy)
    cfg["chat_template"] = "{{ raise_exception('no system role') }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="no system role"):
        load_tokenizer(copy).apply_chat_template(MESSAGES)
    (copy / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="cannot be loaded"):
        load_tokenizer(copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        load_tokenizer(copy)
