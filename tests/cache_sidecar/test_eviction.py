"""Disk budget and eviction (eviction.py through WeightCache): LRU order, pins and leases never evicted, no partial files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cache_sidecar.cache import WeightCache
from cache_sidecar.errors import DiskFull
from cache_sidecar.refs import ModelRef
from inference_svc.testing.range_mirror import RangeMirror

from .conftest import make_cache, small_repo

REPO_BYTES = 1_200_000  # roughly what small_repo() weighs


def _publish(mirror: RangeMirror, tmp_path: Path, name: str) -> ModelRef:
    commit = mirror.publish(f"org/{name}", small_repo(tmp_path / name))
    return ModelRef(f"org/{name}", commit)


def _nothing_left_of(cache: WeightCache, ref: ModelRef) -> None:
    vol = cache.store.root
    assert cache.published(ref.repo, ref.revision) is None
    assert not cache.store.snapshot_dir(ref.repo, ref.revision).exists()
    blobs = cache.store.repo_dir(ref.repo) / "blobs"
    assert not blobs.exists() or list(blobs.iterdir()) == []
    assert list((vol / ".weightcache" / "tmp").iterdir()) == []


def test_least_recently_used_revision_goes_first(range_mirror: RangeMirror, tmp_path: Path) -> None:
    a, b, c = (_publish(range_mirror, tmp_path, n) for n in "abc")
    cache = make_cache(tmp_path / "vol", range_mirror.url, budget_bytes=int(2.5 * REPO_BYTES))
    cache.ensure(a)
    cache.ensure(b)
    time.sleep(0.01)
    cache.ensure(a)  # a is now more recently used than b
    cache.ensure(c)
    assert {(i.repo, i.commit) for i in cache.revisions()} == {
        (a.repo, a.revision),
        (c.repo, c.revision),
    }
    _nothing_left_of(cache, b)
    assert cache.store.used_bytes() <= 2.5 * REPO_BYTES


def test_pinned_and_leased_revisions_are_never_evicted(
    range_mirror: RangeMirror, tmp_path: Path
) -> None:
    a, b, c = (_publish(range_mirror, tmp_path, n) for n in "abc")
    cache = make_cache(tmp_path / "vol", range_mirror.url, budget_bytes=int(2.5 * REPO_BYTES))
    cache.ensure(a)
    cache.ensure(b)
    cache.set_pin(a.repo, a.revision, True)
    cache.set_pin(b.repo, b.revision, True, lease_holder="pod-1")
    with pytest.raises(DiskFull, match=r"org/c@\w+ needs \d+ bytes; .* pinned, leased"):
        cache.ensure(c)
    assert cache.verify(a.repo, a.revision) == [] and cache.verify(b.repo, b.revision) == []
    _nothing_left_of(cache, c)
    assert not cache.evict(b.repo, b.revision, force=True).evicted  # a lease beats force
    cache.set_pin(b.repo, b.revision, False, lease_holder="pod-1")
    cache.ensure(c)  # b is now evictable, a stays pinned
    assert {i.repo for i in cache.revisions()} == {a.repo, c.repo}


def test_revision_larger_than_the_budget_fails_cleanly(
    range_mirror: RangeMirror, tmp_path: Path
) -> None:
    a = _publish(range_mirror, tmp_path, "big")
    cache = make_cache(tmp_path / "vol", range_mirror.url, budget_bytes=REPO_BYTES // 2)
    with pytest.raises(DiskFull) as err:
        cache.ensure(a)
    assert err.value.code.name == "DISK_FULL" and "raise the budget" in err.value.message
    _nothing_left_of(cache, a)


def test_blobs_shared_by_two_revisions_survive_evicting_one(
    range_mirror: RangeMirror, tmp_path: Path
) -> None:
    src = small_repo(tmp_path / "s")
    first = range_mirror.publish("org/s", src)
    (src / "config.json").write_text('{"model_type": "llama", "v": 2}')
    second = range_mirror.publish("org/s", src)
    cache = make_cache(tmp_path / "vol", range_mirror.url)
    cache.ensure(ModelRef("org/s", first))
    range_mirror.reset_counters()
    cache.ensure(ModelRef("org/s", second))
    assert range_mirror.bytes_served["model.safetensors"] == 0  # the shared blob was reused
    result = cache.evict("org/s", first)
    assert result.evicted and 0 < result.freed_bytes < 1000  # only the old config.json
    assert cache.verify("org/s", second) == []


def test_a_new_commit_of_the_same_repo_evicts_the_old_one(
    range_mirror: RangeMirror, tmp_path: Path
) -> None:
    # The fetch of the new commit holds its repo lock shared; evicting the old commit of that
    # repo needs it exclusively, so room must be made before the fetch takes it.
    first = range_mirror.publish("org/s", small_repo(tmp_path / "s1"))
    second = range_mirror.publish("org/s", small_repo(tmp_path / "s2"))  # new weights
    cache = make_cache(tmp_path / "vol", range_mirror.url, budget_bytes=int(1.5 * REPO_BYTES))
    cache.ensure(ModelRef("org/s", first))
    cache.ensure(ModelRef("org/s", second))
    assert [i.commit for i in cache.revisions()] == [second]
    assert cache.verify("org/s", second) == []
    assert cache.store.used_bytes() <= 1.5 * REPO_BYTES


def test_gc_evicts_down_to_the_budget(range_mirror: RangeMirror, tmp_path: Path) -> None:
    a, b = (_publish(range_mirror, tmp_path, n) for n in "ab")
    make_cache(tmp_path / "vol", range_mirror.url).ensure(a)
    make_cache(tmp_path / "vol", range_mirror.url).ensure(b)
    tight = make_cache(tmp_path / "vol", None, budget_bytes=int(1.5 * REPO_BYTES))
    assert tight.gc() > REPO_BYTES // 2
    assert [i.repo for i in tight.revisions()] == [b.repo]


def test_gc_sweeps_abandoned_temps_and_orphan_blobs(
    range_mirror: RangeMirror, tmp_path: Path
) -> None:
    a = _publish(range_mirror, tmp_path, "a")
    cache = make_cache(tmp_path / "vol", range_mirror.url)
    pub = cache.ensure(a)
    store = cache.store
    tmp = store.tmp_dir
    dead_blob_temp = tmp / f"models--org--a.{'e' * 64}.4242.0123abcd.part"
    dead_blob_temp.write_bytes(b"x" * 100)
    dead_blob_temp.with_name(dead_blob_temp.name + ".prefix").write_text("100")
    orphan = store.blob_path("org/a", "f" * 64)
    orphan.write_bytes(b"y" * 50)
    fresh_write = tmp / "state.json.4242.0123abcd.part"  # a write in flight elsewhere: kept
    fresh_write.write_bytes(b"{}")
    held = store.blob_lock("org/a", "d" * 64)
    assert held.acquire(timeout_s=0)
    live_temp = tmp / f"models--org--a.{'d' * 64}.4243.0123abcd.part"  # its fetch is alive
    live_temp.write_bytes(b"z" * 10)
    try:
        assert cache.gc() == 150 + len("100")
    finally:
        held.release()
    assert not dead_blob_temp.exists() and not orphan.exists()
    assert fresh_write.exists() and live_temp.exists()
    assert cache.verify(a.repo, a.revision) == [] and pub.path.is_dir()
