"""The node volume: a valid Hugging Face cache (`models--org--name/{blobs,snapshots,refs}`) plus the
sidecar's own `.weightcache/` (manifests, pins and leases, temp files, locks).

Nothing becomes visible half-written: files are written to unique temp files, fsynced, then renamed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cache_sidecar.errors import DiskFull
from cache_sidecar.locks import FileLock
from cache_sidecar.manifest import Manifest, manifest_digest, read_manifest

META_DIR = ".weightcache"
_BLOB_TEMP = re.compile(r"^(models--.+)\.([0-9a-f]{40}|[0-9a-f]{64})\.\d+\.[0-9a-f]{8}\.part$")
STALE_TEMP_S = 3600.0  # other temps (manifest writes, snapshot staging) live for milliseconds


def repo_folder(repo: str) -> str:
    """`org/name` -> `models--org--name`, Hugging Face's cache folder name."""
    return "models--" + repo.replace("/", "--")


def repo_from_folder(folder: str) -> str:
    return folder.removeprefix("models--").replace("--", "/")


@dataclass
class RevisionState:
    """Mutable bookkeeping of one published revision (stored as JSON beside its manifest)."""

    pinned: bool = False
    leases: dict[str, float] = field(default_factory=dict)  # holder -> when taken
    last_used: float = 0.0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_full(exc: OSError, what: str) -> DiskFull | None:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"no space left on the cache volume while writing {what}")
    return None


