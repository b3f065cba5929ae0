"""Disk budget and eviction: least-recently-used published revisions go first; pinned or leased
ones never (leases are held by readers such as inference pods, through the gRPC API).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from cache_sidecar.errors import DiskFull
from cache_sidecar.store import RevisionState, Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RevisionInfo:
    repo: str
    commit: str
    size_bytes: int
    pinned: bool
    leases: tuple[str, ...]
    last_used: float
    path: Path
    manifest_digest: str


@dataclass(frozen=True)
class EvictResult:
    evicted: bool
    freed_bytes: int
    message: str


class Evictor:
    """Budget decisions under the store's meta lock; deletions under the revision and repo locks."""

    def __init__(self, store: Store, budget_bytes: int | None) -> None:
        self.store = store
        self.budget_bytes = budget_bytes

    def revisions(self) -> list[RevisionInfo]:
        infos = []
        for repo, commit in self.store.iter_published():
            pub = self.store.published(repo, commit)
            snapshot = self.store.snapshot_dir(repo, commit)
            if pub is None or not snapshot.is_dir():
                continue
            state = self.store.read_state(repo, commit)
            infos.append(
                RevisionInfo(
                    repo=repo,
                    commit=commit,
                    size_bytes=pub[0].total_bytes,
                    pinned=state.pinned,
                    leases=tuple(sorted(state.leases)),
                    last_used=state.last_used,
                    path=snapshot,
                    manifest_digest=pub[1],
                )
            )
        return infos

    def make_room(self, repo: str, commit: str, needed: int) -> None:
        """Evict until `needed` more bytes fit the budget, or raise `DiskFull` saying why not."""
        budget = self.budget_bytes
        if budget is None:
            return
        with self.store.meta_lock():
            used = self.store.used_bytes()
            if used + needed <= budget:
                return
            for info in self._candidates(exclude=(repo, commit)):
                result = self._evict_locked(info.repo, info.commit, force=False)
                if result.evicted:
                    log.info(
                        "evicted %s@%s (%d bytes) for %s",
                        info.repo,
                        info.commit,
                        result.freed_bytes,
                        repo,
                    )
                used = self.store.used_bytes()
                if used + needed <= budget:
                    return
        raise DiskFull(
            f"{repo}@{commit} needs {needed} bytes; {used} of the {budget}-byte budget are held by"
            " pinned, leased or in-use revisions; raise the budget or unpin one"
        )

    def _candidates(self, exclude: tuple[str, str]) -> list[RevisionInfo]:
        infos = [i for i in self.revisions() if (i.repo, i.commit) != exclude]
        return sorted(
            (i for i in infos if not i.pinned and not i.leases), key=lambda i: i.last_used
        )

    def evict(self, repo: str, commit: str, force: bool = False) -> EvictResult:
        with self.store.meta_lock():
            return self._evict_locked(repo, commit, force)

    def _evict_locked(self, repo: str, commit: str, force: bool) -> EvictResult:
        if self.store.published(repo, commit) is None:
            return EvictResult(False, 0, f"{repo}@{commit} is not published here")
        state = self.store.read_state(repo, commit)
        if state.leases:
            holders = ", ".join(sorted(state.leases))
            return EvictResult(False, 0, f"{repo}@{commit} is leased by {holders}")
        if state.pinned and not force:
            return EvictResult(False, 0, f"{repo}@{commit} is pinned (force to evict it anyway)")
        rev_lock = self.store.revision_lock(repo, commit)
        if not rev_lock.acquire(timeout_s=0):
            return EvictResult(False, 0, f"{repo}@{commit} is being fetched or published")
        try:
            repo_lock = self.store.repo_lock(repo, shared=False)
            if not repo_lock.acquire(timeout_s=0):
                return EvictResult(False, 0, f"{repo} has a fetch in progress; try again later")
            try:
                freed = self.store.remove_revision(repo, commit)
            finally:
                repo_lock.release()
        finally:
            rev_lock.release()
        return EvictResult(True, freed, f"evicted {repo}@{commit}, {freed} bytes freed")

    def gc(self) -> int:
        freed = 0
        with self.store.meta_lock():
            budget = self.budget_bytes
            if budget is not None:
                for info in self._candidates(exclude=("", "")):
                    if self.store.used_bytes() <= budget:
                        break
                    freed += self._evict_locked(info.repo, info.commit, force=False).freed_bytes
        return freed + self.store.sweep()

    def set_pin(
        self, repo: str, commit: str, pinned: bool, lease_holder: str = ""
    ) -> RevisionState:
        """Pin (no holder) or lease (named holder) a revision, published or not yet."""
        with self.store.meta_lock():
            state = self.store.read_state(repo, commit)
            if lease_holder:
                if pinned:
                    state.leases[lease_holder] = time.time()
                else:
                    state.leases.pop(lease_holder, None)
            else:
                state.pinned = pinned
            self.store.write_state(repo, commit, state)
            return state
