"""The committed stubs are what `make protos` would write, and every proto compiles and imports."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from protos.generate import PROTO_FILES, REPO_ROOT, generate


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert len(written) == 3 * len(PROTO_FILES)
    stale = []
    for fresh in written:
        rel = fresh.relative_to(tmp_path)
        committed = REPO_ROOT / rel
        if not committed.exists() or committed.read_bytes() != fresh.read_bytes():
            stale.append(str(rel))
    assert not stale, f"stubs out of date, run `make protos`: {stale}"


@pytest.mark.parametrize(
    ("module", "service"),
    [
        ("protos.llm.v1.inference", "llm.v1.Inference"),
        ("protos.fmaas.generation", "fmaas.GenerationService"),
        ("protos.weightcache.v1.cache", "weightcache.v1.WeightCache"),
    ],
)
def test_stubs_import_and_declare_service(module: str, service: str) -> None:
    pb2 = importlib.import_module(f"{module}_pb2")
    pb2_grpc = importlib.import_module(f"{module}_pb2_grpc")
    package, name = service.rsplit(".", 1)
    descriptor = pb2.DESCRIPTOR.services_by_name[name]
    assert descriptor.full_name == service
    assert pb2.DESCRIPTOR.package == package
    assert hasattr(pb2_grpc, f"{name}Servicer")
    assert hasattr(pb2_grpc, f"{name}Stub")


def test_native_generate_is_server_streaming() -> None:
    from protos.llm.v1 import inference_pb2

    method = inference_pb2.DESCRIPTOR.services_by_name["Inference"].methods_by_name["Generate"]
    assert method.server_streaming and not method.client_streaming
    rpcs = set(inference_pb2.DESCRIPTOR.services_by_name["Inference"].methods_by_name)
    assert rpcs == {"Generate", "ModelInfo", "Tokenize", "GetLoad", "Abort"}


def test_weightcache_states_and_rpcs() -> None:
    from protos.weightcache.v1 import cache_pb2

    states = set(cache_pb2.State.keys())
    assert {"PENDING", "FETCHING", "VERIFYING", "READY", "FAILED", "EVICTED"} <= states
    rpcs = cache_pb2.DESCRIPTOR.services_by_name["WeightCache"].methods_by_name
    assert set(rpcs) == {"Ensure", "Status", "Watch", "List", "Pin", "Unpin", "Evict"}
    assert rpcs["Ensure"].server_streaming and rpcs["Watch"].server_streaming
