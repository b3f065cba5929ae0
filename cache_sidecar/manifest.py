"""The manifest of a published revision: written last, by atomic rename; its presence means READY."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

SCHEMA = 1


@dataclass(frozen=True)
class ManifestFile:
    path: str
    size: int
    sha256: str  # of the content, computed while it was written
    blob: str  # name under blobs/ (LFS sha256 or git oid, as Hugging Face names blobs)
    git_oid: str | None = None
    lfs: bool = False


@dataclass(frozen=True)
class Manifest:
    repo: str
    commit: str
    revision: str  # as asked (a commit, or the branch it was resolved from)
    source_kind: str
    source_location: str
    created_unix: float
    files: tuple[ManifestFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        body = asdict(self)
        body["schema"] = SCHEMA
        body["files"] = [asdict(f) for f in self.files]
        body["total_bytes"] = self.total_bytes
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        body = json.loads(data)
        if body.get("schema") != SCHEMA:
            raise ValueError(f"unknown manifest schema {body.get('schema')!r}")
        return cls(
            repo=body["repo"],
            commit=body["commit"],
            revision=body["revision"],
            source_kind=body["source_kind"],
            source_location=body["source_location"],
            created_unix=float(body["created_unix"]),
            files=tuple(ManifestFile(**f) for f in body["files"]),
        )


def manifest_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def read_manifest(path: Path) -> tuple[Manifest, str]:
    """The manifest at `path` and its digest (`sha256:<hex>` of the file's bytes)."""
    data = path.read_bytes()
    return Manifest.from_json(data), manifest_digest(data)
