"""Receiver bookkeeping: lifetime by request id, shared blocks by hash, no stealing."""

import pytest

from pdserve.cachestore import KVLayout, TransferError, UnknownRequestError
from pdserve.cachestore.entries import EntryTable
from pdserve.cachestore.errors import ProtocolError


def _token(t, rid):
    """The bind token expect() drew for rid (what its sender presents)."""
    return t.status(rid).token


def _arrive(t, rid, layer, block, n=1):
    t.begin_receive(rid, layer, block, n, _token(t, rid))
    return t.end_receive(rid, layer, block, n, True)


def test_identical_prompts_share_blocks_and_never_free_each_other():
    t = EntryTable(KVLayout(2, 16, 8))
    assert t.expect("a", [1, 2, 3], hashes=["h1", "h2", "h3"]) == [1, 2, 3]
    # b shares blocks 1 and 2 (same hashes), has its own block 9
    assert t.expect("b", [1, 2, 9], hashes=["h1", "h2", "h9"]) == [-1, -1, 9]
    for layer in range(2):
        assert _arrive(t, "a", layer, 1) == set()  # no layer completed yet: nobody to wake
        assert _arrive(t, "a", layer, 2) == set()
        assert _arrive(t, "a", layer, 3) == {"a"}  # a's layer is complete; b still misses block 9
        assert _arrive(t, "b", layer, 9) == {"b"}
    assert t.status("a").complete and t.status("b").complete
    assert t.incomplete == 0
    unfinished, others = t.delete("a")
    assert unfinished is None and others == []
    assert t.stats()["pinned_blocks"] == 3  # 1, 2 still pinned by b; 3 released
    assert t.status("b").complete
    with pytest.raises(UnknownRequestError, match="'a'"):
        t.status("a")
    t.delete("b")
    assert t.stats() == {"pinned_entries": 0, "inflight_transfers": 0, "pinned_blocks": 0, "receiving_frames": 0}


def test_overlap_without_equal_hash_is_refused():
    t = EntryTable(KVLayout(2, 16, 8))
    t.expect("a", [1, 2])
    with pytest.raises(ValueError, match="block 2 is pinned by live request"):
        t.expect("b", [2, 5])
    t.expect("c", [3], hashes=["x"])
    with pytest.raises(ValueError, match="block 3 is pinned"):
        t.expect("d", [3], hashes=["y"])
    with pytest.raises(ValueError, match="already expected"):
        t.expect("a", [7])
    assert t.stats()["pinned_entries"] == 2


def test_provider_failure_fails_dependent_owner():
    t = EntryTable(KVLayout(2, 16, 8))
    t.expect("a", [1], hashes=["h"])
    t.expect("b", [1, 4], hashes=["h", "k"])
    assert t.incomplete == 2
    _arrive(t, "a", 0, 1)
    failed = t.fail("a", TransferError("peer died"))
    assert sorted(e.rid for e in failed) == ["a", "b"]
    with pytest.raises(TransferError, match="peer died"):
        t.status("a")
    with pytest.raises(TransferError, match="shared KV block"):
        t.status("b")
    assert t.stats()["pinned_entries"] == 0 and t.stats()["pinned_blocks"] == 0
    assert t.incomplete == 0


def test_frames_are_checked_before_writing():
    t = EntryTable(KVLayout(2, 16, 8))
    t.expect("a", [1, 2])
    with pytest.raises(UnknownRequestError, match="'zzz'"):
        t.begin_receive("zzz", 0, 1, 1, bytes(16))
    with pytest.raises(ProtocolError, match="block 3"):
        t.begin_receive("a", 0, 2, 2, _token(t, "a"))
    with pytest.raises(ProtocolError, match="layer 5"):
        t.begin_receive("a", 5, 1, 1, _token(t, "a"))
    assert t.stats()["receiving_frames"] == 0


def test_delete_while_receiving_keeps_pin_until_frame_done():
    t = EntryTable(KVLayout(1, 16, 8))
    t.expect("a", [1, 2])
    t.begin_receive("a", 0, 1, 1, _token(t, "a"))
    unfinished, _ = t.delete("a")
    assert unfinished is not None
    assert t.stats()["pinned_entries"] == 1  # the frame still writes into block 1
    t.end_receive("a", 0, 1, 1, True)
    assert t.stats()["pinned_entries"] == 0 and t.stats()["pinned_blocks"] == 0 and t.incomplete == 0


def test_failed_entry_deleted_while_a_frame_still_writes():
    t = EntryTable(KVLayout(1, 16, 8))
    t.expect("a", [1, 2])
    t.begin_receive("a", 0, 1, 1, _token(t, "a"))
    t.fail("a", TransferError("timeout"))
    assert t.stats()["pinned_blocks"] == 0  # released at once; the entry waits for its frame
    assert t.delete("a") == (None, [])
    t.end_receive("a", 0, 1, 1, True)
    assert t.stats()["pinned_entries"] == 0 and t.incomplete == 0
