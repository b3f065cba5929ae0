"""The CPU activation tracker: exact peaks for known allocation patterns."""

from __future__ import annotations

import torch

from inference_svc.model.profile import StoragePeakTracker


def test_peak_counts_live_storages_once_and_notices_frees() -> None:
    with StoragePeakTracker() as tracker:
        a = torch.ones(1000)  # 4000 bytes
        view = a.view(10, 100)  # same storage: not counted again
        del a
        assert tracker.current == 4000
        b = view * 2  # +4000
        del view  # the first storage dies with its last view
        assert tracker.current == 4000
        c = torch.empty(250, dtype=torch.float64)  # +2000
        del b, c
    assert tracker.current == 0
    assert tracker.peak == 8000


def test_tensors_made_outside_are_not_counted() -> None:
    outside = torch.ones(1 << 16)
    with StoragePeakTracker() as tracker:
        outside.add_(1)  # in place: no new storage
        y = outside[:10].sum()
    assert tracker.peak == y.element_size()  # only the scalar result
