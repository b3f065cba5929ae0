"""The olah mirror fixture serves published commits to huggingface_hub, and olah's quirks hold."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError
from safetensors.numpy import save_file

from inference_svc.testing.gitrepo import lfs_pointer
from inference_svc.testing.mirror import MirrorFixture, MirrorStartError

LFS_THRESHOLD = 4096  # small, so that a plain file above it exercises the size rule


def _write_tiny_checkpoint(root: Path, seed: int) -> Path:
    """Two safetensors shards with an index, a config, and a tokenizer file above LFS_THRESHOLD."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    shards = {
        "model-00001-of-00002.safetensors": {"embed.weight": rng.standard_normal((16, 8))},
        "model-00002-of-00002.safetensors": {"head.weight": rng.standard_normal((8, 16))},
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_file({k: v.astype(np.float32) for k, v in tensors.items()}, str(root / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 2 * 16 * 8 * 4}, "weight_map": weight_map})
    )
    (root / "config.json").write_text(json.dumps({"hidden_size": 8, "seed": seed}))
    vocab = {f"tok{i}_{seed}": i for i in range(400)}
    (root / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    assert (root / "tokenizer.json").stat().st_size > LFS_THRESHOLD
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".cache" not in p.parts
    }


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(scope="module")
def mirror() -> Iterator[MirrorFixture]:
    with MirrorFixture(lfs_threshold=LFS_THRESHOLD) as m:
        yield m


@pytest.fixture(scope="module")
def published(mirror: MirrorFixture, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    src = _write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "v1", seed=1)
    return mirror.publish("org/tiny", src, message="first"), src


def test_stop_leaves_no_process_and_no_dir() -> None:
    m = MirrorFixture()
    with m:
        pid, root = m.pid, m.root
        os.killpg(pid, 0)  # alive: its process group exists
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{m.url}/api/models/org/none/revision/main")
        assert info.value.code == 401  # olah's answer for a repo it does not have
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert not root.exists()
    m.stop()  # idempotent


def test_failed_start_reports_and_cleans_up() -> None:
    m = MirrorFixture(startup_timeout_s=0.0)
    with pytest.raises(MirrorStartError, match="did not listen") as info:
        m.start()
    match = re.search(r"log (/\S+)/olah\.out", str(info.value))
    assert match, str(info.value)
    root = match.group(1)
    assert not Path(root).exists()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert root not in cmdline.read_bytes().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue


def test_snapshot_download_has_identical_bytes(
    mirror: MirrorFixture, published: tuple[str, Path], tmp_path: Path
) -> None:
    commit, src = published
    path = snapshot_download("org/tiny", revision=commit, cache_dir=tmp_path, endpoint=mirror.url)
    got = _files(Path(path))
    assert got.pop(".gitattributes").startswith(b"*.safetensors filter=lfs")
    assert got == _files(src)
    assert Path(path).name == commit


def test_revisions_resolve_to_commits(
    mirror: MirrorFixture, published: tuple[str, Path], tmp_path: Path
) -> None:
    commit, _ = published
    api = HfApi(endpoint=mirror.url)
    mirror.tag("org/tiny", "v1.0", commit)
    dev = mirror.publish("org/tiny", _write_tiny_checkpoint(tmp_path / "dev", seed=7), branch="dev")
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    assert dev != commit
    assert api.model_info("org/tiny", revision="main").sha == commit
    assert api.model_info("org/tiny", revision="v1.0").sha == commit
    assert api.model_info("org/tiny", revision=commit).sha == commit
    assert api.model_info("org/tiny", revision=commit[:7]).sha == commit
    assert api.model_info("org/tiny", revision="dev").sha == dev
    refs = api.list_repo_refs("org/tiny")
    assert {b.name: b.target_commit for b in refs.branches} == {"main": commit, "dev": dev}
    assert {t.name: t.target_commit for t in refs.tags} == {"v1.0": commit}


