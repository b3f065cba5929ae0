"""TLS and mutual TLS on the API port, plaintext health-only port for probes (certs by openssl)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llm.v1 import inference_pb2 as pb
from protos.llm.v1 import inference_pb2_grpc as pb_grpc

from .conftest import BackgroundServer, make_config

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(d: Path, name: str, ext: str) -> None:
    """A P-256 key and a certificate for `name`, signed by the CA in `d`."""
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=d)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", f"/CN={name}", "-out", f"{name}.csr",
             cwd=d)  # fmt: skip
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
             cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key", cwd=d)
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=test-ca", "-days", "1",
             "-out", "ca.pem", cwd=d)  # fmt: skip
    _issue(d, "server", "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _issue(d, "client", "extendedKeyUsage=clientAuth\n")
    return d


@pytest.fixture(scope="module")
def tls_server(model_dir: Path, certs: Path) -> Iterator[BackgroundServer]:
    cfg = make_config(
        model_dir,
        tls_cert=certs / "server.pem",
        tls_key=certs / "server.key",
        tls_client_ca=certs / "ca.pem",
        health_port=0,
    )
    bg = BackgroundServer(cfg)
    try:
        bg.call(bg.server.start())
        bg.call(bg.server.load())
        yield bg
    finally:
        bg.close()


def _creds(certs: Path, client_cert: bool) -> grpc.ChannelCredentials:
    if not client_cert:
        return grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
    return grpc.ssl_channel_credentials(
        (certs / "ca.pem").read_bytes(),
        (certs / "client.key").read_bytes(),
        (certs / "client.pem").read_bytes(),
    )


def test_mutual_tls_client_is_served(tls_server: BackgroundServer, certs: Path) -> None:
    with grpc.secure_channel(tls_server.address, _creds(certs, True)) as ch:
        info = pb_grpc.InferenceStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert info.architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("how", ["no client cert", "plaintext"])
def test_clients_without_a_certificate_are_refused(
    tls_server: BackgroundServer, certs: Path, how: str
) -> None:
    if how == "plaintext":
        ch = grpc.insecure_channel(tls_server.address)
    else:
        ch = grpc.secure_channel(tls_server.address, _creds(certs, False))
    with ch, pytest.raises(grpc.RpcError) as info:
        pb_grpc.InferenceStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_health_port_serves_health_only(tls_server: BackgroundServer) -> None:
    assert tls_server.server.health_port not in (0, tls_server.server.port)
    with grpc.insecure_channel(f"127.0.0.1:{tls_server.server.health_port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "llm.v1.Inference"):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.InferenceStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_tls_flags_are_checked(model_dir: Path, certs: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        make_config(model_dir, tls_cert=certs / "server.pem")
    with pytest.raises(ValueError, match="needs --tls-cert"):
        make_config(model_dir, tls_client_ca=certs / "ca.pem")
    with pytest.raises(ValueError, match="for TLS servers"):
        make_config(model_dir, health_port=0)
