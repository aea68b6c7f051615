"""The I/O engine on its own: extents of private swap files, reads and writes by block, checksums, space."""

import gc
import os
import stat
import threading
import time

import pytest
import torch

from tierstore import IntegrityError, StoreConfig, TierBudgetError, TierIOError
from tierstore._memory import aligned_empty
from tierstore._nvme import NvmeEngine
from tierstore.testing import FaultySyscalls


def _engine(path, **kw):
    kw.setdefault("file_size_bytes", "1MiB")
    kw.setdefault("block_size_bytes", "64KiB")
    return NvmeEngine(StoreConfig(nvme_path=str(path), **kw))


def _bytes(n: int, seed: int) -> torch.Tensor:
    buf = aligned_empty(n)
    buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buf


def test_extents_round_trip_through_private_files(tmp_path):
    engine = _engine(tmp_path)
    try:
        sizes = [1, 4096, 100_000, 950_000]  # within a block, a page, several blocks, most of a file
        extents = [engine.allocate(n) for n in sizes]
        for i, (ext, n) in enumerate(zip(extents, sizes)):
            engine.write(ext, _bytes(ext.length, i), label=f"t{i}").result()
        for i, ext in enumerate(extents):
            out = aligned_empty(ext.length)
            engine.read(ext, out, label=f"t{i}").result()
            assert torch.equal(out, _bytes(ext.length, i)), i
        assert len(engine.file_paths()) >= 2  # 950 KB did not fit beside the others in the first file
        for path in engine.file_paths():
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(engine.directory).st_mode) == 0o700
        assert engine.used_bytes == sum(e.length for e in extents)
    finally:
        engine.close()
    assert not os.path.exists(engine.directory)


def test_freed_space_is_reused_and_the_budget_holds(tmp_path):
    engine = _engine(tmp_path, nvme_budget_bytes="512KiB")
    try:
        a = engine.allocate(256 * 1024)
        b = engine.allocate(256 * 1024)
        with pytest.raises(TierBudgetError, match="nvme_budget_bytes"):
            engine.allocate(4096)
        assert engine.room_bytes() == 0
        engine.free(a)
        c = engine.allocate(256 * 1024)
        assert (c.file, c.offset) == (a.file, a.offset) and engine.peak_used_bytes == 512 * 1024
        engine.free(b)
        engine.free(c)
        assert engine.used_bytes == 0
    finally:
        engine.close()


def test_checksums_catch_a_changed_byte_on_the_drive(tmp_path):
    engine = _engine(tmp_path, verify_checksums=True)
    try:
        ext = engine.allocate(200_000)
        engine.write(ext, _bytes(ext.length, 7), label="w").result()
        with open(ext.path, "r+b") as f:  # one byte changed behind the engine's back
            f.seek(ext.offset + 150_000)
            byte = f.read(1)
            f.seek(ext.offset + 150_000)
            f.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(IntegrityError, match="w"):
            engine.read(ext, aligned_empty(ext.length), label="w").result()
    finally:
        engine.close()


def test_a_failed_block_fails_the_transfer_and_marks_a_write_torn(tmp_path):
    faulty = FaultySyscalls(fail_at=None)
    engine = NvmeEngine(StoreConfig(nvme_path=str(tmp_path), file_size_bytes="1MiB", block_size_bytes="64KiB"),
                        syscalls=faulty)
    try:
        ext = engine.allocate(256 * 1024)  # four blocks
        faulty.fail_at = faulty.calls + 2
        with pytest.raises(TierIOError, match="torn-key"):
            engine.write(ext, _bytes(ext.length, 1), label="torn-key").result()
        with pytest.raises(TierIOError, match="failed part way"):
            engine.read(ext, aligned_empty(ext.length), label="torn-key").result()
        engine.write(ext, _bytes(ext.length, 2), label="again").result()  # a whole write makes it valid again
        out = aligned_empty(ext.length)
        engine.read(ext, out, label="again").result()
        assert torch.equal(out, _bytes(ext.length, 2))
    finally:
        engine.close()


def test_a_closed_engine_refuses_transfers(tmp_path):
    engine = _engine(tmp_path)
    ext = engine.allocate(4096)
    engine.close()
    assert engine.closed
    with pytest.raises(TierIOError, match="closed"):
        engine.write(ext, aligned_empty(4096), label="late")


def _io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tierstore-io")]


