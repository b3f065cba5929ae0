"""The ranged HTTP client (http.py): redirects keep the mirror's token on the mirror."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cache_sidecar.http import HttpClient
from cache_sidecar.sources.base import HttpTarget

BODY = b"weights" * 100


@contextmanager
def _server(redirect_to: str | None, seen: list[dict[str, str]]) -> Iterator[str]:
    """Loopback server that records request headers; redirects everything to `redirect_to`, or
    `/r/<path>` to `/<path>` on itself, and serves BODY otherwise."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            seen.append({k.lower(): v for k, v in self.headers.items()})
            if redirect_to is not None or self.path.startswith("/r/"):
                self.send_response(302)
                if redirect_to is not None:
                    self.send_header("Location", redirect_to + self.path)
                else:  # relative: same origin
                    self.send_header("Location", self.path.removeprefix("/r"))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _get(url: str) -> bytes:
    client = HttpClient(timeout_s=5.0)
    try:
        target = HttpTarget(url, {"Authorization": "Bearer hf_secret", "X-Trace": "t1"})
        opened = client.open(target, 0, None, "f")
        return opened.response.read()
    finally:
        client.close()


def test_a_redirect_to_another_host_drops_the_token() -> None:
    cdn_seen: list[dict[str, str]] = []
    mirror_seen: list[dict[str, str]] = []
    with _server(None, cdn_seen) as cdn, _server(cdn, mirror_seen) as mirror:
        assert _get(mirror + "/org/m/resolve/abc/model.safetensors") == BODY
    assert mirror_seen[0]["authorization"] == "Bearer hf_secret"
    assert "authorization" not in cdn_seen[0]
    assert cdn_seen[0]["x-trace"] == "t1"  # other headers still go along


def test_a_redirect_on_the_same_host_keeps_the_token() -> None:
    seen: list[dict[str, str]] = []
    with _server(None, seen) as mirror:
        assert _get(mirror + "/r/org/m/resolve/abc/model.safetensors") == BODY
    assert len(seen) == 2
    assert all(h["authorization"] == "Bearer hf_secret" for h in seen)
