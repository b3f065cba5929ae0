"""Model references: `org/name@<40-hex commit>`; branches and tags only when explicitly allowed."""

from __future__ import annotations

import re
from dataclasses import dataclass

from cache_sidecar.errors import InvalidReference

_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# Git ref names: no "..", no leading "-" or "/", no control characters or spaces.
_BRANCH_RE = re.compile(r"^(?!.*\.\.)(?!-)(?!/)[A-Za-z0-9._/-]{1,200}(?<!/)(?<!\.lock)$")


def is_commit(revision: str) -> bool:
    return bool(_COMMIT_RE.match(revision))


@dataclass(frozen=True)
class ModelRef:
    """A repository at a revision. `revision` is what was asked; a commit is 40 lowercase hex."""

    repo: str
    revision: str
    allow_branch: bool = False

    def __post_init__(self) -> None:
        if not _REPO_RE.match(self.repo) or ".." in self.repo:
            raise InvalidReference(f"invalid repository {self.repo!r}: expected 'org/name'")
        if not self.revision:
            raise InvalidReference(
                f"{self.repo}: a revision is required, as '{self.repo}@<40-hex commit>'"
            )
        if not is_commit(self.revision) and not _BRANCH_RE.match(self.revision):
            raise InvalidReference(f"{self.repo}: invalid revision {self.revision!r}")

    @property
    def pinned(self) -> bool:
        return is_commit(self.revision)

    @classmethod
    def parse(cls, text: str, allow_branch: bool = False) -> ModelRef:
        repo, sep, revision = text.strip().partition("@")
        if not sep:
            raise InvalidReference(
                f"{text!r}: a revision is required, as 'org/name@<40-hex commit>'"
                " (or a branch with --allow-branch)"
            )
        return cls(repo=repo, revision=revision, allow_branch=allow_branch)

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}"
