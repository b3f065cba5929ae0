"""A small keep-alive HTTP/1.1 GET client for ranged reads: one per worker thread, typed errors."""

from __future__ import annotations

import http.client
import re
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from cache_sidecar.errors import (
    ChecksumMismatch,
    RevisionNotFound,
    SidecarError,
    TransientTransferError,
)
from cache_sidecar.sources.base import HttpTarget

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}
_CREDENTIALS = {"authorization", "cookie", "proxy-authorization"}


@dataclass(frozen=True)
class Opened:
    """An open response: `start` is the file offset of its first body byte, `total` the file size."""

    response: http.client.HTTPResponse
    start: int
    length: int  # body bytes to expect
    total: int | None
    ranged: bool  # 206: the server honoured Range


class HttpClient:
    """GET with Range, redirects followed, connections kept alive per (scheme, host)."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._conns: dict[tuple[str, str], http.client.HTTPConnection] = {}

    def open(self, target: HttpTarget, start: int, end: int | None, what: str) -> Opened:
        """GET bytes [start, end] (inclusive; end None = to the end of the file)."""
        url = target.url
        origin = urlsplit(url)[:2]
        sent = dict(target.headers)
        for _ in range(6):
            headers = dict(sent)
            headers["Accept-Encoding"] = "identity"  # sizes and hashes are of the raw bytes
            if start > 0 or end is not None:
                headers["Range"] = f"bytes={start}-{'' if end is None else end}"
            parts = urlsplit(url)
            conn = self._conn(parts.scheme, parts.netloc)
            path = parts.path + (f"?{parts.query}" if parts.query else "")
            try:
                conn.request("GET", path, headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                self.drop(parts.scheme, parts.netloc)
                raise TransientTransferError(f"{what}: {type(exc).__name__}: {exc}") from exc
            if resp.status in (301, 302, 303, 307, 308):
                location = resp.getheader("Location")
                resp.read()
                if not location:
                    raise SidecarError(f"{what}: redirect without a Location")
                url = urljoin(url, location)
                if urlsplit(url)[:2] != origin:
                    # The token is for the mirror: a CDN or signed-URL host must never see it
                    # (and S3-style signed URLs refuse a second auth mechanism).
                    sent = {k: v for k, v in sent.items() if k.lower() not in _CREDENTIALS}
                continue
            return self._check(resp, start, what, parts.scheme, parts.netloc)
        raise SidecarError(f"{what}: too many redirects")

    def _check(
        self, resp: http.client.HTTPResponse, start: int, what: str, scheme: str, netloc: str
    ) -> Opened:
        status = resp.status
        if status in (200, 206):
            length = int(resp.getheader("Content-Length") or -1)
            if status == 206:
                m = _CONTENT_RANGE.match(resp.getheader("Content-Range") or "")
                if not m or int(m.group(1)) != start:
                    self.drop(scheme, netloc)
                    raise TransientTransferError(f"{what}: bad Content-Range for offset {start}")
                total = None if m.group(3) == "*" else int(m.group(3))
                return Opened(resp, start, int(m.group(2)) - start + 1, total, True)
            return Opened(resp, 0, length, length if length >= 0 else None, False)
        body = resp.read(4096)
        self.drop(scheme, netloc)
        if status in _TRANSIENT_STATUS:
            raise TransientTransferError(f"{what}: the mirror answered HTTP {status}")
        if status == 404:
            raise RevisionNotFound(f"{what}: the mirror answered 404 (not found)")
        if status in (401, 403):
            raise SidecarError(f"{what}: access denied (HTTP {status}); check the token")
        if status == 416:
            raise TransientTransferError(f"{what}: range not satisfiable at offset {start}")
        raise SidecarError(f"{what}: the mirror answered HTTP {status}: {body[:200]!r}")

    def _conn(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        key = (scheme, netloc)
        conn = self._conns.get(key)
        if conn is None:
            if scheme == "https":
                conn = http.client.HTTPSConnection(netloc, timeout=self._timeout_s)
            elif scheme == "http":
                conn = http.client.HTTPConnection(netloc, timeout=self._timeout_s)
            else:
                raise SidecarError(f"unsupported URL scheme {scheme!r}")
            self._conns[key] = conn
        return conn

    def drop(self, scheme: str, netloc: str) -> None:
        conn = self._conns.pop((scheme, netloc), None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


def read_into(opened: Opened, view: memoryview, what: str) -> int:
    """Fill `view` from the body; a short read or a stall raises `TransientTransferError`."""
    got = 0
    try:
        while got < len(view):
            n = opened.response.readinto(view[got:])
            if not n:
                if opened.response.chunked:
                    # A chunked body that ends cleanly is the whole file: it is shorter than listed.
                    raise ChecksumMismatch(
                        f"{what}: the body ended early, shorter than the listing"
                    )
                raise TransientTransferError(f"{what}: connection closed after {got} bytes")
            got += n
    except TimeoutError as exc:
        raise TransientTransferError(f"{what}: stalled (no bytes for the read timeout)") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise TransientTransferError(f"{what}: {type(exc).__name__}: {exc}") from exc
    return got
