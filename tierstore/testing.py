"""Fakes for tests: an I/O layer that fails on purpose, and a device whose copies finish late.

[Note: Every I/O call fails once] The way SQLite tests its I/O errors: run a
workload once to count its I/O calls, then once per call index k with a
layer that fails call k, and check that the failure surfaces as a
TierIOError naming the key and file, that no data is lost, and that the store
is still usable afterwards.
"""

from __future__ import annotations

import errno
import os
import queue
import random
import threading
import time
from collections.abc import Callable

import torch

from ._device import Device
from ._memory import Buffer
from ._nvme import Syscalls
from ._types import Tier, TierStoreError, TierValueError

__all__ = ["FaultySyscalls", "NoDirectSyscalls", "SimulatedDevice", "SlowSyscalls", "checked_workload"]


class FaultySyscalls(Syscalls):
    """Counts preadv/pwritev calls and fails call number ``fail_at`` (0-based).

    ``mode`` is ``"eio"`` (an I/O error), ``"enospc"`` (disk full; writes only),
    or ``"short"`` (the call transfers nothing, as at end of file).
    ``fail_at=None`` only counts.
    """

    def __init__(self, fail_at: int | None = None, *, mode: str = "eio") -> None:
        if mode not in ("eio", "enospc", "short"):
            raise TierValueError(f"mode must be 'eio', 'enospc' or 'short', not {mode!r}")
        self.fail_at = fail_at
        self.mode = mode
        self.calls = 0
        self.failed = 0
        self._lock = threading.Lock()

    def _should_fail(self) -> bool:
        with self._lock:
            k = self.calls
            self.calls += 1
            if k == self.fail_at:
                self.failed += 1
                return True
            return False

    def preadv(self, fd: int, buffers: list, offset: int) -> int:
        if self._should_fail():
            if self.mode == "short":
                return 0
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        if self._should_fail():
            if self.mode == "short":
                return 0
            code = errno.ENOSPC if self.mode == "enospc" else errno.EIO
            raise OSError(code, os.strerror(code))
        return super().pwritev(fd, buffers, offset)


class SlowSyscalls(Syscalls):
    """A drive that reads at most ``read_bytes_per_second`` per call (each preadv sleeps for its bytes)."""

    def __init__(self, read_bytes_per_second: float) -> None:
        self.read_bytes_per_second = read_bytes_per_second

    def preadv(self, fd: int, buffers: list, offset: int) -> int:
        n = super().preadv(fd, buffers, offset)
        time.sleep(n / self.read_bytes_per_second)
        return n


class NoDirectSyscalls(Syscalls):
    """A filesystem that refuses O_DIRECT, as tmpfs did before Linux 6.6."""

    def open(self, path: str, flags: int, mode: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return super().open(path, flags, mode)


class _LateEvent:
    """A simulated stream event: set when the copy it follows has finished."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.wait(60):
            raise TierStoreError("a simulated device copy never finished")


class _Stream:
    """One worker thread running its copies in order, each after the events it waits for."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None] | None) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def close(self) -> None:
        self.submit(None)
        self._thread.join()


class SimulatedDevice(Device):
    """A device whose copies between host and device memory (both CPU memory here) run on two worker
    threads, like CUDA copy streams, and finish up to ``max_delay_s`` after they were queued; while one is in
    flight its destination holds ``poison`` (its bytes are undefined on a real device). Compute is the calling
    thread, so it must wait for a copy before reading what it filled. A store that reads a buffer before its copy
    finished, reuses one a copy still reads or writes, or writes host bytes home before the copy that filled them
    finished, reads poison or stale bytes: a test sees wrong values (see [Note: Ordering device work])."""

    def __init__(self, *, max_delay_s: float = 0.002, seed: int = 0, poison: int = 0xFF) -> None:
        super().__init__()
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self.max_delay_s = max_delay_s
        self.poison = poison
        self._h2d = _Stream("simulated-h2d")
        self._d2h = _Stream("simulated-d2h")
        self.copies = 0

    def copy(self, dst: Buffer, src: Buffer, nbytes: int) -> None:
        stream = self._h2d if dst.tier is Tier.DEVICE else self._d2h
        before = (*dst.pending_events(), *src.pending_events())
        with self._rng_lock:
            delay = self._rng.uniform(0, self.max_delay_s)
        event = _LateEvent()

        def job() -> None:
            for ev in before:
                ev.synchronize()
            dst.data[:nbytes].fill_(self.poison)
            time.sleep(delay)
            dst.data[:nbytes].copy_(src.data[:nbytes])
            event._done.set()

        self.copies += 1
        dst.add_event(stream, event)
        src.add_event(stream, event)
        stream.submit(job)

    def ready_for_compute(self, buf: Buffer) -> None:
        buf.wait_pending()  # the compute "stream" is this thread: it waits here

    def close(self) -> None:
        self._h2d.close()
        self._d2h.close()


def checked_workload(store: object, *, numel: int, keys: int = 10, ops: int = 400, seed: int = 0) -> None:
    """Random puts' values read back through both memory tiers and changed in either, under budgets that keep a
    few copies per tier, so buffers are reused all the time; every read is checked (an AssertionError names the
    operation, key, tier, what was read and what was expected). Two keys are homed in the host tier; the rest of
    it, and the device tier, are a cache of NVMe-homed keys."""
    rng = random.Random(seed)
    value = {}
    for i in range(keys):
        store.put(f"k{i}", torch.full((numel,), float(i)), home="host" if i < 2 else "nvme").wait()
        value[f"k{i}"] = float(i)
    for step in range(ops):
        key = f"k{rng.randrange(keys)}"
        tier = rng.choice(["device", "device", "host"])
        if rng.random() < 0.3:
            store.prefetch(f"k{rng.randrange(keys)}", rng.choice(["device", "host"]))
        t = store.get(key, tier)
        got = t[rng.randrange(numel)].item(), t[0].item(), t[-1].item()
        assert got == (value[key],) * 3, (step, key, tier, got, value[key])
        if rng.random() < 0.5:
            t.fill_(float(1000 + step))
            store.mark_dirty(key, tier)
            value[key] = float(1000 + step)
        store.release(key, tier)
        if rng.random() < 0.1:
            store.evict(key, rng.choice(["device", "host"]) if store.info(key)["home"] == "nvme" else "device")
    store.flush()
    for key, v in value.items():
        assert torch.equal(store.read(key), torch.full((numel,), v)), key
