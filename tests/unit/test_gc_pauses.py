"""pdserve.gc_pauses: a server freezes its start-up heap and times each full collection after it."""

import gc

import pytest

from pdserve import gc_pauses
from pdserve.metrics import ServerMetrics


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_settle_freezes_the_heap_and_times_only_full_collections(unfrozen, monkeypatch):
    monkeypatch.delenv(gc_pauses.ENV_FREEZE, raising=False)
    pauses: list[float] = []
    stop = gc_pauses.settle(pauses.append)
    try:
        assert gc.get_freeze_count() > 1000  # what existed at start-up is out of the collector's walk
        gc.collect(0)
        gc.collect(1)
        assert pauses == []
        gc.collect()
        assert len(pauses) == 1 and 0 < pauses[0] < 10
    finally:
        stop()
    gc.collect()
    assert len(pauses) == 1  # stopped: no longer timed
    stop()  # twice is harmless


def test_freezing_can_be_turned_off_and_collections_are_still_timed(unfrozen, monkeypatch):
    monkeypatch.setenv(gc_pauses.ENV_FREEZE, "0")
    m = ServerMetrics(role="decode")
    stop = gc_pauses.settle(m.gc_full_collection.observe)
    try:
        assert gc.get_freeze_count() == 0
        gc.collect()
        gc.collect()
    finally:
        stop()
    labels = {"role": "decode", "pool": "default", "inference_service": "local"}
    assert m.registry.get_sample_value("pdserve_gc_full_collection_seconds_count", labels) == 2
