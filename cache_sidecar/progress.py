"""Observable state of one revision's ensure: what Watch and Ensure stream and the CLI's bar shows."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cache_sidecar.errors import ErrorCode, SidecarError
from cache_sidecar.sources.base import RemoteFile


class State(enum.IntEnum):
    """Mirrors `weightcache.v1.State` value for value."""

    STATE_UNSPECIFIED = 0
    PENDING = 1
    FETCHING = 2
    VERIFYING = 3
    READY = 4
    FAILED = 5
    EVICTED = 6


@dataclass(frozen=True)
class FileView:
    path: str
    size: int
    bytes_done: int
    sha256: str
    done: bool


@dataclass(frozen=True)
class RevisionView:
    """An immutable copy of a revision's progress at one moment."""

    repo: str
    revision: str
    commit: str
    state: State
    bytes_done: int
    bytes_total: int
    files: tuple[FileView, ...]
    local_path: str = ""
    manifest_digest: str = ""
    error_code: ErrorCode = ErrorCode.ERROR_CODE_UNSPECIFIED
    error_message: str = ""
    version: int = 0

    @property
    def files_done(self) -> int:
        return sum(1 for f in self.files if f.done)


@dataclass
class _File:
    size: int
    sha256: str
    bytes_done: int = 0
    done: bool = False


@dataclass
class RevisionProgress:
    """Mutable, thread-safe progress; every change bumps `version` and wakes waiters."""

    repo: str
    revision: str
    commit: str = ""
    state: State = State.PENDING
    local_path: str = ""
    manifest_digest: str = ""
    error_code: ErrorCode = ErrorCode.ERROR_CODE_UNSPECIFIED
    error_message: str = ""
    on_change: Callable[[RevisionView], None] | None = None
    _files: dict[str, _File] = field(default_factory=dict)
    _version: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def view(self) -> RevisionView:
        with self._cond:
            return self._view_locked()

    def _view_locked(self) -> RevisionView:
        files = tuple(
            FileView(p, f.size, f.bytes_done, f.sha256, f.done) for p, f in self._files.items()
        )
        return RevisionView(
            repo=self.repo,
            revision=self.revision,
            commit=self.commit,
            state=self.state,
            bytes_done=sum(f.bytes_done for f in files),
            bytes_total=sum(f.size for f in files),
            files=files,
            local_path=self.local_path,
            manifest_digest=self.manifest_digest,
            error_code=self.error_code,
            error_message=self.error_message,
            version=self._version,
        )

    def _changed(self) -> RevisionView:
        self._version += 1
        self._cond.notify_all()
        return self._view_locked()

    def _emit(self, view: RevisionView) -> None:
        # Outside the lock: listeners may read other revisions' progress.
        if self.on_change is not None:
            self.on_change(view)

    def update(self, **changes: object) -> None:
        with self._cond:
            for k, v in changes.items():
                setattr(self, k, v)
            view = self._changed()
        self._emit(view)

    def set_files(self, files: list[RemoteFile]) -> None:
        with self._cond:
            self._files = {f.path: _File(f.size, f.sha256 or "") for f in files}
            view = self._changed()
        self._emit(view)

    def add_bytes(self, path: str, n: int) -> None:
        with self._cond:
            self._files[path].bytes_done += n
            view = self._changed()
        self._emit(view)

    def file_done(self, path: str, sha256: str) -> None:
        with self._cond:
            f = self._files[path]
            f.bytes_done, f.sha256, f.done = f.size, sha256, True
            view = self._changed()
        self._emit(view)

    def file_restart(self, path: str) -> None:
        with self._cond:
            self._files[path].bytes_done = 0
            view = self._changed()
        self._emit(view)

    def fail(self, err: SidecarError, retrying: bool = False) -> None:
        self.update(
            state=State.PENDING if retrying else State.FAILED,
            error_code=err.code,
            error_message=err.message,
        )

    def wait_change(self, after_version: int, timeout_s: float) -> RevisionView:
        """The next view newer than `after_version` (or the current one when `timeout_s` passes)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._version <= after_version:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._view_locked()
