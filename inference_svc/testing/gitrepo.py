"""Commit a directory of files into a git repository with Git LFS pointers, no git-lfs binary.

The layout is what olah's offline "mirrors" mode reads: a non-bare repository whose LFS objects
live under `<repo>/.git/lfs/objects/<oid[0:2]>/<oid[2:4]>/<oid>` and whose tree holds pointers.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Files matching these globs are always stored through LFS, like on the Hub.
LFS_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.bin", "*.pt")
DEFAULT_LFS_THRESHOLD = 10 * 1024 * 1024  # the Hub's own limit for plain git files

_SHA1_RE = re.compile(r"^[0-9a-f]{40}$")
_REF_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
_LFS_VERSION = "https://git-lfs.github.com/spec/v1"


class GitRepoError(RuntimeError):
    """A git command failed or the input cannot be committed."""


@dataclass(frozen=True)
class CommittedFile:
    """One file of a commit as the Hub would describe it."""

    path: str  # POSIX path inside the repository
    size: int  # size of the real content (not of the pointer)
    blob_id: str  # git blob sha1 of what is in the tree (the pointer for LFS files)
    sha256: str | None  # sha256 of the content for LFS files, None for plain git files


@dataclass(frozen=True)
class Commit:
    """The result of `GitLfsRepo.commit_dir`."""

    sha: str  # 40-hex commit id
    files: tuple[CommittedFile, ...]

    def file(self, path: str) -> CommittedFile:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The Git LFS pointer text for an object (the exact bytes git-lfs writes)."""
    return f"version {_LFS_VERSION}\noid sha256:{sha256}\nsize {size}\n".encode()


