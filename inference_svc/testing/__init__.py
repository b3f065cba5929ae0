"""Test fixtures made at test time: deterministic Llama-family checkpoints with a tokenizer.

Importing this package is cheap; `transformers` is imported only when a model is built or loaded.
"""

from inference_svc.testing.models import (
    FAMILIES,
    ModelSpec,
    build_model,
    cached_model,
    load_reference,
    make_model,
)

__all__ = ["FAMILIES", "ModelSpec", "build_model", "cached_model", "load_reference", "make_model"]
