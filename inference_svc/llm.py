"""Offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))`, on the server's own engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from inference_svc.engine.engine import Engine, EngineConfig
from inference_svc.engine.outputs import Usage
from inference_svc.engine.planner import normalize_dtype, parse_bytes
from inference_svc.engine.request import StopReason
from inference_svc.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class CompletionOutput:
    """One prompt's result."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    stop_reason: StopReason
    stop_detail: str | int | None
    usage: Usage
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def _torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = normalize_dtype(dtype)
    if name not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype {dtype!r} is not a compute dtype (float32, float16, bfloat16)")
    return getattr(torch, name)  # type: ignore[no-any-return]


class LLM:
    """Loads a checkpoint directory and generates; engine options (block_size, max_num_seqs, ...)
    pass through as keyword arguments to EngineConfig."""

    def __init__(
        self,
        model_dir: str | Path,
        tensor_parallel_size: int = 1,
        dtype: str | torch.dtype | None = None,
        kv_cache_memory: int | str | None = None,
        device: str = "cpu",
        **engine_options: Any,
    ) -> None:
        from inference_svc.loader.tokenizer import load_tokenizer
        from inference_svc.model.executor import create_executor

        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_options) - known
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; known: {sorted(known)}")
        if isinstance(kv_cache_memory, str):
            kv_cache_memory = parse_bytes(kv_cache_memory)
        config = EngineConfig(kv_cache_memory=kv_cache_memory, **engine_options)
        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        executor = create_executor(
            self.model_dir,
            tensor_parallel_size=tensor_parallel_size,
            dtype=_torch_dtype(dtype),
            device=device,
        )
        try:
            self.engine = Engine(executor, self.tokenizer, config, device=device)
        except BaseException:
            executor.shutdown()
            raise
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids) at once; results in prompt order."""
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        param_list = (
            [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        )
        if len(param_list) != len(prompt_list):
            raise ValueError(f"{len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        order: list[str] = []
        state: dict[str, dict[str, Any]] = {}
        scheduler = self.engine.scheduler
        pending = list(zip(prompt_list, param_list, strict=True))[::-1]
        try:
            while pending or self.engine.has_unfinished():
                # Offline callers may pass more prompts than the waiting queue admits: feed it.
                while pending and len(scheduler.waiting) < scheduler.config.max_waiting:
                    prompt, p = pending.pop()
                    rid = f"llm-{next(self._ids)}"
                    request = self.engine.add_request(prompt, p, request_id=rid)
                    order.append(rid)
                    state[rid] = {
                        "prompt": list(request.prompt_token_ids),
                        "ids": [],
                        "text": [],
                        "lp": [] if p.logprobs is not None else None,
                        "top": [] if p.logprobs is not None else None,
                        "final": None,
                    }
                for out in self.engine.step():
                    st = state[out.request_id]
                    st["ids"].extend(out.new_token_ids)
                    st["text"].append(out.new_text)
                    if st["lp"] is not None and out.logprobs is not None:
                        st["lp"].extend(out.logprobs)
                        st["top"].extend(out.top_logprobs or [])
                    if out.finished:
                        st["final"] = out
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        results = []
        for rid in order:
            st = state[rid]
            final = st["final"]
            results.append(
                CompletionOutput(
                    request_id=rid,
                    prompt_token_ids=st["prompt"],
                    token_ids=st["ids"],
                    text="".join(st["text"]),
                    stop_reason=final.stop_reason,
                    stop_detail=final.stop_detail,
                    usage=final.usage,
                    logprobs=st["lp"],
                    top_logprobs=st["top"],
                )
            )
        return results

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()
