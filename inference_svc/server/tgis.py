"""`fmaas.GenerationService` (TGIS wire API) on the same engine as llm.v1.

Streaming follows TGIS: the first message carries only input_token_count (and the input text or
tokens when asked), then one message per step with the new text and the running
generated_token_count, and the last one also carries stop_reason (and stop_sequence).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator
from typing import Any

import grpc

from inference_svc.engine.async_engine import EngineDeadError
from inference_svc.engine.outputs import RequestOutput
from inference_svc.engine.request import StopReason
from inference_svc.server.runtime import LoadedModel, ServingState, StatusError
from inference_svc.server.validation import GenerationInput, ValidationError, validate_tgis
from protos.fmaas import generation_pb2 as tg
from protos.fmaas import generation_pb2_grpc as tg_grpc

SERVICE = tg.DESCRIPTOR.services_by_name["GenerationService"].full_name
STOP_REASONS = {
    StopReason.LENGTH: tg.MAX_TOKENS,
    StopReason.EOS_TOKEN: tg.EOS_TOKEN,
    StopReason.STOP_TOKEN: tg.EOS_TOKEN,  # TGIS has no stop token ids; the closest reason
    StopReason.STOP_STRING: tg.STOP_SEQUENCE,
    StopReason.TIME_LIMIT: tg.TIME_LIMIT,
    StopReason.ABORTED: tg.CANCELLED,
    StopReason.MAX_MODEL_LEN: tg.TOKEN_LIMIT,
}


class GenerationServicer(tg_grpc.GenerationServiceServicer):
    def __init__(self, state: ServingState) -> None:
        self.state = state

    # -- helpers --------------------------------------------------------------------------------

    def _prepare(self, request: Any, texts: list[str]) -> tuple[LoadedModel, list[GenerationInput]]:
        model = self.state.check_accepting()
        if request.HasField("adapter_id") or request.HasField("prefix_id"):
            raise StatusError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "adapters (adapter_id/prefix_id) are not served",
            )
        gens = []
        for i, text in enumerate(texts):
            try:
                gen = validate_tgis(text, request.params, model.tokenizer, model.limits)
            except ValidationError as e:
                where = f"requests[{i}]: " if len(texts) > 1 else ""
                raise StatusError(e.status, where + str(e)) from None
            if request.params.method == tg.SAMPLE and gen.params.seed is None:
                # TGIS reports the seed it sampled with, so the answer can be reproduced.
                seed = random.getrandbits(63)
                gen = dataclasses.replace(gen, params=dataclasses.replace(gen.params, seed=seed))
            gens.append(gen)
        return model, gens

    def _token_infos(self, out: RequestOutput, resp: tg.ResponseOptions) -> list[tg.TokenInfo]:
        if not resp.generated_tokens:
            return []
        infos = []
        for j, token in enumerate(out.new_token_ids):
            info = tg.TokenInfo(text=self.state.token_text(token))
            if out.logprobs is not None:
                lp = out.logprobs[j]
                top = (out.top_logprobs or [[]] * len(out.new_token_ids))[j]
                if resp.token_logprobs:
                    info.logprob = lp
                if resp.token_ranks:
                    above = sum(1 for _, alt in top if alt > lp)
                    info.rank = above + 1 if above < len(top) else 0
                for t, alt in top[: resp.top_n_tokens]:
                    info.top_tokens.append(
                        tg.TokenInfo.TopToken(text=self.state.token_text(t), logprob=alt)
                    )
            infos.append(info)
        return infos

    def _input_tokens(self, gen: GenerationInput) -> list[tg.TokenInfo]:
        # Prompt logprobs are not computed; the tokens come back with their text only.
        return [tg.TokenInfo(text=self.state.token_text(t)) for t in gen.prompt_token_ids]

    @staticmethod
    def _finish(msg: tg.GenerationResponse, out: RequestOutput, gen: GenerationInput) -> None:
        msg.stop_reason = STOP_REASONS.get(out.stop_reason, tg.ERROR)  # type: ignore[arg-type]
        if out.stop_reason is StopReason.STOP_STRING and isinstance(out.stop_detail, str):
            msg.stop_sequence = out.stop_detail
            if gen.include_stop_text:
                msg.text += out.stop_detail
        msg.seed = gen.params.seed or 0

    # -- RPCs -----------------------------------------------------------------------------------

    async def _one(
        self, text: str, gen: GenerationInput, params: tg.Parameters
    ) -> tg.GenerationResponse:
        resp = params.response
        msg = tg.GenerationResponse(input_token_count=len(gen.prompt_token_ids))
        parts = [text] if resp.input_text else []
        if resp.input_tokens:
            msg.input_tokens.extend(self._input_tokens(gen))
        async for out in self.state.stream(gen, api=SERVICE):
            parts.append(out.new_text)
            msg.tokens.extend(self._token_infos(out, resp))
            if out.finished:
                msg.generated_token_count = out.usage.completion_tokens
                msg.text = "".join(parts)
                self._finish(msg, out, gen)
        return msg

    async def Generate(
        self, request: tg.BatchedGenerationRequest, context: grpc.aio.ServicerContext
    ) -> tg.BatchedGenerationResponse:
        try:
            texts = [r.text for r in request.requests]
            _, gens = self._prepare(request, texts)
            tasks = [
                asyncio.ensure_future(self._one(t, g, request.params))
                for t, g in zip(texts, gens, strict=True)
            ]
            try:
                responses = await asyncio.gather(*tasks)
            finally:
                for task in tasks:  # one failed or we were cancelled: stop the others
                    task.cancel()
        except StatusError as e:
            self.state.refused(e.code, SERVICE)
            await context.abort(e.code, e.message)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine stopped: {e}")
        return tg.BatchedGenerationResponse(responses=responses)

    async def _stream(self, request: tg.SingleGenerationRequest) -> AsyncIterator[Any]:
        text = request.request.text
        _, (gen,) = self._prepare(request, [text])
        resp = request.params.response
        first = tg.GenerationResponse(input_token_count=len(gen.prompt_token_ids))
        if resp.input_text:
            first.text = text
        if resp.input_tokens:
            first.input_tokens.extend(self._input_tokens(gen))
        pending: tg.GenerationResponse | None = first
        async for out in self.state.stream(gen, api=SERVICE):
            if pending is not None:
                # Sent once the engine has admitted the request: an overload refusal then
                # arrives as a clean error status, before any message.
                yield pending
                pending = None
            msg = tg.GenerationResponse(
                generated_token_count=out.usage.completion_tokens,
                text=out.new_text,
                tokens=self._token_infos(out, resp),
            )
            if out.finished:
                self._finish(msg, out, gen)
            elif not out.new_text and not msg.tokens:
                continue  # nothing newly visible (a held-back stop prefix, a partial character)
            yield msg

    async def GenerateStream(
        self, request: tg.SingleGenerationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tg.GenerationResponse]:
        async for msg in self.state.relay(self._stream(request), context, SERVICE):
            yield msg

    async def Tokenize(
        self, request: tg.BatchedTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tg.BatchedTokenizeResponse:
        model = await self.state.model_or_abort(context)
        backend = model.tokenizer.backend  # type: ignore[attr-defined]
        out = tg.BatchedTokenizeResponse()
        for r in request.requests:
            enc = backend.encode(r.text)
            n = len(enc.ids)
            keep = (
                slice(n - request.truncate_input_tokens, n)
                if 0 < request.truncate_input_tokens < n
                else slice(0, n)
            )
            item = tg.TokenizeResponse(token_count=len(enc.ids[keep]))
            if request.return_tokens:
                item.tokens.extend(enc.tokens[keep])
            if request.return_offsets:
                item.offsets.extend(
                    tg.TokenizeResponse.Offset(start=s, end=e) for s, e in enc.offsets[keep]
                )
            out.responses.append(item)
        return out

    async def ModelInfo(
        self, request: tg.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> tg.ModelInfoResponse:
        model = await self.state.model_or_abort(context)
        return tg.ModelInfoResponse(
            model_kind=tg.ModelInfoResponse.DECODER_ONLY,
            max_sequence_length=model.limits.max_model_len,
            max_new_tokens=model.limits.default_max_new_tokens,
        )
