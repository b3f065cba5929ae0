"""GitLfsRepo writes what git and git-lfs would: pointers in the tree, objects under .git/lfs."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from inference_svc.testing.gitrepo import GitLfsRepo, GitRepoError, lfs_pointer


def _git(repo: GitLfsRepo, *args: str) -> bytes:
    return subprocess.run(
        ["git", "-C", str(repo.path), *args], check=True, capture_output=True
    ).stdout


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_pointer_is_the_git_lfs_spec_text() -> None:
    oid = "ab" * 32
    assert lfs_pointer(oid, 1234) == (
        b"version https://git-lfs.github.com/spec/v1\noid sha256:" + oid.encode() + b"\nsize 1234\n"
    )


def test_commit_stores_lfs_pointers_and_objects(tmp_path: Path) -> None:
    weights = bytes(range(256)) * 4
    big = b"x" * 101
    src = _write(
        tmp_path / "src",
        {"w.safetensors": weights, "big.json": big, "sub/small.txt": b"hi\n"},
    )
    repo = GitLfsRepo(tmp_path / "repo", lfs_threshold=100)
    commit = repo.commit_dir(src, message="first")

    assert repo.resolve("main") == commit.sha
    assert _git(repo, "log", "--format=%s", "main").decode() == "first\n"
    for rel, data in (("w.safetensors", weights), ("big.json", big)):
        oid = hashlib.sha256(data).hexdigest()
        assert _git(repo, "cat-file", "blob", f"main:{rel}") == lfs_pointer(oid, len(data))
        assert repo.lfs_object_path(oid).read_bytes() == data
        f = commit.file(rel)
        assert (f.size, f.sha256) == (len(data), oid)
        assert f.blob_id == _git(repo, "rev-parse", f"main:{rel}").decode().strip()
    assert _git(repo, "cat-file", "blob", "main:sub/small.txt") == b"hi\n"
    assert commit.file("sub/small.txt").sha256 is None
    attrs = _git(repo, "cat-file", "blob", "main:.gitattributes").decode()
    assert "*.safetensors filter=lfs diff=lfs merge=lfs -text" in attrs
    assert "/big.json filter=lfs diff=lfs merge=lfs -text" in attrs
    assert "small.txt" not in attrs


def test_commits_are_snapshots_with_parents_branches_and_tags(tmp_path: Path) -> None:
    repo = GitLfsRepo(tmp_path / "repo")
    first = repo.commit_dir(_write(tmp_path / "a", {"a.txt": b"1", "b.txt": b"2"})).sha
    repo.tag("v1", "main")
    second = repo.commit_dir(_write(tmp_path / "b", {"a.txt": b"3"})).sha
    other = repo.commit_dir(_write(tmp_path / "c", {"c.txt": b"4"}), branch="dev").sha

    assert _git(repo, "rev-parse", f"{second}^").decode().strip() == first
    assert _git(repo, "ls-tree", "--name-only", "main").decode().split() == [
        ".gitattributes",
        "a.txt",
    ]
    assert (repo.resolve("main"), repo.resolve("v1"), repo.resolve("dev")) == (second, first, other)
    assert repo.resolve(first[:8]) == first
    with pytest.raises(GitRepoError, match="revision not found"):
        repo.resolve("nope")


def test_bad_input_is_refused(tmp_path: Path) -> None:
    repo = GitLfsRepo(tmp_path / "repo")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GitRepoError, match="nothing to commit"):
        repo.commit_dir(tmp_path / "empty")
    with pytest.raises(GitRepoError, match="not a directory"):
        repo.commit_dir(tmp_path / "missing")
    src = _write(tmp_path / "src", {".gitattributes": b"* -text\n"})
    with pytest.raises(GitRepoError, match="gitattributes"):
        repo.commit_dir(src)
    with pytest.raises(ValueError, match="branch"):
        repo.commit_dir(src, branch="../x")
    with pytest.raises(ValueError, match="sha256"):
        repo.lfs_object_path("abc")
    with pytest.raises(ValueError, match="lfs_threshold"):
        GitLfsRepo(tmp_path / "r2", lfs_threshold=-1)
