"""gRPC LLM inference service: loader, model, engine and servers."""

__version__ = "0.1.0"
