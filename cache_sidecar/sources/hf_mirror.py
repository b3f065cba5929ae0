"""Hugging Face-compatible mirror (the Hub, olah, ...): `HfApi` for metadata, plain HTTP for bytes."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import quote

import httpx2
from huggingface_hub import HfApi
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile

from cache_sidecar.errors import MirrorUnreachable, RevisionNotFound, SidecarError
from cache_sidecar.refs import is_commit
from cache_sidecar.sources.base import HttpTarget, RemoteFile

T = TypeVar("T")


class HfMirrorSource:
    """A mirror that speaks the Hub's HTTP API at `endpoint` (what `HF_ENDPOINT` would be)."""

    kind = "hf-mirror"

    def __init__(self, endpoint: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.location = endpoint.rstrip("/")
        self._token = token
        self._timeout_s = timeout_s
        # token=False stops huggingface_hub from reading a token saved on the machine.
        self._api = HfApi(endpoint=self.location, token=token or False)

    def resolve(self, repo: str, revision: str) -> str:
        info = self._call(
            f"{repo}@{revision}",
            lambda: self._api.model_info(repo, revision=revision, timeout=self._timeout_s),
        )
        commit = getattr(info, "sha", None)
        if not isinstance(commit, str) or not is_commit(commit):
            raise RevisionNotFound(
                f"{repo}@{revision}: the mirror at {self.location} did not return a commit for it"
            )
        if is_commit(revision) and commit != revision:
            raise RevisionNotFound(
                f"{repo}@{revision}: the mirror answered with commit {commit}, not the one asked"
            )
        return commit

    def list_files(self, repo: str, commit: str) -> list[RemoteFile]:
        entries = self._call(
            f"{repo}@{commit}",
            lambda: list(self._api.list_repo_tree(repo, revision=commit, recursive=True)),
        )
        files = []
        for entry in entries:
            if not isinstance(entry, RepoFile):
                continue  # folders: their files are listed on their own (recursive)
            files.append(
                RemoteFile(
                    path=entry.path,
                    size=int(entry.size),
                    git_oid=entry.blob_id,
                    sha256=entry.lfs.sha256 if entry.lfs is not None else None,
                )
            )
        return files

    def target(self, repo: str, commit: str, path: str) -> HttpTarget:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        url = f"{self.location}/{repo}/resolve/{commit}/{quote(path, safe='/')}"
        return HttpTarget(url=url, headers=headers)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        # huggingface_hub's shared client has no timeout for tree listings: bound the call here,
        # so a stalled mirror is reported (and retried) instead of hanging the sidecar.
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf-api")
        try:
            return pool.submit(fn).result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError as exc:
            raise MirrorUnreachable(
                f"{what}: the mirror at {self.location} did not answer within {self._timeout_s:g}s"
            ) from exc
        except (RepositoryNotFoundError, GatedRepoError) as exc:
            raise RevisionNotFound(
                f"{what}: repository not found on {self.location} (or not accessible with the token)"
            ) from exc
        except (RevisionNotFoundError, RemoteEntryNotFoundError) as exc:
            raise RevisionNotFound(f"{what}: revision not found on {self.location}") from exc
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            if status >= 500 or status == 429:
                raise MirrorUnreachable(
                    f"{what}: the mirror at {self.location} answered HTTP {status}"
                ) from exc
            if status == 404:
                raise RevisionNotFound(f"{what}: not found on {self.location}") from exc
            raise SidecarError(f"{what}: the mirror answered HTTP {status}") from exc
        except (httpx2.TransportError, OSError) as exc:
            raise MirrorUnreachable(
                f"{what}: cannot reach the mirror at {self.location}: {type(exc).__name__}"
            ) from exc
        finally:
            pool.shutdown(wait=False)
