"""Tokenizer, chat template and generation defaults, from the same directory as the weights.

A tokenizer that can emit ids outside the model's vocabulary is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TokenizerError(ValueError):
    """The tokenizer files are missing, malformed, or do not fit the model."""


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json: what a request gets when it does not say."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GenerationDefaults:
        return cls(
            do_sample=bool(raw.get("do_sample", False)),
            temperature=float(raw.get("temperature", 1.0)),
            top_k=int(raw.get("top_k", 0) or 0),
            top_p=float(raw.get("top_p", 1.0)),
            repetition_penalty=float(raw.get("repetition_penalty", 1.0)),
            max_new_tokens=None
            if raw.get("max_new_tokens") is None
            else int(raw["max_new_tokens"]),
        )


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise TokenizerError(f"{path}: top level is not an object")
    return raw


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model directory's chat template and special tokens."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None,
        special_tokens: dict[str, str | None],
        eos_token_ids: tuple[int, ...],
        generation: GenerationDefaults,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.eos_token_ids = eos_token_ids
        self.generation = generation
        self.bos_token = special_tokens.get("bos_token")
        self.eos_token = special_tokens.get("eos_token")
        self.bos_token_id = None if self.bos_token is None else backend.token_to_id(self.bos_token)
        self._template = None
        if chat_template is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(chat_template)
            except TemplateError as e:
                raise TokenizerError(f"chat template does not compile: {e}") from None

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce: one more than the largest, added tokens included."""
        return max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            raise TokenizerError("this model has no chat template")
        try:
            return str(
                self._template.render(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    **{k: v for k, v in self.special_tokens.items() if v is not None},
                )
            )
        except TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def load_tokenizer(model_dir: str | Path, model_vocab_size: int | None = None) -> Tokenizer:
    """Load the directory's tokenizer; `model_vocab_size` defaults to config.json's."""
    model_dir = Path(model_dir)
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise TokenizerError(f"{model_dir}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tok_path))
    except Exception as e:  # the Rust side raises a bare Exception for malformed files
        raise TokenizerError(f"{tok_path}: cannot be loaded ({e})") from None
    cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
    special_map_path = model_dir / "special_tokens_map.json"
    special_map = _read_json(special_map_path) if special_map_path.is_file() else {}
    special = {
        key: _token_str(tok_cfg.get(key)) or _token_str(special_map.get(key))
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    gen_path = model_dir / "generation_config.json"
    gen_raw = _read_json(gen_path) if gen_path.is_file() else {}
    eos_ids: list[int] = []
    gen_eos = gen_raw.get("eos_token_id")
    for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
        if isinstance(i, int) and i not in eos_ids:
            eos_ids.append(i)
    if special["eos_token"] is not None:
        eid = backend.token_to_id(special["eos_token"])
        if eid is not None and eid not in eos_ids:
            eos_ids.append(eid)
    try:
        generation = GenerationDefaults.from_dict(gen_raw)
    except (TypeError, ValueError) as e:
        raise TokenizerError(f"{gen_path}: bad value ({e})") from None
    tok = Tokenizer(
        backend,
        template if isinstance(template, str) else None,
        special,
        tuple(eos_ids),
        generation,
    )
    if model_vocab_size is None and (model_dir / "config.json").is_file():
        vocab = _read_json(model_dir / "config.json").get("vocab_size")
        model_vocab_size = vocab if isinstance(vocab, int) else None
    if model_vocab_size is not None and tok.vocab_size > model_vocab_size:
        raise TokenizerError(
            f"{tok_path}: tokenizer produces ids up to {tok.vocab_size - 1}, "
            f"but the model's vocabulary has {model_vocab_size} rows"
        )
    return tok