def test_close_finishes_queued_blocks_and_ends_the_io_threads(tmp_path):
    before = set(_io_threads())
    engine = _engine(tmp_path, queue_depth=3, io_threads=8, block_size_bytes="4KiB")
    ext = engine.allocate(256 * 1024)  # 64 blocks queued for 3 threads
    fut = engine.write(ext, _bytes(ext.length, 5), label="queued")
    assert len(set(_io_threads()) - before) == 3  # min(io_threads, queue_depth): the calls in flight at most
    engine.close()
    assert fut.done() and fut.result() == ext.length
    assert not set(_io_threads()) - before


def test_an_engine_dropped_without_close_lets_its_threads_go(tmp_path):
    before = set(_io_threads())
    engine = _engine(tmp_path)
    ext = engine.allocate(4096)
    engine.write(ext, _bytes(4096, 6), label="t").result()
    assert set(_io_threads()) - before
    del engine, ext
    gc.collect()
    deadline = time.monotonic() + 10
    while set(_io_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(_io_threads()) - before


def test_a_failure_finishing_a_transfer_reaches_its_waiter_and_the_threads_go_on(tmp_path, monkeypatch, capsys):
    engine = _engine(tmp_path, io_threads=2)
    try:
        ext = engine.allocate(4096)
        engine.write(ext, _bytes(4096, 7), label="t").result()

        def broken(*args, **kwargs):
            raise RuntimeError("accounting failed")

        monkeypatch.setattr(engine.stats, "add_transfer", broken)
        with pytest.raises(RuntimeError, match="accounting failed"):
            engine.read(ext, aligned_empty(4096), label="t").result(timeout=10)
        monkeypatch.undo()
        out = aligned_empty(4096)
        engine.read(ext, out, label="t").result(timeout=10)
        assert torch.equal(out, _bytes(4096, 7))
        # The thread says so too, after it failed the transfer: its printing may still be under way here.
        err, deadline = "", time.monotonic() + 10
        while "accounting failed" not in err and time.monotonic() < deadline:
            err += capsys.readouterr().err
            time.sleep(0.01)
        assert "accounting failed" in err
    finally:
        engine.close()


# ---- the drive's room: the reserve, the swap files' size ------------------------------------------------------
def test_a_new_swap_file_is_no_larger_than_the_budget_leaves(tmp_path):
    engine = _engine(tmp_path, file_size_bytes="256MiB", nvme_budget_bytes="48MiB")
    try:
        engine.allocate(8 * 2**20)
        assert [os.path.getsize(p) for p in engine.file_paths()] == [48 * 2**20]
    finally:
        engine.close()


@pytest.fixture
def tmpfs_64mib(tmp_path):
    """A 64 MiB filesystem of its own (a tmpfs: needs root and mount), or the test is skipped saying why."""
    import shutil
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here to make a 64 MiB tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a 64 MiB tmpfs here (it needs root): {done.stderr.strip()}")
    yield str(mnt)
    subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.filterwarnings("ignore:the filesystem under .* refuses O_DIRECT:RuntimeWarning")
def test_a_small_drive_says_its_real_numbers_and_trains_with_a_smaller_reserve(tmpfs_64mib):
    import tierstore as ts
    from tierstore.integrations import OffloadedAdamW, offload_model

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 8.0 MiB of fp32 weights

    with ts.TierStore(nvme_path=tmpfs_64mib, host_budget_bytes="4MiB") as store:
        with pytest.raises(ts.StoreFullError) as full:
            offload_model(model(), store)
    message = str(full.value)
    for words in ("needs that much room on the drive, but only 0.0 MiB is free", "the filesystem has 64.0 MiB free",
                  "nvme_reserve_bytes=64.0 MiB stays free", "lower nvme_reserve_bytes"):
        assert words in message, message

    net = model()
    with ts.TierStore(nvme_path=tmpfs_64mib, host_budget_bytes="4MiB", nvme_reserve_bytes="4MiB",
                      nvme_budget_bytes="48MiB") as store:
        off = offload_model(net, store)
        opt = OffloadedAdamW(off)
        for _ in range(2):
            net(torch.randn(4, 512)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        files = [os.path.getsize(os.path.join(store.swap_directory, f)) for f in os.listdir(store.swap_directory)
                 if f.startswith("swap-")]
        assert files and sum(files) <= 48 * 2**20  # never the 256 MiB of file_size_bytes
