"""WeightCache against the olah mirror: fetch, verify, publish as a Hugging Face cache, corruption."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache_sidecar.errors import BranchNotAllowed, ChecksumMismatch, OfflineMiss
from cache_sidecar.progress import RevisionProgress, State
from cache_sidecar.refs import ModelRef
from inference_svc.testing.mirror import MirrorFixture

from .conftest import make_cache


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_fetch_publishes_the_mirror_bytes_as_a_hf_cache(
    olah: MirrorFixture, tiny_model: Path, tmp_path: Path
) -> None:
    commit = olah.publish("org/tiny", tiny_model)
    cache = make_cache(tmp_path / "vol", olah.url)
    progress = RevisionProgress("org/tiny", commit)
    pub = cache.ensure(ModelRef("org/tiny", commit), progress)

    assert pub.path == tmp_path / "vol" / "models--org--tiny" / "snapshots" / commit
    published = _tree(pub.path)
    expected = _tree(tiny_model)
    expected_names = set(expected) | {".gitattributes"}  # the fixture's git repo adds it
    assert set(published) == expected_names
    for name, data in expected.items():
        assert published[name] == data, name
    view = progress.view()
    assert view.state == State.READY
    assert view.files_done == len(expected_names)
    assert view.bytes_done == view.bytes_total == sum(len(d) for d in published.values())
    assert pub.manifest_digest.startswith("sha256:")
    for f in pub.manifest.files:
        assert f.sha256 == hashlib.sha256(published[f.path]).hexdigest()
    # Snapshot entries are relative links into blobs/, as huggingface_hub lays them out.
    link = pub.path / "config.json"
    assert link.is_symlink() and os.readlink(link).startswith("../../blobs/")
    # A second ensure is a cache hit: same digest, nothing refetched.
    assert cache.ensure(ModelRef("org/tiny", commit)).manifest_digest == pub.manifest_digest
    assert cache.verify("org/tiny", commit) == []


def test_offline_transformers_loads_the_published_revision(
    olah: MirrorFixture, tiny_model: Path, tmp_path: Path
) -> None:
    commit = olah.publish("org/tiny-load", tiny_model)
    cache = make_cache(tmp_path / "vol", olah.url)
    cache.ensure(ModelRef("org/tiny-load", commit))
    code = (
        "import sys, torch\n"
        "from huggingface_hub import snapshot_download\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"p = snapshot_download('org/tiny-load', revision='{commit}')\n"
        f"m = AutoModelForCausalLM.from_pretrained('org/tiny-load', revision='{commit}')\n"
        f"t = AutoTokenizer.from_pretrained('org/tiny-load', revision='{commit}')\n"
        "ids = t('hello world', return_tensors='pt').input_ids\n"
        "print(p); print(m(ids).logits.shape[-1])\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "vol"),
        "HF_ENDPOINT": "http://127.0.0.1:9",  # nothing listens there: offline must not need it
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == str(tmp_path / "vol" / "models--org--tiny-load" / "snapshots" / commit)
    reference = __import__("json").loads((tiny_model / "config.json").read_text())["vocab_size"]
    assert int(lines[-1]) == reference


def test_corrupted_byte_is_never_published_and_a_fixed_mirror_succeeds(
    olah: MirrorFixture, tiny_model: Path, tmp_path: Path
) -> None:
    commit = olah.publish("org/tiny-bad", tiny_model)
    cache = make_cache(tmp_path / "vol", olah.url)
    shard = cache.source.list_files("org/tiny-bad", commit)  # type: ignore[union-attr]
    victim = next(f for f in shard if f.path.endswith(".safetensors"))
    assert victim.sha256 is not None
    obj = olah.lfs_object_path("org/tiny-bad", victim.sha256)
    good = obj.read_bytes()
    obj.write_bytes(good[:1000] + bytes([good[1000] ^ 0x01]) + good[1001:])
    progress = RevisionProgress("org/tiny-bad", commit)

    with pytest.raises(ChecksumMismatch) as err:
        cache.ensure(ModelRef("org/tiny-bad", commit), progress)

    assert victim.path in err.value.message and "sha256 mismatch" in err.value.message
    assert progress.view().state == State.FAILED
    assert progress.view().error_message == err.value.message
    assert cache.published("org/tiny-bad", commit) is None
    assert not (tmp_path / "vol" / "models--org--tiny-bad" / "snapshots").exists()
    assert not (tmp_path / "vol" / "models--org--tiny-bad" / "blobs" / victim.sha256).exists()
    assert list((tmp_path / "vol" / ".weightcache" / "tmp").glob(f"*{victim.sha256}*")) == []

    obj.write_bytes(good)
    pub = cache.ensure(ModelRef("org/tiny-bad", commit))
    assert (pub.path / victim.path).read_bytes() == good


def test_branch_needs_allow_branch_and_is_recorded(
    olah: MirrorFixture, tiny_model: Path, tmp_path: Path
) -> None:
    commit = olah.publish("org/tiny-branch", tiny_model)
    cache = make_cache(tmp_path / "vol", olah.url)
    with pytest.raises(BranchNotAllowed, match="--allow-branch"):
        cache.ensure(ModelRef("org/tiny-branch", "main"))
    pub = cache.ensure(ModelRef("org/tiny-branch", "main", allow_branch=True))
    assert pub.commit == commit
    ref = tmp_path / "vol" / "models--org--tiny-branch" / "refs" / "main"
    assert ref.read_text() == commit
    # Offline, the recorded resolution serves; an unknown branch fails at once.
    offline = make_cache(tmp_path / "vol", None, offline=True)
    assert offline.ensure(ModelRef("org/tiny-branch", "main", allow_branch=True)).commit == commit
    with pytest.raises(OfflineMiss, match="offline"):
        offline.ensure(ModelRef("org/tiny-branch", "dev", allow_branch=True))
    with pytest.raises(OfflineMiss, match="not on this volume"):
        offline.ensure(ModelRef("org/tiny-branch", "f" * 40))


def test_manifest_is_found_from_the_snapshot_path(
    olah: MirrorFixture, tiny_model: Path, tmp_path: Path
) -> None:
    from cache_sidecar.manifest import manifest_digest, read_manifest
    from cache_sidecar.store import manifest_for_snapshot

    commit = olah.publish("org/tiny-manifest", tiny_model)
    pub = make_cache(tmp_path / "vol", olah.url).ensure(ModelRef("org/tiny-manifest", commit))
    path = manifest_for_snapshot(pub.path)
    manifest, digest = read_manifest(path)
    assert digest == pub.manifest_digest == manifest_digest(path.read_bytes())
    assert (manifest.repo, manifest.commit, manifest.source_kind) == (
        "org/tiny-manifest",
        commit,
        "hf-mirror",
    )
    assert manifest.total_bytes == sum((pub.path / f.path).stat().st_size for f in manifest.files)
