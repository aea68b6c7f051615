"""Every I/O call of a workload fails once; nothing is lost and the store stays usable."""

import os
import shutil
import subprocess

import pytest
import torch

import tierstore as ts
from tierstore.testing import FaultySyscalls

KEYS = ("a", "b", "c")
BLOCK = 16 * 1024


def _values():
    return {k: torch.randn(3 * BLOCK // 4 + 11, generator=torch.Generator().manual_seed(i))
            for i, k in enumerate(KEYS)}


def _workload(store, errors):
    """Put, read back through every tier, modify, write back, read again; retry once on an I/O error."""

    def attempt(fn):
        try:
            return fn()
        except ts.TierIOError as e:
            errors.append(e)
            return fn()

    values = _values()
    handles = [store.put(k, v) for k, v in values.items()]
    for h in handles:
        try:
            h.wait()
        except ts.TierIOError as e:
            errors.append(e)
            assert store.info(h.key)["copies"]["host"]["state"] == "dirty"  # kept, not freed
    attempt(store.flush)
    for k in KEYS:
        store.evict(k, "host")
    store.prefetch("c", "device")
    for k in KEYS:
        t = attempt(lambda: store.get(k, "device"))
        assert torch.equal(t, values[k]), k
        t.add_(1)
        store.mark_dirty(k, "device")
        store.release(k, "device")
    try:
        store.flush()
    except ts.TierIOError as e:
        errors.append(e)
        assert any(c["state"] == "dirty" for k in KEYS for c in store.info(k)["copies"].values())
        store.flush()
    for k in KEYS:
        attempt(lambda: store.evict(k, "device"))
        attempt(lambda: store.evict(k, "host"))
    for k in KEYS:
        t = attempt(lambda: store.get(k, "host"))
        assert torch.equal(t, values[k] + 1), k
        store.release(k, "host")


def _count_calls(nvme_dir, **kw):
    sys = FaultySyscalls(None)
    with ts.TierStore(nvme_path=nvme_dir, syscalls=sys, block_size_bytes=BLOCK, host_budget_bytes="8MiB",
                      file_size_bytes="1MiB", **kw) as store:
        errors = []
        _workload(store, errors)
        assert not errors
    return sys.calls


@pytest.mark.parametrize("mode", ["eio", "short", "enospc"])
@pytest.mark.parametrize("verify", [False, True])
def test_every_io_call_fails_once(nvme_dir, mode, verify):
    total = _count_calls(nvme_dir, verify_checksums=verify)
    assert total >= 12
    for k in range(total):
        sys = FaultySyscalls(k, mode=mode)
        with ts.TierStore(nvme_path=nvme_dir, syscalls=sys, block_size_bytes=BLOCK, host_budget_bytes="8MiB",
                          file_size_bytes="1MiB", verify_checksums=verify) as store:
            errors = []
            _workload(store, errors)
            assert sys.failed == 1
            assert len(errors) == 1, (k, errors)
            msg = str(errors[0])
            assert any(repr(key) in msg or f"{key}:" in msg for key in KEYS), msg
            assert "swap-0000.bin" in msg, msg
            if mode == "enospc" and "write" in msg:
                assert "disk is full" in msg
        assert os.listdir(nvme_dir) == []


def test_integrity_error_on_flipped_byte(make_store):
    store = make_store(verify_checksums=True, block_size_bytes=BLOCK)
    x = torch.randn(50_000)
    store.put("x", x).wait()
    store.evict("x", "host")
    path = os.path.join(store.swap_directory, "swap-0000.bin")
    with open(path, "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ts.IntegrityError, match=r"x: checksum mismatch in .*swap-0000.bin"):
        store.get("x", "host")


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield str(mnt)
    subprocess.run(["umount", str(mnt)], check=True)


def test_real_full_disk(small_fs):
    with ts.TierStore(nvme_path=small_fs, file_size_bytes="4MiB", nvme_reserve_bytes=0,
                      host_budget_bytes="32MiB") as store:
        a = torch.randn(1024**2 // 4)
        store.put("a", a).wait()  # first 4 MiB swap file
        with open(os.path.join(small_fs, "filler"), "wb") as f:
            f.write(b"\0" * (6 * 1024**2))  # leave less than one more swap file
        full = (r"a new swap file of 4.0 MiB does not fit under nvme_path .*: the filesystem has [\d.]+ MiB free, "
                r"of which nvme_reserve_bytes=0.0 MiB")
        with pytest.raises(ts.StoreFullError, match=full):
            store.put("b", torch.randn(4 * 1024**2 // 4))
        assert "b" not in store
        store.evict("a", "host")
        assert torch.equal(store.get("a", "host"), a)  # earlier data intact, store usable
        store.release("a", "host")
        store.put("c", torch.randn(1000)).wait()  # fits in the existing file


def test_a_failed_write_is_reported_once(nvme_dir):
    """A failed write-back that a handle's wait() or flush() raised is not raised again by the key's next get();
    one nobody waited for is (by that get). Either way the bytes stay in memory and the next write-back succeeds."""
    for waited in ("handle", "flush", None):
        sys = FaultySyscalls(None)
        with ts.TierStore(nvme_path=nvme_dir, syscalls=sys, block_size_bytes=BLOCK, host_budget_bytes="8MiB",
                          file_size_bytes="1MiB") as store:
            x = torch.randn(BLOCK // 4)
            sys.fail_at = sys.calls
            handle = store.put("x", x)
            if waited == "handle":
                with pytest.raises(ts.TierIOError, match="x: write"):
                    handle.wait()
            elif waited == "flush":
                while not handle.done():
                    pass
                sys.fail_at = sys.calls  # the flush's write fails too
                with pytest.raises(ts.TierIOError, match="x: write"):
                    store.flush()
            else:
                while not handle.done():
                    pass
            if waited:
                got = store.get("x", "host")
            else:
                with pytest.raises(ts.TierIOError, match="x: write"):
                    store.get("x", "host")
                got = store.get("x", "host")
            assert torch.equal(got, x)
            store.release("x", "host")
            store.write_back("x").wait()
            store.evict("x", "host")
            assert torch.equal(store.get("x", "host"), x)
            store.release("x", "host")
            assert sys.failed == (2 if waited == "flush" else 1)
