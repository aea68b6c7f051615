"""Keys whose next value a writer has promised: every other thread's read waits for it.

[Note: Fenced keys] A caller that queues work which will change some keys (an optimizer's update, run on its worker
while the training thread goes on) fences them: until the work's future is done, a ``get`` of one of them from any
thread but the writer's waits for it, and a prefetch of one is issued only once it is done (the value it would bring
is about to change). So whatever reads an updated tensor early (a forward reaching its unit, a parameter or state
dict read, a checkpoint) waits for exactly what it reads, and nothing else waits. A writer whose work fails leaves
the error on its future: a read of its keys raises it (``FencedWriteError``), since their values are half a step
on, until the caller lifts them (having run the work again). A fence goes when its future is done well; a newer
fence of a key replaces the older one.

Threads: ``fence`` and ``lift`` on the thread queueing the work; ``pending``, ``wait`` and ``after`` on any reader;
the done-callback (on the writer's thread) lifts the fence. Setting and lifting take a lock; a reader takes one item
of the dict, whole, without it: it sees a fence or none.

A fence may name what settles it (``settle``): work whose outcome waits for the caller (updates made before it is
known whether they stand: see [Note: Speculated updates] in integrations/_speculated.py), where a reader that waited
would wait for itself, or work that waits for its reader to come near. A read of such a key calls ``settle()`` on
the reading thread first, which completes the future (rolls the work back, say) or lets work paced to its reader
run at once (see [Note: Paced streamed updates] in integrations/_streamed.py), and then waits for it and reads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from ._types import FencedWriteError


class Fences:
    """The fenced keys of one store: key -> (the future that writes it, the writer's thread ident)."""

    def __init__(self) -> None:
        self._by_key: dict[str, tuple[Future, int, Callable[[], None] | None]] = {}
        self._lock = threading.Lock()  # of setting and lifting; readers take one item without it

    def fence(self, keys: Iterable[str], done: Future, writer: int,
              settle: Callable[[], None] | None = None) -> None:
        keys = list(keys)
        with self._lock:
            for k in keys:
                self._by_key[k] = (done, writer, settle)
        done.add_done_callback(lambda f: self._lift(keys, f))

    def _lift(self, keys: list[str], done: Future) -> None:
        if done.exception() is not None:
            return  # its keys stay fenced, and raise, until the caller lifts them (having mended them)
        self.lift(keys, done)

    def lift(self, keys: Iterable[str], done: Future | None = None) -> None:
        """Lift the fences of ``keys`` (those of ``done`` only, if given)."""
        with self._lock:
            for k in keys:
                if (held := self._by_key.get(k)) is not None and (done is None or held[0] is done):
                    del self._by_key[k]

    def pending(self, key: str) -> Future | None:
        """The future a read of ``key`` by this thread must wait for, or None."""
        held = self._by_key.get(key)
        if held is None or held[1] == threading.get_ident():
            return None
        return held[0]

    def wait(self, key: str, done: Future, on_wait: Callable[[float, float], None]) -> None:
        """Wait for ``done`` (``on_wait(start, end)`` told how long), having settled it first where its fence says
        how; raise its failure for ``key``."""
        held = self._by_key.get(key)
        if held is not None and held[0] is done and held[2] is not None and not done.done():
            held[2]()
        start = time.perf_counter()
        try:
            error = done.exception()
        finally:
            on_wait(start, time.perf_counter())
        if error is not None:
            raise FencedWriteError(f"{key!r} was to be written by work that failed ({type(error).__name__}: "
                                   f"{error}): its value cannot be trusted") from error

    def after(self, key: str, then: Callable[..., object], *args: object) -> bool:
        """Run ``then(*args)`` once ``key``'s fence (if any, for this thread) is lifted; False when there is none."""
        done = self.pending(key)
        if done is None:
            return False

        def run(f: Future) -> None:
            if f.exception() is None:
                with contextlib.suppress(Exception):  # a prefetch, say: advice, and the store may be closing
                    then(*args)

        done.add_done_callback(run)
        return True


__all__ = ["Fences"]
