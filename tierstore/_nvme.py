"""The NVMe I/O engine: O_DIRECT preadv/pwritev from a thread pool into aligned buffers.

It executes and knows nothing of keys, tiers or budgets other than its own
disk space. Tensors are packed into aligned extents of a few preallocated
swap files in a private directory, removed on close.

[Note: Threads reach the drive] os.preadv/os.pwritev release the GIL for the
length of the syscall, so a handful of Python threads keep as many requests
in flight as an async I/O library would, and read this machine's disk as fast
as fio does. Each transfer is split into ``block_size_bytes`` blocks that the
threads issue independently, at most ``queue_depth`` at a time.

[Note: The cost of a block] Every block is a job for one of a fixed set of
I/O threads, taken from a ``queue.SimpleQueue``: a ThreadPoolExecutor's
submit (a Future, a work item and an idle-semaphore probe per call) and a
semaphore around each call cost more CPU than the syscall's own user time
(profiled: the executor's semaphore alone was the largest own time of a
read), and so did a lock per counter. The threads are
``min(io_threads, queue_depth)``, which is the bound on calls in flight, and
each block takes the stats' lock twice.
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import signal
import sys
import threading
import time
import warnings
import weakref
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field

import psutil
import torch

from ._config import StoreConfig
from ._memory import PAGE_BYTES, align_up, insert_free_range
from ._ownership import describe, make_swap_directory, reclaim_swap
from ._stats import StoreStats
from ._types import IntegrityError, StoreFullError, Tier, TierBudgetError, TierIOError, TierStoreError, TierValueError



class Syscalls:
    """The OS calls the engine makes; tests substitute faulty ones (see tierstore.testing)."""

    def open(self, path: str, flags: int, mode: int) -> int:
        return os.open(path, flags, mode)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def preadv(self, fd: int, buffers: list, offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        return os.pwritev(fd, buffers, offset)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


@dataclass(eq=False)
class _SwapFile:
    path: str
    fd: int
    size: int
    free: list[tuple[int, int]]  # (offset, length), sorted by offset, coalesced


@dataclass(eq=False)
class Extent:
    """A page-aligned byte range of one swap file."""

    file: _SwapFile
    offset: int
    length: int
    checksums: list[int] | None = None
    torn: bool = False  # a write into it failed part way; its bytes are not to be read
    written: bool = False

    @property
    def path(self) -> str:
        return self.file.path


@dataclass(eq=False)
class _Batch:
    """The blocks of one transfer; resolves ``future`` when the last one finishes."""

    future: Future
    remaining: int
    label: str
    started: float
    checksums: list[int | None] = field(default_factory=list)
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


try:  # Swap checksums live only as long as the store, so the function may differ from run to run.
    from crc32c import crc32c as _checksum  # hardware CRC32C: ~20 GB/s a core here, against zlib's ~3.8
except ImportError:
    _checksum = zlib.crc32


class _IoWorkers:
    """A fixed set of daemon threads running queued jobs ``(fn, *args)`` in order (see [Note: The cost of a
    block]); started at the first job. A job must not raise (a block's errors go to its transfer's future)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._started: list[threading.Thread] = []
        self._stopped = False
        self._lock = threading.Lock()
        # Ends the threads once, at stop() or when an engine dropped without close() goes (they hold the queue,
        # not the engine).
        self._end_threads = weakref.finalize(self, _stop_workers, self._jobs, self.threads)

    def put(self, job: tuple) -> None:
        if self._stopped:
            raise TierStoreError("the I/O threads were stopped")
        if len(self._started) < self.threads:
            with self._lock:
                while len(self._started) < self.threads:
                    t = threading.Thread(target=_work, args=(self._jobs,), daemon=True,
                                         name=f"tierstore-io_{len(self._started)}")
                    t.start()
                    self._started.append(t)
        self._jobs.put(job)

    def stop(self) -> None:
        """Run what is queued, then end the threads and wait for them."""
        with self._lock:
            self._stopped = True
            started = list(self._started)
        self._end_threads()
        for t in started:
            if t is not threading.current_thread():
                t.join()


