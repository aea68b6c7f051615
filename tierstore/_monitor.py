"""The store's lock: reentrant, with one condition, and able to let go however deeply it is held."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from ._types import TierStoreError


class Monitor:
    """A reentrant lock with a condition. :meth:`wait` and :meth:`unlocked` give the lock up entirely, however
    many times this thread has entered it, and take it back as deep as it was: a transfer runs with the store
    unlocked from inside nested store calls. (``threading.Condition`` over an ``RLock`` does the first only, and
    the second only through private methods.)"""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._free = threading.Condition(self._mutex)  # signalled when the monitor is let go
        self._changed = threading.Condition(self._mutex)  # signalled by notify_all()
        self._owner: int | None = None
        self._depth = 0

    def __enter__(self) -> Monitor:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._depth += 1
            else:
                self._take(me, 1)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._mutex:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._free.notify()

    def wait(self, timeout: float) -> None:
        """Let go, wait for :meth:`notify_all` (or ``timeout`` seconds), take it back."""
        with self._mutex:
            me, depth = self._let_go()
            try:
                self._changed.wait(timeout)
            finally:
                self._take(me, depth)

    def notify_all(self) -> None:
        with self._mutex:
            self._changed.notify_all()

    @contextmanager
    def unlocked(self) -> Iterator[None]:
        """Run the block with the monitor let go (entirely); it is held again afterwards, as deep as before."""
        with self._mutex:
            me, depth = self._let_go()
        try:
            yield
        finally:
            with self._mutex:
                self._take(me, depth)

    def _let_go(self) -> tuple[int, int]:
        me = threading.get_ident()
        if self._owner != me:
            raise TierStoreError("the store's lock is not held by this thread")
        depth, self._owner, self._depth = self._depth, None, 0
        self._free.notify()
        return me, depth

    def _take(self, me: int, depth: int) -> None:
        while self._owner is not None:
            self._free.wait()
        self._owner, self._depth = me, depth
