"""What stays where: writing copies home, evicting, dropping, keeping copies for a run, and the order eviction
takes them in. A part of :class:`~tierstore.TierStore` (its base), over the same state."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator

from ._copies import Entry, StoreState
from ._handle import Handle
from ._room import Room
from ._transfers import Transfers, done_future
from ._types import Tier, TierTypeError, TierValueError


class Residency:
    """The methods of :class:`~tierstore.TierStore` that decide where its copies live, beside the data path (put,
    get, prefetch, release) that the store itself holds."""

    _state: StoreState
    _room: Room
    _transfers: Transfers

    # ---- writing home, evicting, dropping ----------------------------------------------
    def write_back(self, key: str) -> Handle:
        """Start writing the newest bytes of ``key`` to its home tier."""
        self._state.check_open()
        with self._state.lock:
            entry = self._state.lookup(key)
            fut = self._transfers.start_writeback(entry)
        return Handle(fut or done_future(), key, entry.home, self._reporter(entry))

    def writing(self, key: str) -> Handle:
        """The write-back of ``key`` in flight (a done handle when none): wait on it before changing the copy it
        reads, without starting one."""
        self._state.check_open()
        with self._state.lock:
            entry = self._state.lookup(key)
            fut = entry.writeback
        return Handle(fut or done_future(), key, entry.home, self._reporter(entry))

    def _reporter(self, entry: Entry) -> Callable[[BaseException], None]:
        """For a write's handle: a failed write is reported once, by the handle's wait() or else by the key's
        next get(); the bytes stay in memory either way and a later write-back tries again."""
        def reported(err: BaseException) -> None:
            with self._state.lock:
                entry.reported(err)
        return reported

    def flush(self) -> None:
        """Write every dirty copy back to its home tier and wait; raises the first failure. A key another thread
        drops meanwhile is skipped."""
        state = self._state
        state.check_open()
        with state.lock:
            while True:
                pending = []
                for e in list(state.entries.values()):
                    try:
                        fut = self._transfers.start_writeback(e)  # None when home is current
                    except KeyError:
                        if e.dropped:  # by another thread, while this one waited: nothing of it to write
                            continue
                        raise
                    if fut is not None:
                        pending.append((e, fut))
                if not pending:
                    return
                for entry, fut in pending:
                    state.wait_for(fut)
                    if (err := fut.exception()) is not None and not entry.dropped:
                        entry.reported(err)  # here, not again by the key's next get()
                        raise err

    def evict(self, key: str, tier: Tier | str) -> None:
        """Drop the cached copy of ``key`` in ``tier``, writing it back first if it is dirty."""
        self._state.check_open()
        tier = Tier.parse(tier)
        with self._state.lock:
            entry = self._state.lookup(key)
            if tier is entry.home:
                raise TierValueError(f"evict({key!r}, {tier.label!r}): that is its home tier; use drop() to remove it")
            self._transfers.evict(entry, tier)

    def drop(self, key: str) -> None:
        """Remove ``key`` and free every copy, discarding unwritten changes."""
        self._state.check_open()
        with self._state.lock:
            self._state.drop_entry(self._state.lookup(key))

    def undo_puts(self, handles: list[Handle]) -> None:
        """Take back what the puts of ``handles`` registered (their writes finished or failed): what a
        constructor that fails part-way calls, so that nothing of it is left in the store."""
        for h in handles:
            with contextlib.suppress(BaseException):
                h.wait()
            with contextlib.suppress(KeyError):  # not there: its put took nothing
                self.drop(h.key)

    # ---- eviction policy ---------------------------------------------------------------
    def set_victim_order(self, fn: Callable[[Tier, list[str]], list[str]] | None) -> None:
        """Install an eviction policy for every key: given a tier and candidate keys (least recently used
        first), return them in the order they should be evicted. None restores LRU."""
        self._room.victim_order = fn

    def add_victim_order(self, fn: Callable[[Tier, list[str]], list[str]], owns: Callable[[str], bool]) -> object:
        """Install the eviction policy of one owner (an offloaded model) for the keys ``owns`` says are its own;
        returns a token for :meth:`remove_victim_order`. See [Note: Several owners' victim orders]."""
        with self._state.lock:
            return self._room.add_owner_order(fn, owns)

    def remove_victim_order(self, token: object) -> None:
        with self._state.lock:
            self._room.owner_orders.pop(token, None)

    def keep(self, owner: object, keys: Iterable[str], tier: Tier | str = Tier.HOST) -> None:
        """Keep the copies of ``keys`` in ``tier`` once they are there, for the whole run: a prefetch never
        evicts them, a get() only when nothing else can go (counted as ``kept_evictions``). The set replaces
        ``owner``'s last one; an empty one ends it. A changed kept copy is written home when it goes, or by
        :meth:`flush`, not after each change (see [Note: Kept copies] in _room.py)."""
        if isinstance(keys, str):
            raise TierTypeError(f"keep() takes a collection of keys, not the string {keys!r}: pass [{keys!r}]")
        tier = Tier.parse(tier)
        if tier is Tier.NVME:
            raise TierValueError("keep() is for the memory tiers ('device' or 'host'); the nvme tier holds everything")
        with self._state.lock:
            self._room.set_kept(owner, tier, frozenset(keys))

    def kept(self, tier: Tier | str = Tier.HOST) -> frozenset[str]:
        """The keys every owner keeps in ``tier`` (see :meth:`keep`)."""
        with self._state.lock:
            return self._room.kept_keys(Tier.parse(tier))

    @contextlib.contextmanager
    def giving_way(self) -> Iterator[None]:
        """Within it, this thread's allocations in a memory tier give way to the other threads': where one of them
        waits for room in the tier, the allocation raises :class:`RoomYieldedError` instead of waiting, so that
        the caller lets go of what it holds (see [Note: Waiting for room] in _room.py). For work that may be
        dropped, such as an update made before it is known to be needed."""
        me = threading.get_ident()
        with self._state.lock:
            self._room.giving_way.add(me)
        try:
            yield
        finally:
            with self._state.lock:
                self._room.giving_way.discard(me)

    def is_waiting_for_room(self, thread_ident: int) -> bool:
        """Whether that thread is waiting for other threads to release memory (see [Note: Waiting for room])."""
        with self._state.lock:
            return self._room.is_waiting(thread_ident)
