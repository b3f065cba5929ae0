"""gRPC LLM inference service: loader, model, engine and servers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inference_svc.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inference_svc.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # LLM pulls in the model and loader; import it only when asked for.
    if name == "LLM":
        from inference_svc.llm import LLM

        return LLM
    raise AttributeError(f"module 'inference_svc' has no attribute {name!r}")
