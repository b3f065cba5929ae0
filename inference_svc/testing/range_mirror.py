"""A small Hugging Face-compatible mirror on loopback that honours `Range` and injects faults.

It serves the endpoints huggingface_hub and the cache sidecar use (`/api/models/{repo}/revision/
{rev}`, `/api/models/{repo}/tree/{rev}[/{path}]`, `/{repo}/resolve/{rev}/{path}`) from directories,
counts bytes and requests per file, and can drop connections, answer 5xx, stall, corrupt a byte or
serve an LFS pointer in place of content. olah (`mirror.py`) is the realistic mirror; this one is
for ranged transfers and faults.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".h5", ".msgpack")
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


@dataclass
class Fault:
    """Misbehaviour for one file; each counter is consumed by successive GETs of that file."""

    fail_first: int = 0  # answer `fail_status` to this many GETs
    fail_status: int = 503
    drop_after: int | None = None  # close the connection after this many body bytes ...
    drop_times: int = 1  # ... on this many GETs
    stall_s: float = 0.0  # sleep this long when the body reaches file offset `stall_after` ...
    stall_after: int = 0
    stall_times: int = 1  # ... on this many GETs
    corrupt_offset: int | None = None  # flip this byte of the content (every GET)
    lfs_pointer_as_content: bool = False  # serve the LFS pointer text instead of the bytes


@dataclass
class MirrorFile:
    path: str
    data_path: Path | None  # content on disk (None: `inline`)
    inline: bytes = b""
    lfs: bool = False
    size: int = 0
    sha256: str = ""
    git_oid: str = ""
    pointer: bytes = b""


@dataclass
class MirrorRepo:
    files: dict[str, MirrorFile] = field(default_factory=dict)  # of the newest commit
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit
    trees: dict[str, dict[str, MirrorFile]] = field(default_factory=dict)  # commit -> files

    @property
    def commits(self) -> set[str]:
        return set(self.trees)


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


def _pointer(sha256: str, size: int) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    )


class RangeMirror:
    """ThreadingHTTPServer on 127.0.0.1 (port 0). `stop()`/`start()` keep the port (mirror down/up)."""

    def __init__(self, honour_range: bool = True) -> None:
        self.honour_range = honour_range
        self.repos: dict[str, MirrorRepo] = {}
        self.faults: dict[str, Fault] = {}
        self.bytes_served: dict[str, int] = defaultdict(int)  # path -> body bytes sent
        self.requests: dict[str, int] = defaultdict(int)  # path -> GETs of its content
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._port = 0

    # ---- lifecycle
    def __enter__(self) -> RangeMirror:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"mirror": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), handler)
        self._server.daemon_threads = True
        self._port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    # ---- content
    def publish(self, repo_id: str, src_dir: Path, branch: str = "main") -> str:
        """Serve every file under `src_dir` as a new commit of `repo_id`; returns the commit sha."""
        files = {}
        for p in sorted(src_dir.rglob("*")):
            if p.is_file():
                rel = p.relative_to(src_dir).as_posix()
                data = p.read_bytes()
                # Small files are kept per commit; large ones are read from `src_dir` when served.
                files[rel] = self._describe(rel, data, p if len(data) > 2**20 else None)
        return self._commit(repo_id, files, branch)

    def put_file(self, repo_id: str, path: str, data: bytes, lfs: bool | None = None) -> str:
        """Add (or replace) one listed file, any path accepted (traversal tests); a new commit."""
        repo = self.repos.setdefault(repo_id, MirrorRepo())
        files = dict(repo.files)
        files[path] = self._describe(path, data, None, lfs)
        return self._commit(repo_id, files, "main")

    def _describe(
        self, rel: str, data: bytes, on_disk: Path | None, lfs: bool | None = None
    ) -> MirrorFile:
        is_lfs = lfs if lfs is not None else rel.endswith(LFS_SUFFIXES) or len(data) > 10 * 2**20
        sha = hashlib.sha256(data).hexdigest()
        pointer = _pointer(sha, len(data))
        return MirrorFile(
            path=rel,
            data_path=on_disk,
            inline=b"" if on_disk is not None else data,
            lfs=is_lfs,
            size=len(data),
            sha256=sha,
            git_oid=_git_blob_sha1(pointer if is_lfs else data),
            pointer=pointer,
        )

    def _commit(self, repo_id: str, files: dict[str, MirrorFile], branch: str) -> str:
        repo = self.repos.setdefault(repo_id, MirrorRepo())
        listing = json.dumps(
            [[f.path, f.git_oid] for f in files.values()] + [time.time_ns()], sort_keys=True
        )
        commit = hashlib.sha1(f"{repo_id}\n{listing}".encode()).hexdigest()
        with self._lock:
            repo.files = files
            repo.trees[commit] = files
            repo.refs[branch] = commit
        return commit

    def content(self, repo_id: str, path: str, commit: str | None = None) -> bytes:
        repo = self.repos[repo_id]
        f = (repo.trees[commit] if commit else repo.files)[path]
        return f.data_path.read_bytes() if f.data_path is not None else f.inline

    def reset_counters(self) -> None:
        with self._lock:
            self.bytes_served.clear()
            self.requests.clear()


class _Reader:
    """Reads a served file's bytes at any offset (from disk or memory), applying content faults."""

    def __init__(self, f: MirrorFile, fault: Fault) -> None:
        self._f, self._fault, self._fd = f, fault, -1

    def __enter__(self) -> _Reader:
        if self._f.data_path is not None and not self._fault.lfs_pointer_as_content:
            self._fd = os.open(self._f.data_path, os.O_RDONLY)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)

    def read(self, offset: int, n: int) -> bytes:
        if self._fault.lfs_pointer_as_content:
            data = self._f.pointer[offset : offset + n]
        elif self._fd >= 0:
            data = os.pread(self._fd, n, offset)
        else:
            data = self._f.inline[offset : offset + n]
        i = self._fault.corrupt_offset
        if i is not None and offset <= i < offset + len(data):
            k = i - offset
            data = data[:k] + bytes([data[k] ^ 0xFF]) + data[k + 1 :]
        return data


