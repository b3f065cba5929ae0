"""The one interface every weight source implements: resolve a revision, list files, address bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RemoteFile:
    """One file of a revision as the source lists it. `sha256` is the contract for LFS files."""

    path: str
    size: int
    git_oid: str | None = None  # git blob sha1 of the content (non-LFS) or of the pointer (LFS)
    sha256: str | None = None  # LFS files: the sha256 of the content

    @property
    def is_lfs(self) -> bool:
        return self.sha256 is not None

    @property
    def blob_name(self) -> str:
        """Name under `blobs/`, as Hugging Face names it: sha256 for LFS files, git oid otherwise."""
        name = self.sha256 or self.git_oid
        if not name:
            raise ValueError(f"{self.path}: the source gives neither an LFS sha256 nor a git oid")
        return name


@dataclass(frozen=True)
class HttpTarget:
    """Where a file's bytes are: a URL and the headers to send (auth). Headers are never logged."""

    url: str
    headers: dict[str, str] = field(default_factory=dict, repr=False)


class Source(Protocol):
    """A place weights come from. Implementations raise `cache_sidecar.errors.SidecarError` subclasses."""

    kind: str
    location: str  # shown in manifests and messages; never contains credentials

    def resolve(self, repo: str, revision: str) -> str:
        """The 40-hex commit a revision (commit, branch or tag) points to now."""
        ...

    def list_files(self, repo: str, commit: str) -> list[RemoteFile]:
        """Every file of the commit, recursively, with sizes and (for LFS files) sha256."""
        ...

    def target(self, repo: str, commit: str, path: str) -> HttpTarget:
        """The HTTP request that returns the file's content."""
        ...
