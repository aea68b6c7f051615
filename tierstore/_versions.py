"""Kept versions: the bytes a key's next write-back would overwrite, kept until the caller commits or restores.

[Note: Kept versions] ``TierStore.keep_version(keys)`` keeps, for each key, the version now in its home on the
drive, at no cost in bytes: the key's next write-back goes to a spare extent taken now, and the extent holding the
kept version stays as it is. ``commit()`` frees the kept extents (the spare ones become each key's home); ``restore()``
brings each key back to its kept version: the spare extent is freed, every other copy (the changed one in the host
tier, a device copy) is dropped, and the home extent holds the newest version again. Nothing is read or written
either way. What an optimizer that updates before it knows whether the update stands does with its state (see
[Note: Speculated updates] in integrations/_speculated.py).

A key is kept only where its home is the drive; its home copy is made current first (a write-back in flight is
waited for, a changed copy written). The spare extents are taken at once, so a drive too full for them refuses
here (``StoreFullError``), before anything changes. A write-back to a spare extent that fails leaves the kept
version the home, as a failed write in place would leave the key without a current home copy; ``restore()`` then
brings it back all the same. Keys dropped meanwhile free what they kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._copies import Copy, Entry, StoreState
from ._nvme import Extent, NvmeEngine
from ._types import StoreFullError, Tier, TierBudgetError, TierStoreError, TierValueError


@dataclass(eq=False)
class KeptVersion:
    """One key's kept version: ``spare`` takes the next write-back; once one has landed there, ``old`` is the
    extent holding the kept version (until then the home extent holds it)."""

    entry: Entry
    spare: Extent | None
    old: Extent | None = None
    committed: bool = False

    def free(self, engine: NvmeEngine) -> None:
        """Give back the extents it still holds (the spare, or the one with the kept version)."""
        for ext in (self.spare, self.old):
            if ext is not None:
                engine.free(ext)
        self.spare = self.old = None


class KeptVersions:
    """The versions ``TierStore.keep_version`` kept for a set of keys (see [Note: Kept versions]). Call
    :meth:`commit` or :meth:`restore` once."""

    def __init__(self, state: StoreState, kept: list[KeptVersion]) -> None:
        self._state = state
        self._kept = kept
        self.open = True

    def commit(self) -> None:
        """The changes stand: free every kept version (one whose write-back is in flight, once it lands)."""
        state = self._state
        with state.lock:
            self._check_open()
            for k in self._kept:
                entry = k.entry
                entry.kept = None
                if entry.dropped:
                    continue
                if k.old is None and entry.writeback is not None and k.spare is not None:
                    k.committed = True  # the write in flight lands on the spare: see ``_transfers._write_to_drive``
                    continue
                k.free(state.engine)  # type: ignore[arg-type]
            self.open = False

    def restore(self) -> None:
        """Bring every key back to its kept version: its other copies are dropped (none may be held)."""
        state = self._state
        with state.lock:
            self._check_open()
            # Every key quiet at once (no write-back, fill or transfer of its copies), so that nothing runs while
            # the homes move back: a wait lets the lock go, so all are checked again after each.
            while any(_busy(k.entry) for k in self._kept):
                state.lock.wait(0.01)
            for k in self._kept:
                entry = k.entry
                held = [c.tier.label for c in entry.copies.values() if c.pins and c.tier is not entry.home]
                if held and not entry.dropped:
                    raise TierStoreError(f"{entry.key!r}: its {', '.join(held)} copy is held (get() without "
                                         f"release()), so it cannot go back to its kept version")
            for k in self._kept:
                entry = k.entry
                entry.kept = None
                if entry.dropped:
                    continue
                home = entry.copies[entry.home]
                if k.old is not None:  # a write-back moved the home to the spare extent: move it back
                    k.spare, home.extent = home.extent, k.old
                    k.old = None
                k.free(state.engine)  # type: ignore[arg-type]
                for copy in [c for c in entry.copies.values() if c is not home]:
                    state.free_copy(entry, copy)
                entry.version += 1
                home.version = entry.version
                if entry.error_in_write:
                    entry.error, entry.error_in_write = None, False  # the failed write's bytes are gone with it
            self.open = False
            state.lock.notify_all()

    def _check_open(self) -> None:
        if not self.open:
            raise TierStoreError("these kept versions were already committed or restored")


def _busy(entry: Entry) -> bool:
    """Whether a write-back, a fill or a transfer of one of its copies other than the home is in flight."""
    return not entry.dropped and (entry.writeback is not None or any(
        c.loading is not None or (c.io_refs and c.tier is not entry.home) for c in entry.copies.values()))


def landed(state: StoreState, kept: KeptVersion, home: Copy, error: BaseException | None) -> None:
    """A write-back to ``kept``'s spare extent ended (the lock is held): done well, the spare is the home extent
    and the one it replaced holds the kept version (freed now if the versions were committed meanwhile); failed,
    the kept version stays the home, and a committed spare goes."""
    engine = state.engine
    assert engine is not None and home.extent is not None
    if error is None:
        old, home.extent, kept.spare = home.extent, kept.spare, None
        if kept.committed:
            engine.free(old)
        else:
            kept.old = old
    elif kept.committed and kept.spare is not None:
        engine.free(kept.spare)
        kept.spare = None


def keep_versions(state: StoreState, entries: list[Entry]) -> KeptVersions:
    """Take a spare extent for each entry (whose home copy is current on the drive, with no write in flight), and
    mark it kept; the lock is held. All or nothing."""
    engine = state.engine
    taken: list[KeptVersion] = []
    try:
        for entry in entries:
            if entry.home is not Tier.NVME or engine is None:
                raise TierValueError(f"{entry.key!r}: keep_version() keeps a version on the drive, and its home is "
                                     f"the {entry.home.label} tier")
            if entry.nbytes == 0:
                continue  # nothing to keep
            if entry.kept is not None:
                raise TierValueError(f"{entry.key!r}: a version of it is kept already (commit or restore it first)")
            home = entry.copies.get(entry.home)
            assert home is not None and home.version == entry.version and entry.writeback is None, entry.key
            try:
                spare = engine.allocate(entry.nbytes)
            except TierBudgetError as e:
                raise StoreFullError(str(e)) from e
            taken.append(KeptVersion(entry, spare))
    except BaseException:
        for k in taken:
            k.free(engine)
        raise
    for k in taken:
        k.entry.kept = k
    return KeptVersions(state, taken)


__all__ = ["KeptVersion", "KeptVersions", "keep_versions"]