class Store:
    """Paths and atomic operations on one cache root. Callers hold the locks (see `cache.py`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.meta = root / META_DIR
        self.tmp_dir = self.meta / "tmp"
        self.lock_dir = self.meta / "locks"
        for d in (self.root, self.tmp_dir, self.lock_dir):
            d.mkdir(parents=True, exist_ok=True)

    # ---- paths
    def repo_dir(self, repo: str) -> Path:
        return self.root / repo_folder(repo)

    def blob_path(self, repo: str, blob: str) -> Path:
        return self.repo_dir(repo) / "blobs" / blob

    def snapshot_dir(self, repo: str, commit: str) -> Path:
        return self.repo_dir(repo) / "snapshots" / commit

    def manifest_path(self, repo: str, commit: str) -> Path:
        return self.meta / "manifests" / repo_folder(repo) / f"{commit}.json"

    def state_path(self, repo: str, commit: str) -> Path:
        return self.meta / "state" / repo_folder(repo) / f"{commit}.json"

    def ref_path(self, repo: str, ref: str) -> Path:
        return self.repo_dir(repo) / "refs" / ref

    # ---- locks
    def revision_lock(self, repo: str, commit: str) -> FileLock:
        return FileLock(self.lock_dir / "revisions" / repo_folder(repo) / f"{commit}.lock")

    def blob_lock(self, repo: str, blob: str) -> FileLock:
        return FileLock(self.lock_dir / "blobs" / repo_folder(repo) / f"{blob}.lock")

    def repo_lock(self, repo: str, shared: bool) -> FileLock:
        """Shared while fetching into the repo, exclusive while deleting its blobs."""
        return FileLock(self.lock_dir / "repos" / f"{repo_folder(repo)}.lock", shared=shared)

    def meta_lock(self) -> FileLock:
        """Short critical sections: state files and eviction decisions."""
        return FileLock(self.lock_dir / "meta.lock")

    # ---- temp files
    def new_temp(self, stem: str) -> Path:
        return self.tmp_dir / f"{stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"

    def temps_for(self, stem: str) -> list[Path]:
        return sorted(self.tmp_dir.glob(f"{stem}.*.part"))

    def write_atomic(self, path: Path, data: bytes) -> None:
        tmp = self.new_temp(path.name)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except OSError as exc:
            full = _disk_full(exc, str(path))
            if full is not None:
                raise full from exc
            raise
        finally:
            tmp.unlink(missing_ok=True)

    # ---- blobs
    def has_blob(self, repo: str, blob: str) -> bool:
        # Blobs are only ever renamed into place after verification, so presence means verified.
        return self.blob_path(repo, blob).is_file()

    def install_blob(self, repo: str, blob: str, verified_tmp: Path) -> Path:
        dest = self.blob_path(repo, blob)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(verified_tmp, dest)
        fsync_dir(dest.parent)
        return dest

    # ---- publish
    def publish(self, manifest: Manifest, ref: str | None) -> tuple[Path, str]:
        """Link the snapshot (renamed in whole), then write the manifest last; returns (path, digest)."""
        repo, commit = manifest.repo, manifest.commit
        final = self.snapshot_dir(repo, commit)
        stage = self.tmp_dir / f"snapshot-{commit}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            for f in manifest.files:
                link = stage / f.path
                link.parent.mkdir(parents=True, exist_ok=True)
                # Relative to the final location, as Hugging Face links them.
                target = os.path.relpath(self.blob_path(repo, f.blob), (final / f.path).parent)
                os.symlink(target, link)
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():  # left by a crash between snapshot and manifest: replace whole
                old = self.tmp_dir / f"old-{commit}.{uuid.uuid4().hex[:8]}"
                os.replace(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(stage, final)
            fsync_dir(final.parent)
        except OSError as exc:
            full = _disk_full(exc, f"the snapshot of {repo}@{commit}")
            if full is not None:
                raise full from exc
            raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        data = manifest.to_json()
        self.write_atomic(self.manifest_path(repo, commit), data)
        if ref is not None:
            self.write_ref(repo, ref, commit)
        return final, manifest_digest(data)

    def write_ref(self, repo: str, ref: str, commit: str) -> None:
        self.write_atomic(self.ref_path(repo, ref), commit.encode())

    def read_ref(self, repo: str, ref: str) -> str | None:
        try:
            return self.ref_path(repo, ref).read_text().strip() or None
        except (FileNotFoundError, NotADirectoryError):
            return None

    def published(self, repo: str, commit: str) -> tuple[Manifest, str] | None:
        path = self.manifest_path(repo, commit)
        try:
            return read_manifest(path)
        except FileNotFoundError:
            return None

    def iter_published(self) -> Iterator[tuple[str, str]]:
        base = self.meta / "manifests"
        if not base.is_dir():
            return
        for folder in sorted(base.iterdir()):
            for m in sorted(folder.glob("*.json")):
                yield repo_from_folder(folder.name), m.stem

    # ---- state (callers hold meta_lock for read-modify-write)
    def read_state(self, repo: str, commit: str) -> RevisionState:
        try:
            body = json.loads(self.state_path(repo, commit).read_bytes())
        except FileNotFoundError:
            pub = self.published(repo, commit)
            return RevisionState(last_used=pub[0].created_unix if pub else 0.0)
        return RevisionState(
            pinned=bool(body.get("pinned", False)),
            leases={str(k): float(v) for k, v in body.get("leases", {}).items()},
            last_used=float(body.get("last_used", 0.0)),
        )

    def write_state(self, repo: str, commit: str, state: RevisionState) -> None:
        body = {"pinned": state.pinned, "leases": state.leases, "last_used": state.last_used}
        self.write_atomic(self.state_path(repo, commit), json.dumps(body).encode())

    # ---- usage and removal
    def used_bytes(self) -> int:
        total = 0
        for blobs in self.root.glob("models--*/blobs"):
            for b in blobs.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    total += b.stat().st_size
        for t in self.tmp_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if t.is_file():
                    total += t.stat().st_size
        return total

    def referenced_blobs(self, repo: str, exclude_commit: str | None = None) -> set[str]:
        names: set[str] = set()
        for r, commit in self.iter_published():
            if r == repo and commit != exclude_commit:
                pub = self.published(r, commit)
                if pub is not None:
                    names.update(f.blob for f in pub[0].files)
        return names

    def remove_revision(self, repo: str, commit: str) -> int:
        """Unpublish (manifest first), unlink the snapshot, delete blobs no other revision uses.

        The caller holds the revision lock and the repo lock exclusively. Returns bytes freed.
        """
        pub = self.published(repo, commit)
        self.manifest_path(repo, commit).unlink(missing_ok=True)
        self.state_path(repo, commit).unlink(missing_ok=True)
        snap = self.snapshot_dir(repo, commit)
        if snap.exists():
            old = self.tmp_dir / f"old-{commit}.{uuid.uuid4().hex[:8]}"
            os.replace(snap, old)
            shutil.rmtree(old, ignore_errors=True)
        for ref in self.repo_dir(repo).glob("refs/**/*"):
            if ref.is_file() and ref.read_text().strip() == commit:
                ref.unlink()
        freed = 0
        if pub is not None:
            keep = self.referenced_blobs(repo, exclude_commit=commit)
            for name in {f.blob for f in pub[0].files} - keep:
                path = self.blob_path(repo, name)
                with contextlib.suppress(FileNotFoundError):
                    freed += path.stat().st_size
                    path.unlink()
        return freed

    def sweep(self, stale_after_s: float = STALE_TEMP_S) -> int:
        """Delete what no live fetch owns: blob temps whose lock is free, old staging leftovers,
        and blobs no manifest references in repos with no fetch in progress. Returns bytes freed.
        """
        freed = 0
        now = time.time()
        for entry in list(self.tmp_dir.iterdir()):
            if entry.name.endswith(".prefix"):
                continue  # goes with its .part
            m = _BLOB_TEMP.match(entry.name)
            if m:
                lock = self.blob_lock(repo_from_folder(m.group(1)), m.group(2))
                if lock.acquire(timeout_s=0):
                    try:
                        freed += _remove(entry)
                        freed += _remove(entry.with_name(entry.name + ".prefix"))
                    finally:
                        lock.release()
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.name.startswith("old-") or now - entry.lstat().st_mtime > stale_after_s:
                    freed += _remove(entry)
        for repo_dir in sorted(self.root.glob("models--*")):
            repo = repo_from_folder(repo_dir.name)
            lock = self.repo_lock(repo, shared=False)
            if not lock.acquire(timeout_s=0):
                continue  # a fetch is running in this repo: its new blobs are not orphans
            try:
                keep = self.referenced_blobs(repo)
                blobs = repo_dir / "blobs"
                for blob in sorted(blobs.iterdir()) if blobs.is_dir() else []:
                    if blob.name not in keep:
                        freed += _remove(blob)
            finally:
                lock.release()
        return freed

    def touch(self, repo: str, commit: str) -> None:
        with self.meta_lock():
            state = self.read_state(repo, commit)
            state.last_used = time.time()
            self.write_state(repo, commit, state)


def _remove(path: Path) -> int:
    """Delete a file or a directory tree; the bytes it held."""
    try:
        if path.is_dir() and not path.is_symlink():
            size = sum(
                p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()
            )
            shutil.rmtree(path, ignore_errors=True)
            return size
        size = path.lstat().st_size
        path.unlink()
        return size
    except FileNotFoundError:
        return 0


def manifest_for_snapshot(snapshot: Path) -> Path:
    """The manifest of a published snapshot (`<root>/models--o--n/snapshots/<commit>`)."""
    root, folder = snapshot.parents[2], snapshot.parents[1].name
    return root / META_DIR / "manifests" / folder / f"{snapshot.name}.json"