def lfs_object_path(repo_dir: Path, sha256: str) -> Path:
    """Where git-lfs (and olah) keep the object `sha256` of the repository at `repo_dir`."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    return repo_dir / ".git" / "lfs" / "objects" / sha256[:2] / sha256[2:4] / sha256


def _git_identity_env() -> dict[str, str]:
    # Fixed identity so commits never depend on the user's git config.
    return {
        "GIT_AUTHOR_NAME": "mirror-fixture",
        "GIT_AUTHOR_EMAIL": "mirror-fixture@localhost",
        "GIT_COMMITTER_NAME": "mirror-fixture",
        "GIT_COMMITTER_EMAIL": "mirror-fixture@localhost",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
    }


class GitLfsRepo:
    """A non-bare git repository (empty working tree) that snapshots directories into branches."""

    def __init__(self, path: Path, *, lfs_threshold: int = DEFAULT_LFS_THRESHOLD) -> None:
        if lfs_threshold < 0:
            raise ValueError(f"lfs_threshold must be >= 0, got {lfs_threshold}")
        self.path = path
        self.lfs_threshold = lfs_threshold
        if not (path / ".git").is_dir():
            path.mkdir(parents=True, exist_ok=True)
            self._git("init", "--quiet", "--initial-branch=main")

    def _git(
        self, *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None
    ) -> str:
        full_env = {**os.environ, **_git_identity_env(), **(env or {})}
        proc = subprocess.run(
            ["git", "-C", str(self.path), *args],
            input=stdin,
            capture_output=True,
            env=full_env,
            check=False,
        )
        if proc.returncode != 0:
            raise GitRepoError(
                f"git {' '.join(args)} failed ({proc.returncode}): {proc.stderr.decode(errors='replace')}"
            )
        return proc.stdout.decode().strip()

    def lfs_object_path(self, sha256: str) -> Path:
        """Where the LFS object with this oid lives (it may not exist)."""
        return lfs_object_path(self.path, sha256)

    def _is_lfs(self, rel: str, size: int) -> bool:
        name = rel.rsplit("/", 1)[-1]
        return size > self.lfs_threshold or any(Path(name).match(p) for p in LFS_PATTERNS)

    def _store_lfs_object(self, src: Path) -> tuple[str, int]:
        h = hashlib.sha256()
        with src.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        oid = h.hexdigest()
        dst = self.lfs_object_path(oid)
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(f".{oid}.tmp")
            shutil.copyfile(src, tmp)
            tmp.replace(dst)
        return oid, src.stat().st_size

    def _hash_blob(self, data: bytes) -> str:
        return self._git("hash-object", "-w", "--stdin", stdin=data)

    def commit_dir(
        self,
        src_dir: Path,
        *,
        branch: str = "main",
        message: str = "publish",
        parent: str | None = None,
    ) -> Commit:
        """Commit the whole content of `src_dir` as the new tip of `branch` (a full snapshot).

        The parent is the current tip of `branch` (or `parent` if given); files absent from
        `src_dir` are absent from the new commit. Returns the commit and its file list.
        """
        if not _REF_NAME_RE.match(branch) or ".." in branch:
            raise ValueError(f"invalid branch name: {branch!r}")
        if not src_dir.is_dir():
            raise GitRepoError(f"not a directory: {src_dir}")
        paths = sorted(p for p in src_dir.rglob("*") if p.is_file())
        if any(p.name == ".gitattributes" for p in paths):
            raise GitRepoError(".gitattributes is generated by the fixture; remove it from src_dir")
        if not paths:
            raise GitRepoError(f"nothing to commit: {src_dir} has no files")

        files: list[CommittedFile] = []
        lfs_paths: list[str] = []
        index_entries: list[tuple[str, str]] = []
        for p in paths:
            rel = p.relative_to(src_dir).as_posix()
            size = p.stat().st_size
            if self._is_lfs(rel, size):
                oid, size = self._store_lfs_object(p)
                blob = self._hash_blob(lfs_pointer(oid, size))
                files.append(CommittedFile(rel, size, blob, oid))
                if not any(Path(rel).match(pat) for pat in LFS_PATTERNS):
                    lfs_paths.append(rel)
            else:
                blob = self._hash_blob(p.read_bytes())
                files.append(CommittedFile(rel, size, blob, None))
            index_entries.append((blob, rel))

        attrs = "".join(f"{pat} filter=lfs diff=lfs merge=lfs -text\n" for pat in LFS_PATTERNS)
        attrs += "".join(f"/{rel} filter=lfs diff=lfs merge=lfs -text\n" for rel in lfs_paths)
        attrs_bytes = attrs.encode()
        attrs_blob = self._hash_blob(attrs_bytes)
        files.append(CommittedFile(".gitattributes", len(attrs_bytes), attrs_blob, None))
        index_entries.append((attrs_blob, ".gitattributes"))

        if parent is None:
            parent = self._try_resolve(f"refs/heads/{branch}")
        # A private index file keeps the (empty) working tree and the default index untouched.
        with tempfile.TemporaryDirectory() as tmp:
            env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            listing = "".join(f"100644 {blob}\t{rel}\n" for blob, rel in index_entries)
            self._git("update-index", "--add", "--index-info", stdin=listing.encode(), env=env)
            tree = self._git("write-tree", env=env)
        parent_args = ["-p", parent] if parent else []
        sha = self._git("commit-tree", tree, *parent_args, "-m", message)
        self._git("update-ref", f"refs/heads/{branch}", sha)
        files.sort(key=lambda f: f.path)
        return Commit(sha=sha, files=tuple(files))

    def tag(self, name: str, revision: str) -> str:
        """Create (or move) a lightweight tag; returns the tagged commit."""
        if not _REF_NAME_RE.match(name) or ".." in name:
            raise ValueError(f"invalid tag name: {name!r}")
        sha = self.resolve(revision)
        self._git("update-ref", f"refs/tags/{name}", sha)
        return sha

    def resolve(self, revision: str) -> str:
        """The 40-hex commit a revision (branch, tag, commit) names."""
        sha = self._try_resolve(revision)
        if sha is None:
            raise GitRepoError(f"revision not found: {revision!r}")
        return sha

    def _try_resolve(self, revision: str) -> str | None:
        try:
            sha = self._git("rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
        except GitRepoError:
            return None
        assert _SHA1_RE.match(sha), sha
        return sha
