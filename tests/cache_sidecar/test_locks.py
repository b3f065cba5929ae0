"""flock-based node locks: exclusion, shared mode, recovery after the holder is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from cache_sidecar.locks import FileLock, check_locks_exclude


def test_exclusive_lock_excludes_and_releases(tmp_path: Path) -> None:
    a, b = FileLock(tmp_path / "x.lock"), FileLock(tmp_path / "x.lock")
    assert a.acquire(timeout_s=0)
    assert not b.acquire(timeout_s=0.1)
    a.release()
    assert b.acquire(timeout_s=0)
    b.release()


def test_shared_locks_coexist_and_block_exclusive(tmp_path: Path) -> None:
    s1, s2 = FileLock(tmp_path / "r.lock", shared=True), FileLock(tmp_path / "r.lock", shared=True)
    ex = FileLock(tmp_path / "r.lock")
    assert s1.acquire(timeout_s=0) and s2.acquire(timeout_s=0)
    assert not ex.acquire(timeout_s=0)
    s1.release()
    s2.release()
    assert ex.acquire(timeout_s=0)
    ex.release()


def test_lock_of_a_killed_process_is_recovered(tmp_path: Path) -> None:
    path = tmp_path / "dead.lock"
    code = (
        "import sys, time; from pathlib import Path; from cache_sidecar.locks import FileLock\n"
        f"FileLock(Path({str(path)!r})).acquire(); print('held', flush=True); time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        lock = FileLock(path)
        assert not lock.acquire(timeout_s=0.1)
        assert path.read_text().split()[0] == str(child.pid)  # who holds it, for operators
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert lock.acquire(timeout_s=10)  # the kernel freed it: no wait for a stale-lock timeout
        lock.release()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()


def test_volume_lock_self_check_passes_on_a_local_filesystem(tmp_path: Path) -> None:
    check_locks_exclude(tmp_path / "locks")
    assert list((tmp_path / "locks").iterdir()) == []
