"""A real Hugging Face mirror for tests: olah 0.5.4 in offline mode serving git+LFS repos from disk.

`MirrorFixture` starts olah on 127.0.0.1 (port 0) in a temp dir and publishes directories as
commits; `huggingface_hub` talks to it through `HF_ENDPOINT=fixture.url` with no other setting.
What olah does, found by experiment (tests/testing/test_mirror.py pins what clients rely on):

- Revisions: `/api/models/{repo}/revision/{rev}` resolves branches, tags, full and abbreviated
  commits. `model_info(repo)` WITHOUT a revision fails (401 RepositoryNotFound): offline olah
  looks for the newest commit in its own cache dir, never in the git mirror. Always pass one.
- Tree: `/api/models/{repo}/tree/{rev}` answers 307 to `.../tree/{rev}/` (huggingface_hub
  follows it). LFS entries carry `lfs.oid` (sha256 taken from the POINTER, so it stays right
  when the object at the mirror is corrupted), `lfs.size`, `lfs.pointerSize`; every entry's
  `oid` is the git blob sha1 (of the pointer for LFS files). One page, no `Link` header.
- Files: HEAD `/{repo}/resolve/{rev}/{path}` gives `content-length`, `x-repo-commit` and an
  unquoted `etag`: git blob sha1 for plain files, and for LFS files the sha256 of the bytes
  currently ON DISK (computed per HEAD), so a corrupted object is downloaded by huggingface_hub
  without complaint. No `X-Linked-Etag`/`X-Linked-Size`, no Xet headers (so hf_xet is never
  used). GET answers 200 chunked with no `content-length`/`etag`; `Range` is ignored (200, full
  body); each LFS object is read whole into memory (keep test files small).
- Errors: an unknown repo, branch or tag gives 401 `{"error": "Repository not found"}`
  (`RepositoryNotFoundError`). A missing path: HEAD 401 at a branch, 404 `EntryNotFound` at a
  full sha; GET 500 (olah's KeyError). An unknown full 40-hex sha gives 500 everywhere.
- `HfApi.list_repo_commits` raises KeyError 'user' (olah's authors lack it); refs, tree,
  paths-info, model_info(revision=...), hf_hub_download and snapshot_download all work.
- A plain blob of 121-149 bytes that parses as an LFS pointer is taken for one.
- New commits are visible at once (olah opens the repo per request, no metadata caching for
  mirrors). olah's own cache dir and logs are kept inside the fixture's temp dir.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import NoReturn

from inference_svc.testing.gitrepo import DEFAULT_LFS_THRESHOLD, GitLfsRepo, lfs_object_path

_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_LISTENING_RE = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


class MirrorStartError(RuntimeError):
    """olah did not come up; the message carries the tail of its log."""


def _check_repo_id(repo_id: str) -> None:
    if not _REPO_ID_RE.match(repo_id) or ".." in repo_id:
        raise ValueError(f"repo_id must look like 'org/name', got {repo_id!r}")


def _die_with_parent() -> None:
    # Runs in the child before exec: if the test process dies without stop() (SIGKILL, a crash,
    # a forgotten fixture), the kernel sends olah SIGTERM. Linux only; elsewhere a no-op.
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


class MirrorFixture:
    """olah in offline mode on loopback, serving model repos that tests publish into it.

    Use as a context manager; `stop()` kills olah's whole process group and removes the temp dir.
    """

    def __init__(
        self,
        *,
        lfs_threshold: int = DEFAULT_LFS_THRESHOLD,
        startup_timeout_s: float = 60.0,
        keep_dir: bool = False,
    ) -> None:
        self._lfs_threshold = lfs_threshold
        self._startup_timeout_s = startup_timeout_s
        self._keep_dir = keep_dir
        self._root: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> MirrorFixture:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Launch olah and wait until it listens; on failure raise MirrorStartError, clean up."""
        if self._proc is not None:
            raise RuntimeError("mirror already started")
        self._root = Path(tempfile.mkdtemp(prefix="olah-mirror-"))
        try:
            self._proc = self._launch(self._root)
            self._port = self._wait_listening()
        except BaseException:
            self.stop()
            raise

    def _launch(self, root: Path) -> subprocess.Popen[bytes]:
        (root / "mirrors" / "models").mkdir(parents=True)
        config = root / "olah.toml"
        # port 0: uvicorn binds a free port and logs it; mirror-netloc is only used by olah's
        # HTML index page, so its "127.0.0.1:0" default is harmless. JSON strings are TOML strings.
        config.write_text(
            "[basic]\n"
            'host = "127.0.0.1"\n'
            "port = 0\n"
            f"repos-path = {json.dumps(str(root / 'olah-cache'))}\n"
            f"mirrors-path = [{json.dumps(str(root / 'mirrors'))}]\n"
            "[accessibility]\n"
            "offline = true\n"
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        log_args = ["--log-path", str(root / "olah-logs")]
        with self.log_path.open("wb") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "olah.server", "-c", str(config), *log_args],
                cwd=root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group, killed as one in stop()
                preexec_fn=_die_with_parent,
            )

    def _wait_listening(self) -> int:
        assert self._proc is not None
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            match = _LISTENING_RE.search(self.log_path.read_text(errors="replace"))
            if match:
                port = int(match.group(1))
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    return port
            if self._proc.poll() is not None:
                self._fail(f"olah exited with code {self._proc.returncode} during startup")
            time.sleep(0.05)
        self._fail(f"olah did not listen within {self._startup_timeout_s:.0f}s")

    def _fail(self, why: str) -> NoReturn:
        tail = self.log_path.read_text(errors="replace")[-4000:]
        print(f"--- olah log ({self.log_path}) ---\n{tail}", file=sys.stderr)
        raise MirrorStartError(f"{why}; log {self.log_path}, its tail:\n{tail}")

    def stop(self) -> None:
        """Kill olah's process group and remove the temp dir; safe to call twice."""
        proc, self._proc, self._port = self._proc, None, None
        if proc is not None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            # The leader may be gone while stragglers of its group are not: finish them.
            _signal_group(proc.pid, signal.SIGKILL)
        root, self._root = self._root, None
        if root is not None and not self._keep_dir:
            shutil.rmtree(root, ignore_errors=True)

    # -- where things are -------------------------------------------------------------------

    @property
    def root(self) -> Path:
        if self._root is None:
            raise RuntimeError("mirror not started")
        return self._root

    @property
    def log_path(self) -> Path:
        return self.root / "olah.out"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("mirror not started")
        return self._proc.pid

    @property
    def url(self) -> str:
        """The HF_ENDPOINT of this mirror."""
        if self._port is None:
            raise RuntimeError("mirror not started")
        return f"http://127.0.0.1:{self._port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for a process that should use this mirror through huggingface_hub."""
        # Xet is disabled to be explicit: olah sends no Xet headers, so it would not be used.
        return {
            "HF_ENDPOINT": self.url,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1",
        }

    def repo_dir(self, repo_id: str) -> Path:
        """Where the git repository behind `repo_id` lives (it may not exist yet)."""
        _check_repo_id(repo_id)
        return self.root / "mirrors" / "models" / repo_id

    def repo(self, repo_id: str) -> GitLfsRepo:
        """The git repository behind `repo_id` (created empty on first use)."""
        return GitLfsRepo(self.repo_dir(repo_id), lfs_threshold=self._lfs_threshold)

    # -- publishing -------------------------------------------------------------------------

    def publish(
        self, repo_id: str, src_dir: Path, *, branch: str = "main", message: str = "publish"
    ) -> str:
        """Commit all of `src_dir` as the new tip of `branch`; returns the 40-hex commit."""
        return self.repo(repo_id).commit_dir(src_dir, branch=branch, message=message).sha

    def tag(self, repo_id: str, name: str, revision: str) -> str:
        """Point tag `name` at `revision`; returns the commit."""
        return self.repo(repo_id).tag(name, revision)

    def lfs_object_path(self, repo_id: str, sha256: str) -> Path:
        """The file olah serves for the LFS object `sha256` (tests may corrupt it)."""
        return lfs_object_path(self.repo_dir(repo_id), sha256)
