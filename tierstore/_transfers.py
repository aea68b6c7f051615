"""Moving bytes between the tiers: filling a copy (from the drive, or from the other memory tier), prefetches
on the mover threads, and write-backs to a key's home tier.

[Note: Who waits on whom] Background work runs on two pools: the I/O engine's
threads, which only do syscalls, and the mover threads, which run prefetches
end to end (allocate, read, copy between tiers). A mover waits only on engine
futures, on write-backs (engine work), and on copies that a mover already
running is loading, so no cycle of waits can form.

[Note: A prefetch overtaken by its get] A prefetch may wait for room (for a
write-back to free a changed copy: see [Note: Changed copies keep their
rank]) while the caller goes on and get()s the key itself, uses it and
releases it. Had the prefetch then read it, the read would be for a use that
is over: bytes for nothing, and a failure of that read would be kept for the
next get(), in a later step, though this one went well. So once it has room
a prefetch skips (counted in prefetch_skipped) when a get() of the key came
after the latest prefetch() asking for it and is over (one asked for again
while it was pending reads for the later use). A get still fetching the key
is the use the prefetch was for: the prefetch fills the copy and the get
waits for it, as it would have without the race (skipping there would hand
the room back to a get that has to wait for it again and read alone). If
that prefetch's read fails, the get fetching the key reads it itself (or, if
it waits on the failed copy, raises the failure): the failure is not kept
for the next get, which would raise it in a later step, after this one had
its bytes (as `test_a_step_stopped_by_an_io_error_finishes_when_called_again`
once saw).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from ._copies import Copy, Entry, StoreState
from ._room import Room
from ._types import StoreClosedError, Tier, TierKeyError, TierStoreError, TierValueError
from ._versions import landed


def done_future(result: object = True) -> Future:
    f: Future = Future()
    f.set_result(result)
    return f


class Transfers:
    """Fills copies and writes them home; all methods run with the store's lock held, letting go of it only
    while bytes move."""

    def __init__(self, state: StoreState, room: Room, mover_threads: int) -> None:
        self.state = state
        self.room = room
        self.movers = ThreadPoolExecutor(mover_threads, thread_name_prefix="tierstore-mover")

    # ---- filling a copy ----------------------------------------------------------------
    def materialize(self, entry: Entry, tier: Tier, *, may_skip: bool, prefetch_into: Tier | None = None
                    ) -> Copy | None:
        """A current, readable copy of ``entry`` in ``tier``; None only with ``may_skip`` (a prefetch) when the
        tier is full of held copies, or (a prefetch into ``prefetch_into``) when a get() of the entry came after
        the latest prefetch() asked for it."""
        while True:
            self._check_alive(entry)
            copy = entry.copies.get(tier)
            if copy is not None and copy.loading is not None:
                self._wait_loading(entry, copy.loading, may_skip)
            elif copy is not None and copy.version == entry.version:
                return copy
            elif copy is not None and copy.tier is entry.home and not copy.pins and not copy.io_refs:
                # A memory home's stale copy is brought up to date in place, never freed: freed, it was gone for
                # good when the fill that was to replace it skipped (a prefetch its get overtook, no room), and
                # eviction then waited for ever for a write-back with nowhere to write.
                self.start_writeback(entry)
            elif copy is not None:
                self._clear_stale(entry, copy)
            else:
                src = entry.source(tier)
                if src is None:
                    raise TierStoreError(f"{entry.key!r} has no readable copy (an earlier write failed?)")
                if tier is Tier.DEVICE and src.tier is Tier.NVME:  # the drive reaches the device through the host
                    if self.materialize(entry, Tier.HOST, may_skip=may_skip, prefetch_into=prefetch_into) is None:
                        return None
                    continue
                filled = self._fill(entry, tier, src, may_skip=may_skip, prefetch_into=prefetch_into)
                if filled is not False:
                    return filled

    def _check_alive(self, entry: Entry) -> None:
        if entry.dropped:
            raise TierKeyError(f"key {entry.key!r} was dropped")
        if self.state.closed:
            raise StoreClosedError("the store was closed while a transfer was pending")

    def _wait_loading(self, entry: Entry, loading: Future, may_skip: bool) -> None:
        """Another transfer is filling the copy: wait for it; its failure is this caller's too."""
        self.state.wait_for(loading)
        err = loading.exception()
        if err is not None and not may_skip:
            entry.reported(err)  # this get() is the one that reports it
            raise err

    def _clear_stale(self, entry: Entry, copy: Copy) -> None:
        """Free a copy of an older version to make way for the current one."""
        if copy.pins:
            raise TierStoreError(f"{entry.key!r} is held in the {copy.tier.label} tier at an older version; "
                                 "release() it before getting the new one")
        if copy.io_refs:  # the store's own write-back of it is in flight: it is freed when done
            self.state.lock.wait(0.05)
        else:
            self.state.free_copy(entry, copy)

    def _fill(self, entry: Entry, tier: Tier, src: Copy, *, may_skip: bool, prefetch_into: Tier | None = None
              ) -> Copy | None | bool:
        """Allocate a copy in ``tier`` and fill it from ``src`` with the lock let go. The copy, None when a
        prefetch skipped, or False when the entry changed while waiting for room (the caller looks again)."""
        state = self.state
        version = entry.version
        buf = self.room.alloc(tier, entry.nbytes, may_skip=may_skip, for_key=entry.key)
        if buf is None:
            return None
        if prefetch_into is not None and not entry.getting \
                and entry.last_get > entry.prefetch_asked.get(prefetch_into, entry.last_get):
            # see [Note: A prefetch overtaken by its get]
            state.pools[tier].free(buf)
            state.lock.notify_all()  # the room goes to whoever waits for it
            return None
        if entry.dropped or tier in entry.copies or src.version != entry.version \
                or entry.copies.get(src.tier) is not src:
            state.pools[tier].free(buf)  # the world moved while we waited for space
            return False
        done: Future = Future()
        copy = Copy(tier, version=version, buffer=buf, loading=done, last_use=next(state.tick))
        entry.copies[tier] = copy
        src.io_refs += 1
        error: BaseException | None = None
        with state.lock.unlocked():
            try:
                if src.tier is Tier.NVME:
                    assert state.engine is not None and src.extent is not None
                    state.engine.read(src.extent, buf.data, label=entry.key).result()
                else:
                    self.copy_memory(src, copy, entry)
            except BaseException as e:
                error = e
        src.io_refs -= 1
        copy.loading = None
        if error is not None:
            state.free_copy(entry, copy)
            if may_skip and not entry.dropped and not entry.getting:  # a prefetch: the next get() reports it
                entry.error, entry.error_in_write = error, False
            done.set_exception(error)
            state.lock.notify_all()
            raise error
        done.set_result(True)
        state.drop_if_stale(entry, src)
        state.lock.notify_all()
        return copy

    def copy_memory(self, src: Copy, dst: Copy, entry: Entry) -> None:
        """Copy between the device and host buffers; queued on the device, not waited for (see
        [Note: Ordering device work])."""
        t0 = time.perf_counter()
        assert src.buffer is not None and dst.buffer is not None
        self.state.device.copy(dst.buffer, src.buffer, entry.nbytes)
        self.state.stats.add_transfer(src.tier, dst.tier, entry.nbytes, time.perf_counter() - t0, entry.key)

    # ---- prefetch ----------------------------------------------------------------------
    def submit_prefetch(self, entry: Entry, tier: Tier, fut: Future) -> None:
        self.movers.submit(self._prefetch_task, entry, tier, fut)

    def _prefetch_task(self, entry: Entry, tier: Tier, fut: Future) -> None:
        try:
            with self.state.lock:
                copy = self.materialize(entry, tier, may_skip=True, prefetch_into=tier)
                if copy is None:
                    self.state.stats.add("prefetch_skipped")
            fut.set_result(copy is not None)
        except BaseException as e:  # an I/O failure was also kept for the next get()
            fut.set_exception(e)

    # ---- write-back --------------------------------------------------------------------
    def start_writeback(self, entry: Entry) -> Future | None:
        """Start writing the newest bytes to the home tier. None if home is current."""
        if entry.writeback is not None:
            return entry.writeback
        home = entry.home_copy()
        if home is None or entry.nbytes == 0 or home.version == entry.version:
            return None
        src = entry.source(entry.home)
        if src is None:
            raise TierStoreError(f"{entry.key!r}: no current copy to write back")
        version = entry.version
        if entry.home is Tier.NVME and src.tier is Tier.DEVICE:
            src = self.materialize(entry, Tier.HOST, may_skip=False)
            if entry.writeback is not None:
                return entry.writeback
            if home.version == entry.version:
                return None
        if entry.home is not Tier.NVME:
            home.io_refs += 1
            self.copy_memory(src, home, entry)
            home.io_refs -= 1
            home.version = version
            return done_future()
        return self._write_to_drive(entry, src, home, version)

    def _write_to_drive(self, entry: Entry, src: Copy, home: Copy, version: int) -> Future:
        state = self.state
        assert state.engine is not None and home.extent is not None and src.buffer is not None
        src.io_refs += 1
        home.io_refs += 1
        state.stats.add("write_backs")
        state.device.ready_for_cpu(src.buffer)  # a device-to-host copy into it may still be running
        # A kept version stays where it is: the first write after it goes to the spare extent (see [Note: Kept
        # versions]).
        kept = entry.kept
        target = kept.spare if kept is not None and kept.old is None else home.extent
        fut = state.engine.write(target, src.buffer.data, label=entry.key)
        outer: Future = Future()
        entry.writeback = outer

        def finished(f: Future) -> None:
            with state.lock:
                src.io_refs -= 1
                home.io_refs -= 1
                entry.writeback = None
                err = f.exception()
                if kept is not None and target is kept.spare:
                    landed(state, kept, home, err)
                if err is None:
                    home.version = max(home.version, version)
                    if entry.error_in_write:
                        entry.error = None  # an earlier failed write-back has now succeeded
                    state.drop_if_stale(entry, src)
                    outer.set_result(True)
                else:
                    if not entry.dropped:
                        entry.error, entry.error_in_write = err, True
                    outer.set_exception(err)
                state.lock.notify_all()

        fut.add_done_callback(finished)
        return outer

    # ---- eviction on request -----------------------------------------------------------
    def evict(self, entry: Entry, tier: Tier) -> None:
        """Free ``entry``'s copy in ``tier`` once nobody transfers it, writing it home first if only it holds
        the newest bytes."""
        state = self.state
        while (copy := entry.copies.get(tier)) is not None:
            if copy.pins:
                raise TierValueError(f"evict({entry.key!r}, {tier.label!r}): the copy is held; release() it first")
            if copy.busy:
                state.wait_for(copy.loading or entry.writeback or done_future())
                if copy.io_refs and entry.writeback is None:
                    state.lock.wait(0.01)
            elif entry.unsaved(copy):
                fut = self.start_writeback(entry)
                assert fut is not None
                state.wait_for(fut)
                if fut.exception() is not None:
                    raise fut.exception()
            else:
                state.free_copy(entry, copy)
                state.stats.add("evictions")