def test_new_commit_moves_main_and_old_commit_stays_fetchable(
    mirror: MirrorFixture, tmp_path: Path
) -> None:
    api = HfApi(endpoint=mirror.url)
    v1 = _write_tiny_checkpoint(tmp_path / "v1", seed=1)
    first = mirror.publish("org/moving", v1)
    v2 = _write_tiny_checkpoint(tmp_path / "v2", seed=2)
    second = mirror.publish("org/moving", v2, message="update weights")
    assert api.model_info("org/moving", revision="main").sha == second
    old = snapshot_download(
        "org/moving", revision=first, cache_dir=tmp_path / "c", endpoint=mirror.url
    )
    new = snapshot_download(
        "org/moving", revision="main", cache_dir=tmp_path / "c", endpoint=mirror.url
    )
    assert Path(new).name == second
    for name, data in _files(v1).items():
        assert (Path(old) / name).read_bytes() == data
    for name, data in _files(v2).items():
        assert (Path(new) / name).read_bytes() == data


def test_tree_lists_sha256_of_lfs_files_and_blob_ids_of_the_rest(
    mirror: MirrorFixture, published: tuple[str, Path]
) -> None:
    commit, src = published
    entries = list(
        HfApi(endpoint=mirror.url).list_repo_tree("org/tiny", revision=commit, recursive=True)
    )
    files = {e.path: e for e in entries}
    expected = _files(src)
    assert set(files) == {*expected, ".gitattributes"}
    lfs = {p for p, e in files.items() if getattr(e, "lfs", None) is not None}
    assert lfs == {p for p in expected if p.endswith(".safetensors")} | {"tokenizer.json"}
    for path, data in expected.items():
        entry = files[path]
        assert entry.size == len(data)
        if path in lfs:
            assert entry.lfs.sha256 == hashlib.sha256(data).hexdigest()
            assert entry.lfs.size == len(data)
        else:
            assert entry.blob_id == _git_blob_sha1(data)


def test_raw_tree_redirects_to_trailing_slash(
    mirror: MirrorFixture, published: tuple[str, Path]
) -> None:
    commit, src = published

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: object, **kwargs: object) -> None:
            return None

    url = f"{mirror.url}/api/models/org/tiny/tree/{commit}"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.build_opener(NoRedirect).open(f"{url}?recursive=true")
    assert info.value.code == 307
    assert info.value.headers["Location"].endswith(f"/tree/{commit}/?recursive=true")
    with urllib.request.urlopen(f"{url}/?recursive=true") as resp:
        entries = {e["path"]: e for e in json.load(resp)}
    data = (src / "model-00001-of-00002.safetensors").read_bytes()
    assert entries["model-00001-of-00002.safetensors"]["lfs"] == {
        "oid": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "pointerSize": len(lfs_pointer(hashlib.sha256(data).hexdigest(), len(data))),
    }


def test_corrupted_object_keeps_listed_sha256_but_is_served(
    mirror: MirrorFixture, tmp_path: Path
) -> None:
    src = _write_tiny_checkpoint(tmp_path / "src", seed=3)
    commit = mirror.publish("org/corrupt", src)
    name = "model-00001-of-00002.safetensors"
    good = (src / name).read_bytes()
    oid = hashlib.sha256(good).hexdigest()
    obj = mirror.lfs_object_path("org/corrupt", oid)
    bad = bytearray(obj.read_bytes())
    bad[-1] ^= 0xFF
    obj.write_bytes(bytes(bad))
    (entry,) = HfApi(endpoint=mirror.url).get_paths_info("org/corrupt", [name], revision=commit)
    assert entry.lfs.sha256 == oid  # from the pointer in git
    # olah's etag is the sha256 of the bytes on disk, so huggingface_hub accepts the bad bytes:
    # verifying against the listed sha256 is the client's job.
    path = hf_hub_download(
        "org/corrupt", name, revision=commit, cache_dir=tmp_path / "c", endpoint=mirror.url
    )
    assert Path(path).read_bytes() == bytes(bad)