def _work(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        try:
            job[0](*job[1:])
        except BaseException:  # a job reports its errors itself; the thread must go on serving the others
            sys.excepthook(*sys.exc_info())
        del job  # its buffers and future are not kept alive while the thread waits


def _stop_workers(jobs: queue.SimpleQueue, n: int) -> None:
    for _ in range(n):
        jobs.put(None)


def _cleanup(directory: str, fds: list[int]) -> None:
    # The files go before the lock is let go (the first fd): no other store may reclaim a half-removed directory.
    shutil.rmtree(directory, ignore_errors=True)
    for fd in reversed(fds):
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


_live_engines: weakref.WeakSet[NvmeEngine] = weakref.WeakSet()
_sigterm_installed = False


def _cleanup_on_sigterm() -> None:
    """Remove the swap directories of this process's stores when it gets SIGTERM (the default ``kill``, a
    scheduler's preemption, torchrun's teardown), then die of it as before. Only where SIGTERM has no handler
    yet and only from the main thread (where Python allows one): a program's own handler is left alone, and a
    directory left by a death this cannot see (SIGKILL) is reclaimed by the next store on that path."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    _sigterm_installed = True

    def on_sigterm(signum: int, frame: object) -> None:
        for engine in list(_live_engines):
            engine._finalizer()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


class NvmeEngine:
    """Reads and writes extents of private swap files; every call returns a Future."""

    def __init__(self, config: StoreConfig, *, syscalls: Syscalls | None = None,
                 stats: StoreStats | None = None) -> None:
        if config.nvme_path is None:
            raise TierValueError("the NVMe tier needs nvme_path: set it to a directory on a fast local drive")
        base = config.nvme_path
        if not os.path.isdir(base):
            raise TierValueError(f"nvme_path {base!r} does not exist or is not a directory; create it or choose "
                                 "another")
        if not os.access(base, os.W_OK | os.X_OK):
            raise TierValueError(f"nvme_path {base!r} is not writable by this process; choose a writable directory")
        self.config = config
        self.stats = stats or StoreStats()
        self._sys = syscalls or Syscalls()
        self.block_size = config.block_size_bytes
        # Space left by stores whose process died (kill -9, a preempted job) comes back first; it is said.
        self.reclaimed = reclaim_swap(base)
        if self.reclaimed:
            warnings.warn(f"nvme_path {base!r}: {describe(self.reclaimed)}", stacklevel=3)
        try:
            self.directory, lock_fd = make_swap_directory(base)  # mode 0700, locked while this store lives
        except OSError as e:
            raise TierValueError(f"cannot create a swap directory under nvme_path {base!r}: {e.strerror}") from e
        self._fds: list[int] = [lock_fd]
        self._finalizer = weakref.finalize(self, _cleanup, self.directory, self._fds)
        _live_engines.add(self)
        _cleanup_on_sigterm()
        self.direct = config.direct_io and self._probe_direct()
        self._files: list[_SwapFile] = []
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.peak_used_bytes = 0
        self._workers = _IoWorkers(min(config.io_threads, config.queue_depth))
        self._closed = False

    def _probe_direct(self) -> bool:
        path = os.path.join(self.directory, "probe")
        try:
            fd = self._sys.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            warnings.warn(
                f"the filesystem under {self.config.nvme_path!r} refuses O_DIRECT; falling back to "
                "buffered I/O through the page cache, which hides the drive's speed and uses RAM. "
                "Point nvme_path at a local ext4/xfs drive for direct I/O.",
                RuntimeWarning, stacklevel=3,
            )
            return False
        os.close(fd)
        os.unlink(path)
        return True

    # ---- space -------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Extent:
        """Reserve an aligned extent for ``nbytes`` bytes, creating a swap file if needed."""
        length = align_up(max(nbytes, 1))
        budget = self.config.nvme_budget_bytes
        with self._lock:
            if budget is not None and self.used_bytes + length > budget:
                raise TierBudgetError(
                    f"the NVMe tier needs {length} more bytes but holds {self.used_bytes} of its "
                    f"nvme_budget_bytes={budget}; raise nvme_budget_bytes or drop tensors"
                )
            for f in self._files:
                ext = self._take_locked(f, length)
                if ext is not None:
                    return ext
            f = self._new_file_locked(self._new_file_size_locked(length))
            ext = self._take_locked(f, length)
            assert ext is not None
            return ext

    def _drive_free_bytes(self) -> int:
        return psutil.disk_usage(self.directory).free

    def _new_file_size_locked(self, length: int) -> int:
        """``file_size_bytes``, less where nvme_budget_bytes or the drive's room (less nvme_reserve_bytes) leave
        less; never less than ``length`` (a tensor larger than a file gets a file of its size)."""
        size = self.config.file_size_bytes
        budget = self.config.nvme_budget_bytes
        if budget is not None:
            size = min(size, budget - sum(f.size for f in self._files))
        size = min(size, self._drive_free_bytes() - self.config.nvme_reserve_bytes)
        return max(length, size // PAGE_BYTES * PAGE_BYTES)

    def room_bytes(self) -> int:
        """How many more bytes tensors could take here now: the free ranges of the swap files plus the drive's
        free space (less nvme_reserve_bytes), within nvme_budget_bytes."""
        with self._lock:
            room = self._unused_locked() + max(0, self._drive_free_bytes() - self.config.nvme_reserve_bytes)
            budget = self.config.nvme_budget_bytes
            return room if budget is None else min(room, budget - self.used_bytes)

    def describe_room(self) -> str:
        """Where ``room_bytes()`` comes from, in the settings' words: for an error that says what to change."""
        with self._lock:
            inside = self._unused_locked()
        budget = self.config.nvme_budget_bytes
        return (f"the filesystem has {_mib(self._drive_free_bytes())} free, of which nvme_reserve_bytes="
                f"{_mib(self.config.nvme_reserve_bytes)} stays free; the swap files have {_mib(inside)} unused; "
                + ("no nvme_budget_bytes" if budget is None else
                   f"nvme_budget_bytes={_mib(budget)}, {_mib(self.used_bytes)} of it used"))

    def _unused_locked(self) -> int:
        """Bytes of the swap files that no extent takes."""
        return sum(n for f in self._files for _, n in f.free)

    def _take_locked(self, f: _SwapFile, length: int) -> Extent | None:
        for i, (off, n) in enumerate(f.free):
            if n >= length:
                if n == length:
                    del f.free[i]
                else:
                    f.free[i] = (off + length, n - length)
                self.used_bytes += length
                self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
                return Extent(f, off, length)
        return None

    def require_free(self, nbytes: int, what: str) -> None:
        """Raise StoreFullError where the filesystem under the swap directory cannot take ``nbytes`` more (``what``)
        and keep nvme_reserve_bytes free."""
        free, reserve = self._drive_free_bytes(), self.config.nvme_reserve_bytes
        if free < nbytes + reserve:
            raise StoreFullError(
                f"{what} of {_mib(nbytes)} does not fit under nvme_path {self.config.nvme_path!r}: the "
                f"filesystem has {_mib(free)} free, of which nvme_reserve_bytes={_mib(reserve)} stays free. Free "
                f"space there, point nvme_path at a larger drive, or lower nvme_reserve_bytes")

    def _new_file_locked(self, size: int) -> _SwapFile:
        self.require_free(size, "a new swap file")
        path = os.path.join(self.directory, f"swap-{len(self._files):04d}.bin")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        try:
            fd = self._sys.open(path, flags, 0o600)
        except OSError as e:
            raise TierIOError(f"cannot create swap file {path}: {e.strerror}") from e
        try:
            self._sys.fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            if e.errno == errno.ENOSPC:
                raise StoreFullError(
                    f"no space left to preallocate {size} bytes for swap file {path}; free space on "
                    f"{self.config.nvme_path!r} or point nvme_path at a larger drive"
                ) from e
            raise TierIOError(f"cannot preallocate swap file {path}: {e.strerror}") from e
        self._fds.append(fd)
        f = _SwapFile(path, fd, size, [(0, size)])
        self._files.append(f)
        return f

    def free(self, ext: Extent) -> None:
        """Return an extent's space; the caller guarantees no transfer still uses it."""
        with self._lock:
            self.used_bytes -= ext.length
            insert_free_range(ext.file.free, ext.offset, ext.length)

    # ---- transfers ---------------------------------------------------------------------
    def write(self, ext: Extent, buf: torch.Tensor, *, label: str) -> Future:
        """Write the first ``ext.length`` bytes of the uint8 CPU tensor ``buf`` into ``ext``."""
        return self._submit(ext, buf, label, write=True)

    def read(self, ext: Extent, buf: torch.Tensor, *, label: str) -> Future:
        """Read ``ext`` into the first ``ext.length`` bytes of the uint8 CPU tensor ``buf``."""
        if ext.torn:
            fut: Future = Future()
            fut.set_exception(TierIOError(
                f"{label}: an earlier write to {ext.path} failed part way; its bytes there are not valid"
            ))
            return fut
        return self._submit(ext, buf, label, write=False)

    def _submit(self, ext: Extent, buf: torch.Tensor, label: str, *, write: bool) -> Future:
        if self._closed:
            raise TierIOError(f"{label}: the I/O engine is closed")
        if buf.numel() < ext.length:
            raise TierValueError(f"buffer of {buf.numel()} bytes is smaller than extent of {ext.length}")
        mv = memoryview(buf.numpy())
        blocks = range(0, ext.length, self.block_size)
        batch = _Batch(Future(), len(blocks), label, time.perf_counter(), [None] * len(blocks))
        if write:
            ext.checksums = None
        for i, off in enumerate(blocks):
            n = min(self.block_size, ext.length - off)
            self._workers.put((self._run_block, batch, ext, mv[off:off + n], off, i, write))
        return batch.future

    def _run_block(self, batch: _Batch, ext: Extent, mv: memoryview, off: int, index: int, write: bool) -> None:
        err: BaseException | None = None
        try:
            if batch.error is None:
                if write and self.config.verify_checksums:
                    batch.checksums[index] = _checksum(mv)
                what = "write" if write else "read"
                self.stats.io_begins(what, time.perf_counter() - batch.started)  # queued since submitted
                calls = 0
                try:
                    calls = self._io_all(self._sys.pwritev if write else self._sys.preadv, ext, mv, off,
                                         batch.label, what)
                finally:
                    self.stats.io_ends(what, calls)
                if not write and self.config.verify_checksums and ext.checksums is not None \
                        and _checksum(mv) != ext.checksums[index]:
                    raise IntegrityError(
                        f"{batch.label}: checksum mismatch in {ext.path} at byte "
                        f"{ext.offset + off} ({len(mv)} bytes); the swap data is corrupt"
                    )
        except BaseException as e:  # surfaced on the future, never only logged
            err = e
        with batch.lock:
            if err is not None and batch.error is None:
                batch.error = err
            batch.remaining -= 1
            last = batch.remaining == 0
        if last:
            try:
                self._finish(batch, ext, write)
            except BaseException as e:  # the transfer's waiter must hear of it, or it would wait forever
                if not batch.future.done():
                    batch.future.set_exception(e)
                raise

    def _io_all(self, call, ext: Extent, mv: memoryview, off: int, label: str, what: str) -> int:
        """Move all of ``mv``; returns the syscalls it took."""
        done = calls = 0
        total = len(mv)
        while done < total:
            calls += 1
            try:
                n = call(ext.file.fd, [mv[done:]], ext.offset + off + done)
            except OSError as e:
                hint = " (the disk is full)" if e.errno == errno.ENOSPC else ""
                raise TierIOError(
                    f"{label}: {what} of {total - done} bytes at byte {ext.offset + off + done} of "
                    f"{ext.path} failed: {e.strerror}{hint}"
                ) from e
            if n <= 0:
                raise TierIOError(
                    f"{label}: short {what} at byte {ext.offset + off + done} of {ext.path}: "
                    f"{done} of {total} bytes transferred"
                )
            done += n
        return calls

    def _finish(self, batch: _Batch, ext: Extent, write: bool) -> None:
        seconds = time.perf_counter() - batch.started
        if batch.error is not None:
            if write:
                ext.torn = True
            err = batch.error
            if not isinstance(err, TierIOError):
                wrapped = TierIOError(f"{batch.label}: I/O on {ext.path} failed: {err!r}")
                wrapped.__cause__ = err
                err = wrapped
            batch.future.set_exception(err)
            return
        if write:
            ext.torn = False
            ext.written = True
            if self.config.verify_checksums:
                ext.checksums = list(batch.checksums)  # type: ignore[arg-type]
            self.stats.add_transfer(Tier.HOST, Tier.NVME, ext.length, seconds, batch.label)
        else:
            self.stats.add_transfer(Tier.NVME, Tier.HOST, ext.length, seconds, batch.label)
        batch.future.set_result(ext.length)

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Wait for transfers in flight, then close and delete every swap file."""
        if self._closed:
            return
        self._closed = True
        self._workers.stop()  # after the blocks queued before
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def file_paths(self) -> list[str]:
        return [f.path for f in self._files]


__all__ = ["PAGE_BYTES", "Extent", "NvmeEngine", "Syscalls"]
