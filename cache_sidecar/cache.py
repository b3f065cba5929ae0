"""The weight cache: make `repo@commit` present (fetch, verify, publish once per node), report it,
pin and lease it, evict by LRU under a byte budget. The CLI and the gRPC server both drive this.

Locks (see `store.py`): revision lock for the whole ensure, repo lock shared while fetching and
exclusive while deleting blobs, blob lock per download, meta lock for short state edits.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cache_sidecar.errors import (
    BranchNotAllowed,
    Cancelled,
    ChecksumMismatch,
    DiskFull,
    ErrorCode,
    InvalidCheckpoint,
    MirrorUnreachable,
    OfflineMiss,
    SidecarError,
    UnsafeRepository,
)
from cache_sidecar.eviction import Evictor, EvictResult, RevisionInfo
from cache_sidecar.fetch import FetchConfig, FileDigest, FileDownload, discard_temp, prefix_path
from cache_sidecar.locks import check_locks_exclude
from cache_sidecar.manifest import Manifest, ManifestFile
from cache_sidecar.progress import RevisionProgress, State
from cache_sidecar.refs import ModelRef
from cache_sidecar.safety import select_files, validate_safetensors
from cache_sidecar.sources.base import RemoteFile, Source
from cache_sidecar.store import RevisionState, Store, repo_folder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheConfig:
    cache_dir: Path
    budget_bytes: int | None = None  # None: no budget (the volume's free space still applies)
    offline: bool = False
    attempts: int = 3  # whole-revision attempts on retryable errors (mirror unreachable)
    retry_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")


@dataclass(frozen=True)
class Published:
    repo: str
    commit: str
    path: Path
    manifest_digest: str
    manifest: Manifest


class WeightCache:
    def __init__(
        self, cfg: CacheConfig, source: Source | None, fetch_cfg: FetchConfig | None = None
    ) -> None:
        self.cfg = cfg
        self.source = source
        self.fetch_cfg = fetch_cfg or FetchConfig()
        self.store = Store(cfg.cache_dir)
        check_locks_exclude(self.store.lock_dir)
        self.evictor = Evictor(self.store, cfg.budget_bytes)
        self._resolved: dict[tuple[str, str], str] = {}  # branch resolutions, once per process
        self._resolved_lock = threading.Lock()

    # ---- ensure
    def ensure(
        self,
        ref: ModelRef,
        progress: RevisionProgress | None = None,
        cancel: threading.Event | None = None,
        attempts: int | None = None,
    ) -> Published:
        """Return the published revision, fetching and publishing it first if needed."""
        progress = progress or RevisionProgress(ref.repo, ref.revision)
        cancel = cancel or threading.Event()
        attempts = attempts or self.cfg.attempts
        for attempt in range(1, attempts + 1):
            try:
                pub = self._ensure_once(ref, progress, cancel)
            except SidecarError as err:
                last = attempt == attempts or not err.retryable or cancel.is_set()
                progress.fail(err, retrying=not last)
                if last:
                    raise
                delay = min(30.0, self.cfg.retry_backoff_s * 2 ** (attempt - 1))
                progress.update(
                    error_message=f"{err.message}; retrying in {delay:.1f}s"
                    f" (attempt {attempt} of {attempts})"
                )
                log.warning("%s; retrying in %.1fs", err.message, delay)
                if cancel.wait(delay):
                    raise Cancelled(f"{ref}: cancelled") from err
                continue
            if not ref.pinned and self.store.read_ref(ref.repo, ref.revision) != pub.commit:
                self.store.write_ref(ref.repo, ref.revision, pub.commit)  # record the resolution
            progress.update(
                state=State.READY,
                commit=pub.commit,
                local_path=str(pub.path),
                manifest_digest=pub.manifest_digest,
                error_code=ErrorCode.ERROR_CODE_UNSPECIFIED,
                error_message="",
            )
            return pub
        raise AssertionError("unreachable")

    def resolve(self, ref: ModelRef) -> str:
        if ref.pinned:
            return ref.revision
        if not ref.allow_branch:
            raise BranchNotAllowed(
                f"{ref}: {ref.revision!r} is a branch or tag, which can move; pin a 40-hex commit"
                " ('org/name@<commit>') or pass --allow-branch to resolve it once"
            )
        key = (ref.repo, ref.revision)
        with self._resolved_lock:
            if key in self._resolved:
                return self._resolved[key]
        recorded = self.store.read_ref(ref.repo, ref.revision)
        if self.cfg.offline or self.source is None:
            if recorded is None:
                raise OfflineMiss(
                    f"{ref}: offline, and this branch was never resolved on this volume;"
                    " fetch it once with the mirror reachable"
                )
            commit = recorded
        else:
            try:
                commit = self.source.resolve(ref.repo, ref.revision)
            except MirrorUnreachable:
                if recorded is None:
                    raise
                log.warning("%s: mirror unreachable, using the recorded commit %s", ref, recorded)
                commit = recorded
        with self._resolved_lock:
            commit = self._resolved.setdefault(key, commit)
        log.info("%s resolved to commit %s (recorded; not followed again)", ref, commit)
        return commit

    def published(self, repo: str, commit: str) -> Published | None:
        pub = self.store.published(repo, commit)
        if pub is None or not self.store.snapshot_dir(repo, commit).is_dir():
            return None
        return Published(repo, commit, self.store.snapshot_dir(repo, commit), pub[1], pub[0])

    def _ensure_once(
        self, ref: ModelRef, progress: RevisionProgress, cancel: threading.Event
    ) -> Published:
        commit = self.resolve(ref)
        progress.update(commit=commit)
        repo = ref.repo
        pub = self.published(repo, commit)
        if pub is not None:
            self.store.touch(repo, commit)
            return pub
        if self.cfg.offline:
            raise OfflineMiss(
                f"{repo}@{commit}: offline mode and the revision is not on this volume"
            )
        if self.source is None:
            raise OfflineMiss(f"{repo}@{commit}: no mirror configured and the revision is not here")
        lock = self.store.revision_lock(repo, commit)
        if not lock.acquire(timeout_s=0):
            progress.update(state=State.PENDING, error_message="another process is fetching it")
            lock.acquire(cancel=cancel)
        try:
            pub = self.published(repo, commit)  # the other process may have published it
            if pub is not None:
                self.store.touch(repo, commit)
                return pub
            files = self._list_files(repo, commit, progress)
            # Before the shared repo lock: evicting an older revision of this same repo needs the
            # repo lock exclusively, which our own shared hold would refuse.
            self._make_room(repo, commit, files)
            repo_lock = self.store.repo_lock(repo, shared=True)
            repo_lock.acquire(cancel=cancel)
            try:
                return self._fetch_and_publish(ref, commit, files, progress, cancel)
            finally:
                repo_lock.release()
        finally:
            lock.release()

    def _list_files(self, repo: str, commit: str, progress: RevisionProgress) -> list[RemoteFile]:
        assert self.source is not None
        # A cheap, bounded call first: huggingface_hub retries tree listings on its own for ~30s,
        # so an unreachable mirror or an unknown commit is reported from here instead.
        self.source.resolve(repo, commit)
        files = select_files(self.source.list_files(repo, commit), repo)
        if not files:
            raise UnsafeRepository(f"{repo}@{commit}: the revision lists no files")
        progress.set_files(files)
        progress.update(
            state=State.FETCHING, error_code=ErrorCode.ERROR_CODE_UNSPECIFIED, error_message=""
        )
        return files

    def _fetch_and_publish(
        self,
        ref: ModelRef,
        commit: str,
        files: list[RemoteFile],
        progress: RevisionProgress,
        cancel: threading.Event,
    ) -> Published:
        assert self.source is not None
        repo = ref.repo
        digests = self._fetch_all(repo, commit, files, progress, cancel)
        progress.update(state=State.VERIFYING)
        for f in files:
            if f.path.endswith(".safetensors"):
                validate_safetensors(self.store.blob_path(repo, f.blob_name), f.path)
        manifest = Manifest(
            repo=repo,
            commit=commit,
            revision=ref.revision,
            source_kind=self.source.kind,
            source_location=self.source.location,
            created_unix=time.time(),
            files=tuple(
                ManifestFile(
                    path=f.path,
                    size=f.size,
                    sha256=digests[f.path].sha256,
                    blob=f.blob_name,
                    git_oid=f.git_oid,
                    lfs=f.is_lfs,
                )
                for f in sorted(files, key=lambda f: f.path)
            ),
        )
        path, digest = self.store.publish(manifest, ref=None if ref.pinned else ref.revision)
        self.store.touch(repo, commit)
        log.info("published %s@%s at %s (%s)", repo, commit, path, digest)
        return Published(repo, commit, path, digest, manifest)

    def _fetch_all(
        self,
        repo: str,
        commit: str,
        files: list[RemoteFile],
        progress: RevisionProgress,
        cancel: threading.Event,
    ) -> dict[str, FileDigest]:
        stop = threading.Event()  # one failure stops the others; their temps stay for a resume

        def follow_cancel() -> None:
            while not stop.wait(0.2):
                if cancel.is_set():
                    stop.set()

        threading.Thread(target=follow_cancel, daemon=True).start()
        digests: dict[str, FileDigest] = {}
        cfg = dataclasses.replace(
            self.fetch_cfg,
            range_connections=self.fetch_cfg.ranges_per_file([f.size for f in files]),
        )
        # Largest first: the long transfers start at once, the small ones fill the gaps.
        order = sorted(files, key=lambda f: -f.size)
        try:
            with concurrent.futures.ThreadPoolExecutor(self.fetch_cfg.parallel_files) as pool:
                futures = {
                    pool.submit(self._fetch_blob, repo, commit, f, progress, stop, cfg): f
                    for f in order
                }
                try:
                    for fut in concurrent.futures.as_completed(futures):
                        digests[futures[fut].path] = fut.result()
                except BaseException:
                    stop.set()
                    raise
        finally:
            stop.set()
        return digests

    def _fetch_blob(
        self,
        repo: str,
        commit: str,
        rf: RemoteFile,
        progress: RevisionProgress,
        stop: threading.Event,
        cfg: FetchConfig,
    ) -> FileDigest:
        assert self.source is not None
        blob = rf.blob_name
        lock = self.store.blob_lock(repo, blob)
        lock.acquire(cancel=stop)
        try:
            if self.store.has_blob(repo, blob):
                digest = self._existing_digest(repo, rf)
                progress.file_done(rf.path, digest.sha256)
                return digest
            tmp = self._adopt_temp(repo, blob)
            download = FileDownload(
                self.source.target(repo, commit, rf.path),
                rf,
                tmp,
                cfg,
                on_bytes=lambda n: progress.add_bytes(rf.path, n),
                cancel=stop,
            )
            try:
                digest = download.run()
            except (ChecksumMismatch, UnsafeRepository, InvalidCheckpoint, DiskFull):
                discard_temp(tmp)  # bad bytes are never resumed from
                progress.file_restart(rf.path)
                raise
            except BaseException:
                progress.file_restart(rf.path)
                raise
            self.store.install_blob(repo, blob, tmp)
            progress.file_done(rf.path, digest.sha256)
            return digest
        finally:
            lock.release()

    def _adopt_temp(self, repo: str, blob: str) -> Path:
        """A new unique temp path, taking over the best temp a dead or failed fetch left behind.

        The caller holds the blob lock, so no live process writes any of those temps.
        """
        stem = f"{repo_folder(repo)}.{blob}"
        tmp = self.store.new_temp(stem)
        best, best_prefix = None, 0
        for old in self.store.temps_for(stem):
            try:
                value = int(prefix_path(old).read_text())
            except (FileNotFoundError, ValueError):
                value = 0
            if value > best_prefix:
                if best is not None:
                    discard_temp(best)
                best, best_prefix = old, value
            else:
                discard_temp(old)
        if best is not None:
            os.replace(prefix_path(best), prefix_path(tmp))
            os.replace(best, tmp)
            log.info("resuming %s from byte %d", blob, best_prefix)
        return tmp

    def _existing_digest(self, repo: str, rf: RemoteFile) -> FileDigest:
        if rf.sha256 is not None:
            return FileDigest(rf.size, rf.sha256, rf.git_oid or "")
        # Plain git files are small: hash once for the manifest's sha256.
        data = self.store.blob_path(repo, rf.blob_name).read_bytes()
        return FileDigest(len(data), hashlib.sha256(data).hexdigest(), rf.git_oid or "")

    # ---- budget and eviction
    def _make_room(self, repo: str, commit: str, files: list[RemoteFile]) -> None:
        def missing() -> int:
            return sum(f.size for f in files if not self.store.has_blob(repo, f.blob_name))

        needed = missing()
        free = shutil.disk_usage(self.store.root).free
        if needed > free:
            raise DiskFull(
                f"{repo}@{commit} needs {needed} more bytes, the cache volume has {free} free"
            )
        # Evicting a revision that shares blobs with this one deletes them, so more is missing
        # afterwards; repeat while the count grew.
        while True:
            self.evictor.make_room(repo, commit, needed)
            now_missing = missing()
            if now_missing <= needed:
                return
            needed = now_missing

    def evict(self, repo: str, commit: str, force: bool = False) -> EvictResult:
        return self.evictor.evict(repo, commit, force)

    def gc(self) -> int:
        """Evict LRU revisions until under budget, drop temps and blobs nobody owns; bytes freed."""
        return self.evictor.gc()

    def set_pin(
        self, repo: str, commit: str, pinned: bool, lease_holder: str = ""
    ) -> RevisionState:
        return self.evictor.set_pin(repo, commit, pinned, lease_holder)

    def state(self, repo: str, commit: str) -> RevisionState:
        return self.store.read_state(repo, commit)

    def revisions(self) -> list[RevisionInfo]:
        return self.evictor.revisions()

    def verify(self, repo: str, commit: str) -> list[str]:
        """Re-hash a published revision; the problems found (empty: intact)."""
        pub = self.published(repo, commit)
        if pub is None:
            return [f"{repo}@{commit} is not published in {self.store.root}"]
        problems = []
        for f in pub.manifest.files:
            path = pub.path / f.path
            try:
                h = hashlib.sha256()
                size = 0
                with open(path, "rb") as fh:
                    while chunk := fh.read(8 * 1024 * 1024):
                        h.update(chunk)
                        size += len(chunk)
            except OSError as exc:
                problems.append(f"{f.path}: unreadable ({exc.strerror})")
                continue
            if size != f.size:
                problems.append(f"{f.path}: {size} bytes, the manifest says {f.size}")
            elif h.hexdigest() != f.sha256:
                problems.append(f"{f.path}: sha256 {h.hexdigest()} != manifest {f.sha256}")
        return problems
