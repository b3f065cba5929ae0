"""`llm.v1.Inference` on grpc.aio: Generate streams Accepted, Token deltas, then Finished.

Client cancellation and deadlines end the handler's task; the engine request is aborted in
`ServingState.stream` so its KV blocks are freed at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from inference_svc.engine.outputs import RequestOutput
from inference_svc.engine.request import StopReason
from inference_svc.server.runtime import ServingState, StatusError
from inference_svc.server.validation import ValidationError, validate_generate
from protos.llm.v1 import inference_pb2 as pb
from protos.llm.v1 import inference_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
STOP_REASONS = {
    StopReason.LENGTH: pb.STOP_REASON_MAX_TOKENS,
    StopReason.EOS_TOKEN: pb.STOP_REASON_EOS_TOKEN,
    StopReason.STOP_STRING: pb.STOP_REASON_STOP_SEQUENCE,
    StopReason.STOP_TOKEN: pb.STOP_REASON_STOP_TOKEN,
    StopReason.TIME_LIMIT: pb.STOP_REASON_TIME_LIMIT,
    StopReason.ABORTED: pb.STOP_REASON_CANCELLED,
    StopReason.MAX_MODEL_LEN: pb.STOP_REASON_MAX_MODEL_LEN,
}


def _finished(out: RequestOutput) -> pb.Finished:
    msg = pb.Finished(
        stop_reason=STOP_REASONS.get(out.stop_reason, pb.STOP_REASON_ERROR)  # type: ignore[arg-type]
        if out.stop_reason is not None
        else pb.STOP_REASON_ERROR,
        usage=pb.Usage(
            prompt_tokens=out.usage.prompt_tokens,
            completion_tokens=out.usage.completion_tokens,
            cached_prompt_tokens=out.usage.cached_prompt_tokens,
        ),
    )
    if isinstance(out.stop_detail, str):
        msg.stop_sequence = out.stop_detail
    elif isinstance(out.stop_detail, int):
        msg.stop_token_id = out.stop_detail
    t = out.timing
    if t is not None:
        queued = t.queue_s or 0.0
        first = t.first_token_s
        msg.timing.queued_s = queued
        if first is not None:
            msg.timing.time_to_first_token_s = first
            msg.timing.prefill_s = max(first - queued, 0.0)
            msg.timing.decode_s = max((t.total_s or first) - first, 0.0)
    return msg


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, state: ServingState) -> None:
        self.state = state

    def _logprobs(self, out: RequestOutput) -> list[pb.TokenLogprob]:
        if out.logprobs is None:
            return []
        tops = out.top_logprobs or [[] for _ in out.logprobs]
        result = []
        for token, lp, top in zip(out.new_token_ids, out.logprobs, tops, strict=True):
            # The engine gives no rank; it is known when the top list reaches below the token.
            above = sum(1 for _, alt in top if alt > lp)
            known = any(t == token for t, _ in top) or (bool(top) and above < len(top))
            result.append(
                pb.TokenLogprob(
                    token_id=token,
                    logprob=lp,
                    rank=above + 1 if known else 0,
                    top=[
                        pb.TopLogprob(token_id=t, text=self.state.token_text(t), logprob=alt)
                        for t, alt in top
                    ],
                )
            )
        return result

    async def _events(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateEvent]:
        model = self.state.check_accepting()
        try:
            gen = validate_generate(request, model.tokenizer, model.limits)
        except ValidationError as e:
            raise StatusError(e.status, str(e)) from None
        accepted = False
        async for out in self.state.stream(gen, request.request_id, SERVICE):
            if not accepted:
                # Normally the engine's admission output: the request got its first step and the
                # prefix cache was looked up, so cached_prompt_tokens is known; the step has not
                # run yet. A request ended before it was ever scheduled (time limit in the queue)
                # has only its final output; Accepted then reports no cached tokens.
                accepted = True
                yield pb.GenerateEvent(
                    accepted=pb.Accepted(
                        request_id=out.request_id,
                        prompt_tokens=out.usage.prompt_tokens,
                        cached_prompt_tokens=out.usage.cached_prompt_tokens,
                    )
                )
            if out.admitted:
                continue
            text = out.new_text
            if out.finished and gen.include_stop_text and isinstance(out.stop_detail, str):
                text += out.stop_detail
            if out.new_token_ids or text:
                yield pb.GenerateEvent(
                    token=pb.TokenDelta(
                        token_ids=out.new_token_ids, text=text, logprobs=self._logprobs(out)
                    )
                )
            if out.finished:
                yield pb.GenerateEvent(finished=_finished(out))

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        async for event in self.state.relay(self._events(request), context, SERVICE):
            yield event

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfoResponse:
        model = await self.state.model_or_abort(context)
        card, limits = model.card, model.limits
        caps = ["logprobs", "stop_sequences", "seed", "token_ids"]
        if card.has_chat_template:
            caps.append("chat")
        if card.prefix_caching:
            caps.append("prefix_caching")
        return pb.ModelInfoResponse(
            model_id=card.model_id,
            architecture=card.architecture,
            revision=card.revision,
            manifest_digest=card.manifest_digest,
            max_model_len=limits.max_model_len,
            max_new_tokens=limits.default_max_new_tokens,
            vocab_size=limits.vocab_size,
            dtype=card.dtype,
            tensor_parallel_size=card.tensor_parallel_size,
            kv_block_size=card.kv_block_size,
            kv_blocks=card.kv_blocks,
            capabilities=caps,
        )

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        from inference_svc.server.validation import encode_prompt

        try:
            model = self.state.model
            if request.WhichOneof("input") == "chat":
                chat = request.chat
                add_gen = not chat.HasField("add_generation_prompt") or chat.add_generation_prompt
                ids, _ = encode_prompt(
                    model.tokenizer,
                    model.limits,
                    chat=[(m.role, m.content) for m in chat.messages],
                    add_generation_prompt=add_gen,
                    check_length=False,
                )
            else:
                # Tokenize reports any length: it is how clients learn a prompt is too long.
                ids = model.tokenizer.encode(request.text, request.add_special_tokens)
        except StatusError as e:
            await context.abort(e.code, e.message)
        except ValidationError as e:
            await context.abort(e.status, str(e))
        tokens = [self.state.token_text(t) for t in ids] if request.return_tokens else []
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens, token_count=len(ids))

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadResponse:
        model = await self.state.model_or_abort(context)
        s = model.engine.stats()
        return pb.LoadResponse(
            running=s.running,
            waiting=s.waiting,
            kv_usage=s.kv_usage,
            prefix_hit_rate=s.prefix_hit_rate,
            preemptions=s.num_preemptions,
            max_waiting=model.card.max_waiting,
            draining=self.state.draining,
        )

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        try:
            found = self.state.abort(request.request_id)
        except StatusError as e:
            await context.abort(e.code, e.message)
        return pb.AbortResponse(found=found)
