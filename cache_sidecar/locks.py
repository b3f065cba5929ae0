"""Node-level file locks (flock) shared by every sidecar on a volume; the kernel frees a dead holder's lock.

`check_locks_exclude` refuses volumes whose locks are silently no-ops (some network filesystems).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import threading
import time
from pathlib import Path
from types import TracebackType

from cache_sidecar.errors import Cancelled, LockUnsupported


class FileLock:
    """An exclusive (or shared) flock on `path`, reentrant-unsafe, one per holder.

    The holder's pid and host are written into the file for diagnostics only: correctness rests on
    flock, which the kernel releases when the holding process dies (kill -9 included).
    """

    def __init__(self, path: Path, shared: bool = False) -> None:
        self.path = path
        self.shared = shared
        self._fd: int | None = None

    def acquire(
        self,
        timeout_s: float | None = None,
        cancel: threading.Event | None = None,
        poll_s: float = 0.05,
    ) -> bool:
        """Take the lock; False when `timeout_s` passed first (0 means try once)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise
                if cancel is not None and cancel.is_set():
                    raise Cancelled(f"cancelled while waiting for lock {self.path.name}")
                if deadline is not None and time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(poll_s)
        except BaseException:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        self._fd = fd
        if not self.shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        return True

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def check_locks_exclude(directory: Path) -> None:
    """Raise `LockUnsupported` unless a second flock on the same file is refused while one is held."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".probe-{os.getpid()}-{threading.get_ident()}.lock"
    first = FileLock(probe)
    second = FileLock(probe)
    try:
        if not first.acquire(timeout_s=0):
            raise LockUnsupported(f"cannot take a lock in {directory}")
        # flock locks belong to the open file description, so a second open in this process must
        # be refused; where it is granted the filesystem ignores locks and sharing it is unsafe.
        if second.acquire(timeout_s=0):
            second.release()
            raise LockUnsupported(
                f"file locks on {directory} do not exclude (a network filesystem without lock"
                " support?); several sidecars sharing it could publish half-written data"
            )
    finally:
        first.release()
        probe.unlink(missing_ok=True)