class _Handler(BaseHTTPRequestHandler):
    mirror: RangeMirror
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet in tests
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        query = parse_qs(parts.query)
        m = re.match(r"^/api/models/([^/]+/[^/]+)/revision/([^/]+)$", path)
        if m:
            return self._model_info(m.group(1), m.group(2), head)
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
        if m:
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            return self._tree(m.group(1), m.group(2), m.group(3) or "", recursive, head)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._resolve(m.group(1), m.group(2), m.group(3), head)
        self._json(404, {"error": "not found"}, head)

    def _commit_of(self, repo_id: str, rev: str) -> tuple[MirrorRepo, str] | None:
        repo = self.mirror.repos.get(repo_id)
        if repo is None:
            return None
        commit = rev if rev in repo.commits else repo.refs.get(rev)
        return (repo, commit) if commit else None

    def _model_info(self, repo_id: str, rev: str, head: bool) -> None:
        found = self._commit_of(repo_id, rev)
        if found is None:
            return self._not_found(head)
        repo, commit = found
        body = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": False,
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "siblings": [{"rfilename": p} for p in sorted(repo.trees[commit])],
        }
        self._json(200, body, head)

    def _tree(self, repo_id: str, rev: str, prefix: str, recursive: bool, head: bool) -> None:
        found = self._commit_of(repo_id, rev)
        if found is None:
            return self._not_found(head)
        repo, commit = found
        prefix = prefix.strip("/")
        entries, folders = [], set()
        for f in sorted(repo.trees[commit].values(), key=lambda f: f.path):
            if prefix and not f.path.startswith(prefix + "/"):
                continue
            rest = f.path[len(prefix) + 1 :] if prefix else f.path
            if not recursive and "/" in rest:
                folders.add((prefix + "/" if prefix else "") + rest.split("/")[0])
                continue
            entry: dict[str, object] = {
                "type": "file",
                "oid": f.git_oid,
                "size": f.size,
                "path": f.path,
            }
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": len(f.pointer)}
            entries.append(entry)
        for d in sorted(folders):
            entries.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": d})
        self._json(200, entries, head)

    def _resolve(self, repo_id: str, rev: str, path: str, head: bool) -> None:
        found = self._commit_of(repo_id, rev)
        if found is None or path not in found[0].trees[found[1]]:
            return self._not_found(head)
        repo, commit = found
        f = repo.trees[commit][path]
        mirror = self.mirror
        fault = mirror.faults.get(path, Fault())
        with mirror._lock:
            if not head:
                mirror.requests[path] += 1
            fail = not head and fault.fail_first > 0
            if fail:
                fault.fail_first -= 1
            drop = None
            if not head and fault.drop_after is not None and fault.drop_times > 0:
                drop, fault.drop_times = fault.drop_after, fault.drop_times - 1
        if fail:
            return self._json(fault.fail_status, {"error": "injected failure"}, head)
        size = len(f.pointer) if fault.lfs_pointer_as_content else f.size
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng and mirror.honour_range and size:
            m = _RANGE_RE.match(rng.strip())
            if m and (m.group(1) or m.group(2)):
                if m.group(1):
                    start = int(m.group(1))
                    end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
                else:
                    start = max(0, size - int(m.group(2)))
                if start >= size or start > end:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes" if mirror.honour_range else "none")
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{f.sha256 if f.lfs else f.git_oid}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head:
            return
        with mirror._lock:  # a stall is spent only by a body that reaches its offset
            stall = (
                fault.stall_s > 0 and fault.stall_times > 0 and start <= fault.stall_after <= end
            )
            if stall:
                fault.stall_times -= 1
        with _Reader(f, fault) as reader:
            self._send_body(path, reader, start, end + 1, drop, fault if stall else None)

    def _send_body(
        self,
        path: str,
        reader: _Reader,
        start: int,
        stop: int,
        drop: int | None,
        stall: Fault | None,
    ) -> None:
        """Send file bytes [start, stop), dropping or stalling as the fault says."""
        sent, step, length = 0, 1024 * 1024, stop - start
        try:
            while sent < length:
                n = min(step, length - sent)
                if drop is not None:
                    n = min(n, drop - sent)
                    if n <= 0:
                        self.close_connection = True
                        self.wfile.flush()
                        self.connection.shutdown(2)
                        return
                if stall is not None and start + sent + n > stall.stall_after:
                    n = max(0, stall.stall_after - start - sent)  # stop exactly at the offset
                    if n == 0:
                        self.wfile.flush()
                        time.sleep(stall.stall_s)
                        stall = None
                        continue
                self.wfile.write(reader.read(start + sent, n))
                sent += n
                with self.mirror._lock:
                    self.mirror.bytes_served[path] += n
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _not_found(self, head: bool) -> None:
        self._json(404, {"error": "Repository not found"}, head, {"X-Error-Code": "RepoNotFound"})

    def _json(
        self, status: int, body: object, head: bool, extra: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(data)
