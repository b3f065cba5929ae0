"""Engine: plans memory, allocates the KV pool, warms up, then steps: schedule, run, postprocess.

Synchronous and single-threaded; `AsyncEngine` (async_engine.py) runs it in its own thread.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from inference_svc.engine.detokenizer import IncrementalDetokenizer
from inference_svc.engine.kv_cache_manager import KVCacheManager
from inference_svc.engine.model_runner import ModelRunner
from inference_svc.engine.outputs import EngineStats, RequestOutput, Timing, Usage
from inference_svc.engine.planner import (
    MemoryPlan,
    ModelShape,
    PlanInputs,
    cpu_memory_budget,
    plan_memory,
)
from inference_svc.engine.request import Request, StopReason
from inference_svc.engine.sampling_params import SamplingParams
from inference_svc.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and memory sources. Sizes in bytes; None means "derive"."""

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_waiting: int = 1024
    long_prefill_threshold: int = 512
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # explicit KV pool size (skips the budget arithmetic)
    memory_budget: int | None = None  # per rank; GPU default total × utilisation, CPU cgroup/RAM
    gpu_memory_utilization: float = 0.9
    runtime_overhead: int = 256 * 1024**2
    warmup: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class PlannedStep:
    """A scheduled step before the model runs, and the outputs already known by then.

    `outputs`: admissions of requests scheduled for the first time, and requests the scheduler
    finished itself (deadlines). `AsyncEngine` hands them out before running the step.
    """

    scheduler_output: SchedulerOutput
    outputs: list[RequestOutput]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Engine:
    """Owns the scheduler, the model runner and each request's detokenizer."""

    def __init__(
        self, executor: Any, tokenizer: Tokenizer | None, config: EngineConfig, device: str = "cpu"
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        model_cfg = executor.config
        self.eos_token_ids: tuple[int, ...] = tuple(model_cfg.eos_token_ids)
        self.max_model_len = min(
            config.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
        )
        self.plan = self._plan_memory()
        executor.allocate_kv_cache(self.plan.num_blocks, config.block_size)
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_waiting=config.max_waiting,
            long_prefill_threshold=config.long_prefill_threshold,
        )
        kv = KVCacheManager(self.plan.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, kv)
        self.runner = ModelRunner(executor, config.block_size, device)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._admitted: set[str] = set()  # unfinished requests whose admission went out
        self._generated = 0
        self._steps = 0
        if config.warmup:
            self.warmup()

    # -- set-up ---------------------------------------------------------------------------------

    def _plan_memory(self) -> MemoryPlan:
        cfg, ex = self.config, self.executor
        dtype = _dtype_name(getattr(ex, "dtype", None) or ex.config.dtype)
        shape = ModelShape.from_model_config(ex.config)
        if cfg.kv_cache_memory is not None:
            budget, activation = 0, 0
        else:
            activation = ex.profile_peak_activation_bytes(
                cfg.max_num_batched_tokens, cfg.max_num_seqs
            )
            budget = cfg.memory_budget or self._default_budget()
        plan = plan_memory(
            PlanInputs(
                shape=shape,
                tp_size=ex.tp_size,
                weight_dtype=dtype,
                kv_dtype=dtype,
                memory_budget_bytes=budget,
                activation_peak_bytes=activation,
                runtime_overhead_bytes=0 if cfg.kv_cache_memory else cfg.runtime_overhead,
                max_model_len=self.max_model_len,
                block_size=cfg.block_size,
                measured_weight_bytes=ex.weight_bytes_per_rank(),
                kv_cache_bytes=cfg.kv_cache_memory,
            )
        )
        # More blocks than every sequence at full length (twice, for the prefix cache) only
        # wastes host memory on CPU, where the budget is the whole machine.
        cap = 2 * cfg.max_num_seqs * plan.blocks_for(self.max_model_len)
        if plan.num_blocks > cap and cfg.kv_cache_memory is None:
            plan = MemoryPlan(**{**plan.__dict__, "num_blocks": cap})
        log.info("memory plan: %s", plan.to_dict())
        return plan

    def _default_budget(self) -> int:
        if self.device.startswith("cuda"):
            _, total = torch.cuda.mem_get_info(torch.device(self.device))
            return int(total * self.config.gpu_memory_utilization)
        return cpu_memory_budget()

    def warmup(self) -> None:
        """Run the largest prefill step and the largest decode batch the scheduler will form."""
        n = self.config.max_num_seqs
        per_seq = max(1, min(self.config.max_num_batched_tokens // n, self.max_model_len - 2))
        per_seq = min(per_seq, max(1, self.plan.kv_token_capacity // n - 2))
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        vocab = self.executor.config.vocab_size
        for i in range(n):
            # Distinct prompts, so the prefix cache does not shrink the warm-up steps.
            prompt = [(i * 131 + j * 7) % (vocab - 1) + 1 for j in range(per_seq)]
            while len(self.scheduler.waiting) >= self.scheduler.config.max_waiting:
                self.step()
            self.add_request(prompt, params, request_id=f"warmup-{i}")
        while self.has_unfinished():
            self.step()
        # Warm-up traffic must not show in the counters or the prefix cache statistics.
        kv = self.scheduler.kv
        kv.stats.queried_tokens = kv.stats.hit_tokens = 0
        self.scheduler.stats.num_finished = self.scheduler.stats.num_preemptions = 0
        self._generated = self._steps = 0

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_extra_keys: tuple[object, ...] = (),
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request; raises QueueFullError, RequestTooLongError or ValueError."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            prompt_ids = list(self.tokenizer.encode(prompt))
        else:
            prompt_ids = [int(t) for t in prompt]
        vocab = self.executor.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            # The sampler bans these by index before min_tokens: out of range, the step would fail.
            raise ValueError(f"stop_token_ids out of range [0, {vocab}): {bad[:5]}")
        request = Request(
            request_id or uuid.uuid4().hex,
            prompt_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            cache_extra_keys=cache_extra_keys,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        )
        # Every check before the scheduler takes the request: a refused one must not run anyway.
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens
            )
        elif params.stop:
            raise ValueError("stop strings need a tokenizer")
        self.scheduler.add_request(request)
        if detok is not None:
            self._detok[request.request_id] = detok
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now and free its blocks; None if it is unknown or already done."""
        request = self.scheduler.finish_request(request_id, StopReason.ABORTED)
        return None if request is None else self._output(request, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run, postprocess: admissions first, then this step's tokens."""
        planned = self.schedule()
        return planned.outputs + self.run(planned)

    def schedule(self) -> PlannedStep:
        """The first half of `step`: pick the work; admit requests scheduled for the first time."""
        out = self.scheduler.schedule()
        outputs = [self._output(r, [], "") for r in out.finished]
        for s in out.scheduled:
            request = s.request
            # Once per request: a request resumed after preemption is not admitted again.
            if request.request_id not in self._admitted:
                self._admitted.add(request.request_id)
                outputs.append(self._output(request, [], "", admitted=True))
        return PlannedStep(out, outputs)

    def run(self, planned: PlannedStep) -> list[RequestOutput]:
        """The second half of `step`: run the model on a planned step and sample its tokens."""
        out = planned.scheduler_output
        outputs: list[RequestOutput] = []
        if not out.scheduled:
            return outputs
        sampled, result = self.runner.execute(out)
        tokens = {s.request.request_id: t for s, t in zip(sampled, result.token_ids, strict=True)}
        self.scheduler.update_from_output(out, tokens)
        self._steps += 1
        for j, s in enumerate(sampled):
            request = s.request
            token = result.token_ids[j]
            self._generated += 1
            text = ""
            detok = self._detok.get(request.request_id)
            if detok is not None:
                update = detok.add_token(token)
                text = update.text
                if update.stop_string is not None:
                    if not request.is_finished:
                        self.scheduler.finish_request(
                            request.request_id, StopReason.STOP_STRING, update.stop_string
                        )
                    else:
                        # The same token also hit max_tokens (or a stop token): the text is cut
                        # before the stop string, so that is the reason to report (as vLLM does).
                        request.stop_reason = StopReason.STOP_STRING
                        request.stop_detail = update.stop_string
            lp = result.logprobs[j]
            top = result.top_logprobs[j]
            outputs.append(
                self._output(
                    request,
                    [token],
                    text,
                    None if lp is None else [lp],
                    None if top is None else [top],
                )
            )
        return outputs

    def _output(
        self,
        request: Request,
        new_ids: list[int],
        text: str,
        logprobs: list[float] | None = None,
        top: list[list[tuple[int, float]]] | None = None,
        admitted: bool = False,
    ) -> RequestOutput:
        timing = None
        if request.is_finished:
            self._admitted.discard(request.request_id)
            detok = self._detok.pop(request.request_id, None)
            if detok is not None and request.stop_reason is not StopReason.STOP_STRING:
                text += detok.flush()
            self.runner.release(request.request_id)
            now = time.monotonic()
            t0 = request.arrival_time
            timing = Timing(
                queue_s=None
                if request.first_scheduled_time is None
                else request.first_scheduled_time - t0,
                first_token_s=None
                if request.first_token_time is None
                else request.first_token_time - t0,
                total_s=now - t0,
            )
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_text=text,
            finished=request.is_finished,
            usage=Usage(
                request.num_prompt_tokens,
                request.num_output_tokens,
                max(request.num_cached_tokens, 0),
            ),
            stop_reason=request.stop_reason,
            stop_detail=request.stop_detail,
            logprobs=logprobs,
            top_logprobs=top,
            timing=timing,
            admitted=admitted,
        )

    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.scheduler.kv
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_usage=kv.usage(),
            num_blocks=self.plan.num_blocks,
            block_size=self.config.block_size,
            prefix_queried_tokens=kv.stats.queried_tokens,
            prefix_hit_tokens=kv.stats.hit_tokens,
            num_preemptions=s.stats.num_preemptions,
            num_finished=s.stats.num_finished,
            num_generated_tokens=self._generated,
            num_steps=self._steps,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
