"""Streaming download of one file: parallel Range requests or one stream, retries with backoff and
jitter, resume from a temp file, stall watchdog, sha256 (and git sha1) computed while writing.

Ranged chunks are written in place as they arrive and hashed in file order from memory, so no byte
is read back from disk, except a resumed prefix which must be re-hashed once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cache_sidecar.errors import (
    Cancelled,
    ChecksumMismatch,
    DiskFull,
    TransientTransferError,
    UnsafeRepository,
)
from cache_sidecar.http import HttpClient, Opened, read_into
from cache_sidecar.safety import looks_like_lfs_pointer
from cache_sidecar.sources.base import HttpTarget, RemoteFile

MiB = 1024 * 1024
ProgressFn = Callable[[int], None]


@dataclass(frozen=True)
class FetchConfig:
    """Transfer tuning; tests shorten the backoffs and timeouts."""

    parallel_files: int = 4
    range_connections: int = 4
    chunk_bytes: int = 8 * MiB
    min_ranged_bytes: int = 16 * MiB
    window_chunks: int = 8  # how far ahead of the hashed prefix workers may run
    # Connections for all large files together: several shards in flight already fill the link,
    # and on few cores more streams only add contention (measured: benchmarks/bench_fetch.py).
    max_connections: int = 4
    fsync: bool = True  # durability across power loss; kill -9 safety does not need it
    buffer_bytes: int = 1 * MiB
    max_attempts: int = 6  # consecutive failures of one request before giving up
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    stall_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if (
            min(
                self.parallel_files, self.range_connections, self.max_attempts, self.max_connections
            )
            < 1
        ):
            raise ValueError(
                "parallel_files, range_connections, max_connections and max_attempts must be >= 1"
            )
        if self.chunk_bytes < 64 * 1024 or self.buffer_bytes < 4096:
            raise ValueError("chunk_bytes must be >= 64 KiB and buffer_bytes >= 4 KiB")
        if self.stall_timeout_s <= 0 or self.backoff_base_s < 0:
            raise ValueError("stall_timeout_s must be > 0 and backoff_base_s >= 0")

    def ranges_per_file(self, sizes: list[int]) -> int:
        """Range connections per large file when files of `sizes` are fetched together."""
        large = sum(1 for s in sizes if s >= self.min_ranged_bytes)
        in_flight = max(1, min(large, self.parallel_files))
        return max(1, min(self.range_connections, self.max_connections // in_flight))

    def backoff(self, attempt: int) -> float:
        # Exponential with "equal jitter": never zero, never synchronised across sidecars.
        cap = min(self.backoff_max_s, self.backoff_base_s * (2 ** (attempt - 1)))
        return cap / 2 + random.uniform(0, cap / 2)


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str
    git_oid: str


class _Hasher:
    """sha256 and git blob sha1 over the file in order; chunks may arrive out of order."""

    def __init__(self, size: int, prefix_file: Path, save_every: int, git_sha1: bool) -> None:
        self.sha256 = hashlib.sha256()
        # The git blob sha1 is only checked for plain (non-LFS) files, which are small.
        self.sha1 = hashlib.sha1(f"blob {size}\0".encode()) if git_sha1 else None
        self.offset = 0
        self.head = b""
        self._pending: dict[int, bytes | bytearray] = {}
        self._busy = False
        self._cond = threading.Condition()
        self._prefix_file = prefix_file
        self._saved = 0
        self._save_every = save_every

    def update_in_order(self, data: bytes | bytearray | memoryview) -> None:
        if self.offset < 256:
            self.head += bytes(data[: 256 - self.offset])
        self.sha256.update(data)
        if self.sha1 is not None:
            self.sha1.update(data)
        self.offset += len(data)

    def submit(self, offset: int, data: bytes | bytearray) -> None:
        """Take a chunk at `offset`; whoever holds the next one in order hashes what is contiguous."""
        with self._cond:
            self._pending[offset] = data
            if self._busy:
                return
            self._busy = True
        try:
            while True:
                with self._cond:
                    chunk = self._pending.pop(self.offset, None)
                    if chunk is None:
                        self._busy = False
                        self._cond.notify_all()
                        return
                self.update_in_order(chunk)  # hashlib releases the GIL on large buffers
                self.save_prefix()
        except BaseException:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            raise

    def wait_room(self, offset: int, window: int, stop: threading.Event) -> None:
        with self._cond:
            while offset >= self.offset + window and not stop.is_set():
                self._cond.wait(0.2)

    def save_prefix(self, force: bool = False) -> None:
        # A hint for resume after a crash: bytes below it were written (then re-hashed on resume).
        if self.offset > self._saved and (force or self.offset - self._saved >= self._save_every):
            # Fixed width, written in place: a kill at any moment leaves the old or the new value.
            fd = os.open(self._prefix_file, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, f"{self.offset:020d}".encode(), 0)
            finally:
                os.close(fd)
            self._saved = self.offset


def resume_prefix(tmp: Path) -> int:
    try:
        value = int(prefix_path(tmp).read_text())
    except (FileNotFoundError, ValueError):
        return 0
    try:
        return max(0, min(value, tmp.stat().st_size))
    except FileNotFoundError:
        return 0


def prefix_path(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + ".prefix")


class FileDownload:
    """Download `rf` into `tmp` (resuming its recorded prefix), verify it, fsync it."""

    def __init__(
        self,
        target: HttpTarget,
        rf: RemoteFile,
        tmp: Path,
        cfg: FetchConfig,
        on_bytes: ProgressFn,
        cancel: threading.Event,
    ) -> None:
        self.target, self.rf, self.tmp, self.cfg = target, rf, tmp, cfg
        self.on_bytes = on_bytes
        self.cancel = cancel
        self._stop = threading.Event()
        self._errors: list[BaseException] = []

    def run(self) -> FileDigest:
        try:
            return self._run_once(resume=True)
        except ChecksumMismatch:
            if resume_prefix(self.tmp) == 0 and not self._resumed:
                raise
            # The resumed prefix may come from a crashed machine's lost page cache: start over once.
            self._stop.clear()
            self._errors.clear()
            return self._run_once(resume=False)

    def _run_once(self, resume: bool) -> FileDigest:
        size = self.rf.size
        start = resume_prefix(self.tmp) if resume else 0
        self._resumed = start > 0
        self.hasher = _Hasher(
            size, prefix_path(self.tmp), self.cfg.chunk_bytes, git_sha1=not self.rf.is_lfs
        )
        fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._reserve(fd, size)
            if start:
                self._rehash_prefix(fd, start)
                self.on_bytes(start)
            self.fd = fd
            try:
                if start < size:
                    self._transfer(start)
                self._check_errors()
            except BaseException:
                self.hasher.save_prefix(force=True)  # the next attempt resumes from here
                raise
            digest = self._verify()
            if self.cfg.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        prefix_path(self.tmp).unlink(missing_ok=True)
        return digest

    # ---- transfer strategies
    def _transfer(self, start: int) -> None:
        remaining = self.rf.size - start
        client = HttpClient(self.cfg.stall_timeout_s)
        try:
            if remaining < self.cfg.min_ranged_bytes or self.cfg.range_connections == 1:
                self._stream(client, start, None)
                return
            first_end = min(self.rf.size, start + self.cfg.chunk_bytes) - 1
            opened = self._retrying(lambda: self._open(client, start, first_end), f"@{start}")
            if not opened.ranged:  # the server ignores Range: one stream it is
                self._stream(client, start, opened)
                return
        except BaseException:
            client.close()
            raise
        self._ranged(start, client, opened)

    def _stream(self, client: HttpClient, pos: int, opened: Opened | None) -> None:
        buf = bytearray(self.cfg.buffer_bytes)
        failures = 0
        try:
            while pos < self.rf.size:
                try:
                    if opened is None:
                        opened = self._open(client, pos, None)
                    if not opened.ranged and pos > 0:
                        self._skip(opened, pos)  # a 200 to a resumed request restarts at byte 0
                    while pos < self.rf.size:
                        self._check_cancel()
                        n = min(len(buf), self.rf.size - pos)
                        view = memoryview(buf)[:n]
                        read_into(opened, view, self._what(pos))
                        self._write(view, pos)
                        self.hasher.update_in_order(view)
                        self.hasher.save_prefix()
                        pos += n
                        failures = 0
                        self.on_bytes(n)
                    if opened.response.read(1):
                        raise ChecksumMismatch(
                            f"{self.rf.path}: the mirror serves more bytes than listed"
                        )
                except TransientTransferError:
                    client.close()
                    opened = None
                    failures += 1
                    if failures >= self.cfg.max_attempts:
                        raise
                    self._sleep(failures)
        finally:
            client.close()

    def _ranged(self, start: int, first_client: HttpClient, first: Opened) -> None:
        cfg = self.cfg
        chunks = [
            (s, min(s + cfg.chunk_bytes, self.rf.size))
            for s in range(start, self.rf.size, cfg.chunk_bytes)
        ]
        lock = threading.Lock()
        queue = iter(chunks[1:])  # the first chunk is already open: its worker starts with it
        window = cfg.chunk_bytes * max(cfg.window_chunks, cfg.range_connections)

        def worker(client: HttpClient, first_chunk: tuple[int, int] | None) -> None:
            try:
                if first_chunk is not None:
                    self._fetch_chunk(client, first_chunk, first)
                while not self._stop.is_set():
                    with lock:
                        chunk = next(queue, None)
                    if chunk is None:
                        return
                    self.hasher.wait_room(chunk[0], window, self._stop)
                    self._fetch_chunk(client, chunk, None)
            except BaseException as exc:
                self._errors.append(exc)
                self._stop.set()
            finally:
                client.close()

        threads = [threading.Thread(target=worker, args=(first_client, chunks[0]), daemon=True)]
        for _ in range(min(cfg.range_connections, len(chunks)) - 1):
            threads.append(
                threading.Thread(
                    target=worker, args=(HttpClient(cfg.stall_timeout_s), None), daemon=True
                )
            )
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _fetch_chunk(
        self, client: HttpClient, chunk: tuple[int, int], opened: Opened | None
    ) -> None:
        begin, end = chunk
        buf = bytearray(end - begin)
        got, failures = 0, 0
        while got < len(buf):
            self._check_cancel()
            try:
                if opened is None:
                    opened = self._open(client, begin + got, end - 1)
                    if not opened.ranged:
                        raise TransientTransferError(
                            f"{self._what(begin)}: Range no longer honoured"
                        )
                while got < len(buf):
                    self._check_cancel()
                    n = min(self.cfg.buffer_bytes, len(buf) - got)
                    read_into(opened, memoryview(buf)[got : got + n], self._what(begin + got))
                    got += n
                    failures = 0
                    self.on_bytes(n)
            except TransientTransferError:
                client.close()
                opened = None
                failures += 1
                if failures >= self.cfg.max_attempts:
                    raise
                self._sleep(failures)
        self._write(memoryview(buf), begin)
        self.hasher.submit(begin, buf)  # handed over: this worker allocates a new buffer

    # ---- helpers
    def _open(self, client: HttpClient, start: int, end: int | None) -> Opened:
        opened = client.open(self.target, start, end, self._what(start))
        total = opened.total
        if total is not None and total != self.rf.size:
            self._wrong_size(opened, total)
        return opened

    def _wrong_size(self, opened: Opened, total: int) -> None:
        head = opened.response.read(512) if opened.start == 0 and total < 4096 else b""
        if looks_like_lfs_pointer(head):
            raise UnsafeRepository(
                f"{self.rf.path}: the mirror served a Git LFS pointer file instead of the content"
            )
        raise ChecksumMismatch(
            f"{self.rf.path}: size mismatch, the listing says {self.rf.size} bytes,"
            f" the mirror serves {total}"
        )

    def _retrying(self, fn: Callable[[], Opened], where: str) -> Opened:
        failures = 0
        while True:
            self._check_cancel()
            try:
                return fn()
            except TransientTransferError:
                failures += 1
                if failures >= self.cfg.max_attempts:
                    raise
                self._sleep(failures)

    def _skip(self, opened: Opened, n: int) -> None:
        buf = bytearray(min(n, self.cfg.buffer_bytes))
        while n > 0:
            k = min(n, len(buf))
            read_into(opened, memoryview(buf)[:k], self._what(0))
            n -= k

    def _sleep(self, failures: int) -> None:
        if self.cancel.wait(self.cfg.backoff(failures)):
            raise Cancelled(f"{self.rf.path}: cancelled")

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise Cancelled(f"{self.rf.path}: cancelled")
        if self._stop.is_set() and self._errors:
            raise Cancelled(f"{self.rf.path}: another range failed")

    def _check_errors(self) -> None:
        real = [e for e in self._errors if not isinstance(e, Cancelled)]
        if real or self._errors:
            raise (real or self._errors)[0]

    def _write(self, view: memoryview, offset: int) -> None:
        try:
            while len(view):
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(f"{self.rf.path}: no space left on the cache volume") from exc
            raise

    def _reserve(self, fd: int, size: int) -> None:
        # Reserve the whole file up front: a full disk fails now, not after most of the transfer.
        if size == 0:
            return
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(
                    f"{self.rf.path}: no space left on the cache volume for {size} bytes"
                ) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise

    def _rehash_prefix(self, fd: int, n: int) -> None:
        pos = 0
        while pos < n:
            data = os.pread(fd, min(self.cfg.chunk_bytes, n - pos), pos)
            if not data:
                raise TransientTransferError(f"{self.rf.path}: temp file shorter than recorded")
            self.hasher.update_in_order(data)
            pos += len(data)

    def _verify(self) -> FileDigest:
        h = self.hasher
        if h.offset != self.rf.size:
            raise TransientTransferError(
                f"{self.rf.path}: {h.offset} of {self.rf.size} bytes hashed"
            )
        sha256 = h.sha256.hexdigest()
        git_oid = h.sha1.hexdigest() if h.sha1 is not None else (self.rf.git_oid or "")
        if looks_like_lfs_pointer(h.head):
            raise UnsafeRepository(
                f"{self.rf.path}: the content is a Git LFS pointer file, not the weights"
            )
        if self.rf.sha256 is not None and sha256 != self.rf.sha256:
            raise ChecksumMismatch(
                f"{self.rf.path}: sha256 mismatch, expected {self.rf.sha256}, got {sha256}"
            )
        if self.rf.sha256 is None and self.rf.git_oid and git_oid != self.rf.git_oid:
            raise ChecksumMismatch(
                f"{self.rf.path}: git blob sha1 mismatch, expected {self.rf.git_oid}, got {git_oid}"
            )
        return FileDigest(size=self.rf.size, sha256=sha256, git_oid=git_oid)

    def _what(self, offset: int) -> str:
        return f"{self.rf.path} at byte {offset}"


def discard_temp(tmp: Path) -> None:
    for p in (tmp, prefix_path(tmp)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
