"""Deterministic byte-level BPE tokenizer for test checkpoints, trained on the bundled corpus.

Writes the Hugging Face tokenizer files (`tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`) so that `transformers.AutoTokenizer.from_pretrained(dir)` loads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

BOS_TOKEN = "<|begin_of_text|>"
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Ids 0..3 in this order; EOS is the end of a chat turn so generation stops after one reply.
SPECIAL_TOKENS = (BOS_TOKEN, PAD_TOKEN, IM_START, IM_END)
EOS_TOKEN = IM_END

# ChatML; the BOS token is emitted by the template only (plain `encode` adds no special tokens).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerInfo:
    """Ids a checkpoint's config and generation config must agree with."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


def corpus_text() -> str:
    return CORPUS_PATH.read_text(encoding="utf-8")


@cache
def _trained_json(target_vocab: int) -> str:
    """Train once per process per size; the serialized form is what makes builds byte-identical."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=target_vocab,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on the corpus split into lines: the trainer sees a fixed, ordered iterator.
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    return tok.to_str(pretty=True)


def build_tokenizer(target_vocab: int) -> Tokenizer:
    """The trained tokenizer; its vocabulary is at most `target_vocab` (the corpus may run out)."""
    return Tokenizer.from_str(_trained_json(target_vocab))


def tokenizer_info(target_vocab: int) -> TokenizerInfo:
    tok = build_tokenizer(target_vocab)

    def tid(token: str) -> int:
        idx = tok.token_to_id(token)
        assert idx is not None, token
        return idx

    return TokenizerInfo(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        bos_token_id=tid(BOS_TOKEN),
        eos_token_id=tid(EOS_TOKEN),
        pad_token_id=tid(PAD_TOKEN),
    )


def write_tokenizer(target_vocab: int, out_dir: Path, model_max_length: int) -> TokenizerInfo:
    """Write the tokenizer files into `out_dir` and return the special token ids."""
    info = tokenizer_info(target_vocab)
    (out_dir / "tokenizer.json").write_text(_trained_json(target_vocab), encoding="utf-8")
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special_map)
    return info


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
