"""Fakes for tests: an I/O layer that fails on purpose.

[Note: Every I/O call fails once] The way SQLite tests its I/O errors: run a
workload once to count its I/O calls, then once per call index k with a
layer that fails call k, and check that the failure surfaces as a
TierIOError naming the key and file, that no data is lost, and that the store
is still usable afterwards.
"""

from __future__ import annotations

import errno
import os
import threading

from ._nvme import Syscalls

__all__ = ["FaultySyscalls", "NoDirectSyscalls"]


class FaultySyscalls(Syscalls):
    """Counts preadv/pwritev calls and fails call number ``fail_at`` (0-based).

    ``mode`` is ``"eio"`` (an I/O error), ``"enospc"`` (disk full; writes only),
    or ``"short"`` (the call transfers nothing, as at end of file).
    ``fail_at=None`` only counts.
    """

    def __init__(self, fail_at: int | None = None, *, mode: str = "eio") -> None:
        if mode not in ("eio", "enospc", "short"):
            raise ValueError(f"mode must be 'eio', 'enospc' or 'short', not {mode!r}")
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


class NoDirectSyscalls(Syscalls):
    """A filesystem that refuses O_DIRECT, as tmpfs did before Linux 6.6."""

    def open(self, path: str, flags: int, mode: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return super().open(path, flags, mode)
