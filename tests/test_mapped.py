"""Copies of tensors mapped from private files (tierstore/_mapped.py) and the store's read_mapped."""

import errno
import os

import pytest
import torch
from _training import is_mapped
from conftest import all_dtypes, open_fds, random_tensor

import tierstore as ts
from tierstore import _mapped


@pytest.mark.parametrize("shape", [(), (0,), (3,), (5, 7), (1000, 33)], ids=str)
def test_a_mapped_copy_round_trips_every_dtype_and_size(tmp_path, shape):
    for dtype in all_dtypes():
        t = random_tensor(shape, dtype)
        c = _mapped.mapped_copy(str(tmp_path), t)
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous(), dtype
        assert torch.equal(c.view(-1).view(torch.uint8) if c.numel() else c,
                           t.reshape(-1).view(torch.uint8) if t.numel() else t), dtype
        if t.numel():
            assert is_mapped(c) and c.untyped_storage().nbytes() == t.numel() * t.element_size(), dtype
    strided = torch.arange(100, dtype=torch.float32).view(10, 10)[:, ::3]
    assert torch.equal(_mapped.mapped_copy(str(tmp_path), strided), strided)
    assert os.listdir(tmp_path) == []  # no file has a name


def test_a_mapped_copy_s_file_is_private_and_holds_no_descriptor(tmp_path):
    fd = _mapped._private_file(str(tmp_path))
    try:
        st = os.fstat(fd)
        assert st.st_mode & 0o777 == 0o600 and st.st_nlink == 0
    finally:
        os.close(fd)
    before = open_fds()
    copies = [_mapped.mapped_copy(str(tmp_path), torch.full((1000,), float(i))) for i in range(50)]
    assert open_fds() == before
    copies[3] += 1  # a write stays in its own copy
    assert copies[3][0] == 4 and copies[4][0] == 4 and copies[2][0] == 2


def test_a_full_drive_is_an_error_and_leaves_nothing(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_mapped.os, "pwrite", full)
    before = open_fds()
    with pytest.raises(ts.StoreFullError, match="free space there or choose another nvme_path"):
        _mapped.mapped_copy(str(tmp_path), torch.ones(1000))
    assert open_fds() == before and os.listdir(tmp_path) == []


def test_the_store_reads_a_mapped_copy_of_any_tier(make_store):
    store = make_store(host_budget_bytes="1MiB")
    t = torch.randn(64, 64)
    store.put("a", t, home="nvme").wait()
    store.put("b", t * 2, home="host").wait()
    for key, value in (("a", t), ("b", t * 2)):
        c = store.read_mapped(key)
        assert is_mapped(c) and torch.equal(c, value) and torch.equal(store.read(key), value)
    host_only = make_store(nvme_path=None, host_budget_bytes="1MiB")
    host_only.put("c", t, home="host").wait()
    c = host_only.read_mapped("c")
    assert not is_mapped(c) and torch.equal(c, t)  # no drive: an ordinary copy


def _resident_bytes(t):
    """Bytes of the mapping that holds ``t`` resident in this process (its Rss line in /proc/self/smaps)."""
    ptr = t.untyped_storage().data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


def _eventually(condition, seconds=10.0):
    """Polls ``condition`` until it holds or ``seconds`` pass (what a background thread does, it does in time)."""
    import time

    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_a_mapped_copy_s_pages_are_given_back_once_read_and_the_thread_ends_with_the_copies(tmp_path):
    """See [Note: Mapped pages given back]: read whole, the copy's pages leave the RSS (the values stay), and the
    trimming thread ends once no copy lives."""
    import threading

    t = torch.randn(8 * 2**20 // 4)
    c = _mapped.mapped_copy(str(tmp_path), t)
    assert torch.equal(c, t)  # every page read
    assert _eventually(lambda: _resident_bytes(c) < t.nbytes // 8), _resident_bytes(c)
    assert torch.equal(c, t)  # read again from the page cache
    c[0] = 7.0  # a write stays, trimmed or not
    assert _eventually(lambda: _resident_bytes(c) < t.nbytes // 8) and c[0] == 7.0
    del c
    assert _eventually(lambda: not [th for th in threading.enumerate() if th.name == "mapped-copies-trimmer"])


def test_mapped_copies_made_and_read_on_many_threads_while_they_are_trimmed_keep_their_values(tmp_path):
    """Threads make mapped copies, write into them and read them back, switching every microsecond, while the
    trimming thread gives their pages back: every value read is the one written (see [Note: Mapped pages given
    back])."""
    import sys
    import threading
    import time

    errors = []

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            t = torch.randn(64 * 1024, generator=g)
            c = _mapped.mapped_copy(str(tmp_path), t)
            c[::4097] += 1
            t[::4097] += 1
            for _ in range(3):
                if not torch.equal(c, t):
                    errors.append(seed)
                time.sleep(_mapped.TRIM_SECONDS / 3)

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(before)
    assert errors == []
