"""Prometheus /metrics over HTTP: GenAI request metrics, token usage, refusals, engine gauges."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.fmaas import generation_pb2 as tg
from protos.fmaas import generation_pb2_grpc as tg_grpc
from protos.llm.v1 import inference_pb2 as pb
from protos.llm.v1 import inference_pb2_grpc as pb_grpc

from .conftest import BackgroundServer, make_config

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def metrics_server(model_dir: Path) -> Iterator[BackgroundServer]:
    bg = BackgroundServer(make_config(model_dir, metrics_port=0))
    try:
        bg.call(bg.server.start())
        bg.call(bg.server.load())
        yield bg
    finally:
        bg.close()


def _scrape(port: int) -> Samples:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    keep = {"rpc_service", "gen_ai_token_type", "rpc_grpc_status_code", "stop_reason"}
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k in keep)
            out[(s.name, labels)] = s.value
    return out


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_requests_show_in_the_metrics(metrics_server: BackgroundServer) -> None:
    native, tgis = "llm.v1.Inference", "fmaas.GenerationService"
    with grpc.insecure_channel(metrics_server.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        completions = 0
        for n in (3, 6):
            req = pb.GenerateRequest(
                text="hello", stopping=pb.StoppingParams(max_new_tokens=n, ignore_eos=True)
            )
            events = list(stub.Generate(req, timeout=60))
            completions += events[-1].finished.usage.completion_tokens
        assert completions == 9
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(pb.GenerateRequest(), timeout=10))
        req = tg.SingleGenerationRequest(
            request=tg.GenerationRequest(text="hello"),
            params=tg.Parameters(stopping=tg.StoppingCriteria(max_new_tokens=4)),
        )
        list(tg_grpc.GenerationServiceStub(ch).GenerateStream(req, timeout=60))
    m = _scrape(metrics_server.server.metrics_port)
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    assert _get(m, ttft, rpc_service=native, stop_reason="length") == 2
    assert (
        sum(v for (name, lb), v in m.items() if name == ttft and ("rpc_service", tgis) in lb) == 1
    )
    assert _get(m, "gen_ai_server_time_per_output_token_seconds_count", rpc_service=native,
                stop_reason="length") == 2  # fmt: skip
    usage = "gen_ai_server_token_usage_total"
    assert _get(m, usage, rpc_service=native, gen_ai_token_type="output") == 9
    assert _get(m, usage, rpc_service=native, gen_ai_token_type="input") > 0
    refused = "inference_requests_refused_total"
    assert _get(m, refused, rpc_service=native, rpc_grpc_status_code="INVALID_ARGUMENT") == 1
    assert _get(m, "inference_kv_cache_usage") == 0.0
    assert ("inference_queue_waiting", frozenset()) in m
    assert _get(m, "inference_model_load_time_seconds") > 0