def test_range_header_is_ignored(mirror: MirrorFixture, published: tuple[str, Path]) -> None:
    commit, src = published
    data = (src / "model-00002-of-00002.safetensors").read_bytes()
    url = f"{mirror.url}/org/tiny/resolve/{commit}/model-00002-of-00002.safetensors"
    req = urllib.request.Request(url, headers={"Range": "bytes=10-19"})
    with urllib.request.urlopen(req) as resp:
        assert resp.status == 200
        assert resp.headers.get("Content-Range") is None
        assert resp.headers.get("Content-Length") is None  # chunked
        assert resp.read() == data
    head = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(head) as resp:
        assert resp.headers["Content-Length"] == str(len(data))
        assert resp.headers["X-Repo-Commit"] == commit
        assert resp.headers["ETag"] == hashlib.sha256(data).hexdigest()
        assert resp.headers.get("X-Linked-Etag") is None


def test_missing_revisions_raise_repository_not_found(
    mirror: MirrorFixture, published: tuple[str, Path]
) -> None:
    api = HfApi(endpoint=mirror.url)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/tiny")  # olah offline cannot resolve an absent revision
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/tiny", revision="no-such-branch")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/absent", revision="main")


def _status(url: str, method: str) -> tuple[int, str | None]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method)) as resp:
            return resp.status, resp.headers.get("X-Error-Code")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("X-Error-Code")


@pytest.mark.parametrize(
    ("revision", "path", "head", "get"),
    [
        ("main", "config.json", (200, None), (200, None)),
        ("main", "absent.json", (401, "RepoNotFound"), (500, None)),
        ("COMMIT", "absent.json", (404, "EntryNotFound"), (500, None)),
        ("no-such-branch", "config.json", (401, "RepoNotFound"), (401, "RepoNotFound")),
        ("0" * 40, "config.json", (500, None), (500, None)),  # unknown full sha: GitPython error
    ],
)
def test_resolve_status_codes(
    mirror: MirrorFixture,
    published: tuple[str, Path],
    revision: str,
    path: str,
    head: tuple[int, str | None],
    get: tuple[int, str | None],
) -> None:
    commit, _ = published
    url = f"{mirror.url}/org/tiny/resolve/{revision.replace('COMMIT', commit)}/{path}"
    assert _status(url, "HEAD") == head
    assert _status(url, "GET") == get


def test_publish_rejects_bad_repo_ids(mirror: MirrorFixture, tmp_path: Path) -> None:
    for bad in ("noorg", "a/b/c", "../x", "org/.."):
        with pytest.raises(ValueError, match="org/name"):
            mirror.publish(bad, tmp_path)


def test_env_points_a_fresh_process_at_the_mirror(
    mirror: MirrorFixture, published: tuple[str, Path], tmp_path: Path
) -> None:
    # huggingface_hub reads HF_ENDPOINT once at import: a child process is the honest check.
    commit, src = published
    code = (
        "import sys; from huggingface_hub import HfApi, snapshot_download; "
        "print(HfApi().model_info('org/tiny', revision='main').sha); "
        "print(snapshot_download('org/tiny', revision='main', cache_dir=sys.argv[1]))"
    )
    env = {**os.environ, **mirror.env}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, check=True
    ).stdout.decode()
    sha, path = out.split()
    assert sha == commit
    assert _files(Path(path)).keys() >= _files(src).keys()


def test_olah_dies_with_a_test_process_that_never_stopped_it() -> None:
    code = (
        "import os; from inference_svc.testing.mirror import MirrorFixture; "
        "m = MirrorFixture(); m.start(); print(m.pid, m.root, flush=True); os._exit(0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    pid_text, root = out.stdout.decode().split()
    pid = int(pid_text)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(pid, signal.SIGKILL)
        pytest.fail("olah outlived the process that started it")
    shutil.rmtree(root)
