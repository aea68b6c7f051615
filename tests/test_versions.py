"""Kept versions (see [Note: Kept versions]): a key's next write-back keeps the version on the drive, which
``restore()`` brings back and ``commit()`` frees, with no bytes read or written for either."""

import pytest
import torch

import tierstore as ts


def _change(store, key, value, tier="host"):
    t = store.get(key, tier)
    t.copy_(value)
    store.mark_dirty(key, tier)
    store.release(key, tier)


def _value(store, key):
    t = store.get(key, "host")
    try:
        return t.clone()
    finally:
        store.release(key, "host")


def _drive_bytes(store):
    return store.memory()["nvme"]["held_bytes"]


def _io(store):
    s = store.stats_dict()
    return s["bytes_read_nvme"], s["bytes_written_nvme"]


@pytest.mark.parametrize("written", ["in memory", "written home", "evicted"])
def test_restore_brings_the_kept_version_back_without_moving_bytes(make_store, written):
    store = make_store()
    old, new = torch.arange(4096.0), -torch.arange(4096.0)
    store.put("x", old).wait()
    store.put("y", old * 2).wait()
    drive = _drive_bytes(store)
    kept = store.keep_version(["x", "y"])
    assert _drive_bytes(store) == drive + 2 * 4096 * 4  # the spare extents, taken at once
    _change(store, "x", new)
    _change(store, "y", new * 2, tier="device")
    if written != "in memory":
        store.flush()
    if written == "evicted":
        for k in ("x", "y"):
            store.evict(k, "device") if "device" in store.info(k)["copies"] else None
            store.evict(k, "host") if "host" in store.info(k)["copies"] else None
    assert torch.equal(_value(store, "x"), new)
    io = _io(store)
    kept.restore()
    assert _io(store) == io
    assert store.info("x")["copies"].keys() == {"nvme"}  # the changed copies went
    assert torch.equal(_value(store, "x"), old)
    assert torch.equal(_value(store, "y"), old * 2)
    assert _drive_bytes(store) == drive
    # It goes on as any key: changed and written again, in place.
    _change(store, "x", new)
    store.flush()
    store.evict("x", "host")
    assert torch.equal(_value(store, "x"), new)
    assert _drive_bytes(store) == drive


@pytest.mark.parametrize("written", ["in memory", "written home", "evicted"])
def test_commit_keeps_the_change_and_frees_the_kept_version(make_store, written):
    store = make_store()
    old, new = torch.arange(4096.0), -torch.arange(4096.0)
    store.put("x", old).wait()
    drive = _drive_bytes(store)
    kept = store.keep_version(["x"])
    _change(store, "x", new)
    if written != "in memory":
        store.flush()
    if written == "evicted":
        store.evict("x", "host")
    kept.commit()
    assert _drive_bytes(store) == drive
    store.flush()
    store.evict("x", "host")
    assert torch.equal(_value(store, "x"), new)
    with pytest.raises(ts.TierStoreError, match="already committed or restored"):
        kept.restore()


def test_a_changed_copy_is_written_home_before_its_version_is_kept(make_store):
    store = make_store()
    store.put("x", torch.zeros(1000)).wait()
    _change(store, "x", torch.ones(1000))  # dirty in the host tier: the version to keep is this one
    kept = store.keep_version(["x"])
    _change(store, "x", torch.full((1000,), 2.0))
    kept.restore()
    assert torch.equal(_value(store, "x"), torch.ones(1000))


def test_a_commit_while_the_write_to_the_spare_is_in_flight(make_store):
    store = make_store()
    store.put("x", torch.zeros(1 << 20)).wait()
    drive = _drive_bytes(store)
    kept = store.keep_version(["x"])
    _change(store, "x", torch.ones(1 << 20))
    h = store.write_back("x")
    kept.commit()  # the write may still be in flight: the kept version goes when it lands
    h.wait()
    assert _drive_bytes(store) == drive
    store.evict("x", "host")
    assert torch.equal(_value(store, "x"), torch.ones(1 << 20))


def test_keep_version_refuses_what_it_cannot_keep(make_store):
    store = make_store()
    store.put("h", torch.zeros(10), home="host").wait()
    store.put("x", torch.zeros(10)).wait()
    with pytest.raises(ts.TierValueError, match="its home is the host tier"):
        store.keep_version(["x", "h"])
    assert store.info("x")["home"] == "nvme"
    kept = store.keep_version(["x"])  # the refused call kept nothing
    with pytest.raises(ts.TierValueError, match="kept already"):
        store.keep_version(["x"])
    store.get("x", "host")
    with pytest.raises(ts.TierStoreError, match="is held"):
        kept.restore()
    store.release("x", "host")
    kept.restore()  # once released


def test_a_drive_too_small_for_the_spares_refuses_before_anything_changes(make_store):
    store = make_store(nvme_budget_bytes=6 * 1024**2, file_size_bytes=1024**2)
    store.put("x", torch.zeros(1 << 20)).wait()  # 4 MiB
    drive = _drive_bytes(store)
    with pytest.raises(ts.StoreFullError):
        store.keep_version(["x"])
    assert _drive_bytes(store) == drive
    _change(store, "x", torch.ones(1 << 20))
    store.flush()
    store.evict("x", "host")
    assert torch.equal(_value(store, "x"), torch.ones(1 << 20))


def test_a_dropped_key_frees_what_it_kept(make_store):
    store = make_store()
    store.put("x", torch.zeros(4096)).wait()
    store.put("y", torch.zeros(4096)).wait()
    drive = _drive_bytes(store)
    kept = store.keep_version(["x", "y"])
    _change(store, "x", torch.ones(4096))
    store.flush()
    store.drop("x")
    kept.restore()
    assert _drive_bytes(store) == drive - 4096 * 4
    assert torch.equal(_value(store, "y"), torch.zeros(4096))
