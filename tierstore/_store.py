"""The tiered tensor store: keys, home tiers, cached copies, budgets, prefetch handles.

``TierStore`` is the front: the data path (put, get, prefetch, release) here, where copies live (write-back,
eviction, dropping, kept copies, victim orders) in its base ``_residency.Residency``; its parts each have one job:
the copy state machine (``_copies.py``, see
[Note: Versions, not flags]), room in the memory tiers (``_room.py``: budgets, eviction, waiting for other
threads), moving bytes (``_transfers.py``: fills, prefetches, write-backs), the device and the order of its work
(``_device.py``) and the drive (``_nvme.py``).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import psutil
import torch

from ._allocator import set_mmap_threshold
from ._config import StoreConfig, check_settings
from ._copies import Copy, Entry, StoreState, check_put, dense_strides
from ._device import Device, default_device
from ._fences import Fences
from ._handle import Handle
from ._mapped import mapped_copy
from ._memory import TierPool
from ._nvme import NvmeEngine, Syscalls
from ._residency import Residency
from ._room import BUDGET_WAIT_SECONDS, Room
from ._stats import StoreStats
from ._timeline import Timeline
from ._transfers import Transfers, done_future
from ._types import StoreFullError, StoreInUseError, StoreUser, Tier, TierTypeError, TierValueError
from ._versions import KeptVersions, keep_versions


def _check_budgets_fit_memory(config: StoreConfig, separate_device_memory: bool) -> None:
    """Budgets are promises of memory: one this machine cannot keep fails now, not as an out-of-memory kill
    later. Without CUDA the device tier is CPU memory too."""
    total = psutil.virtual_memory().total
    budgets = [("host_budget_bytes", config.host_budget_bytes)]
    if not separate_device_memory:
        budgets.append(("device_budget_bytes", config.device_budget_bytes))
    if sum(v for _, v in budgets) > total:
        given = " + ".join(f"{name}={value / 2**30:.2f} GiB" for name, value in budgets)
        raise TierValueError(f"{given} exceeds this machine's memory ({total / 2**30:.2f} GiB); lower them (host "
                             f"memory also holds the model's activations and the program itself)")



__all__ = ["BUDGET_WAIT_SECONDS", "Handle", "TierStore", "open_store"]


class TierStore(Residency):
    """Keeps tensors in a device -> host -> NVMe hierarchy under per-tier byte budgets.

    A tensor is registered with :meth:`put` under a key and a *home* tier, which
    holds its authoritative bytes; :meth:`prefetch` and :meth:`get` bring copies
    into faster tiers. A tensor returned by :meth:`get` aliases the store's
    buffer: modify it in place, call :meth:`mark_dirty`, and stop using it once
    :meth:`release` is called. All methods are thread-safe.
    """

    def __init__(self, config: StoreConfig | None = None, *, syscalls: Syscalls | None = None,
                 device: Device | None = None, **overrides: Any) -> None:
        config = _settle_config(config, overrides)
        self.config = config
        self.stats = StoreStats()
        # The device: CUDA when there is one; a test passes a simulated one (tierstore.testing.SimulatedDevice).
        device = device if device is not None else default_device(pin_host=config.pin_host_memory)
        _check_budgets_fit_memory(config, device.separate_memory)
        if config.malloc_mmap_threshold_bytes is not None:
            set_mmap_threshold(config.malloc_mmap_threshold_bytes)  # see [Note: Giving freed memory back]
        self.device = device.device
        pools = {
            Tier.DEVICE: TierPool(Tier.DEVICE, config.device_budget_bytes, device.device),
            Tier.HOST: TierPool(Tier.HOST, config.host_budget_bytes, torch.device("cpu"),
                                pin=device.pin if device.pins_host else None),
        }
        engine = NvmeEngine(config, syscalls=syscalls, stats=self.stats) if config.nvme_path is not None else None
        self._state = state = StoreState(config, self.stats, device, pools, engine)
        self._room = Room(state, start_writeback=lambda entry: self._transfers.start_writeback(entry))
        self._transfers = Transfers(state, self._room, max(2, config.io_threads // 2))
        self._users: list[StoreUser] = []  # see attach_user; the training thread's alone
        self._fences = Fences()  # keys a queued writer will change (see [Note: Fenced keys])

    # ---- put, get, release -------------------------------------------------------------
    def put(self, key: str, tensor: torch.Tensor, home: Tier | str = Tier.NVME, *,
            write_home: bool = True) -> Handle:
        """Register ``tensor``'s bytes under ``key`` with ``home`` as its authoritative tier.

        The bytes are copied; for an NVMe home they are staged in the host tier
        and written behind. The handle completes when the home tier holds them.
        With ``write_home=False`` the staged copy is left dirty instead (the
        handle completes at once): it reaches the drive only when the host tier
        needs its room, or on :meth:`flush`, so a short-lived tensor (a
        gradient) that fits costs the drive nothing.
        A dense tensor keeps its layout: ``get()`` gives back its strides
        (channels_last stays channels_last).
        """
        state = self._state
        state.check_open()
        home = Tier.parse(home)
        check_put(key, tensor, home, state.engine is not None)
        nbytes = tensor.numel() * tensor.element_size()
        entry = Entry(key, tensor.shape, tensor.dtype, nbytes, home, stride=dense_strides(tensor))
        with state.lock:
            if key in state.entries:
                raise TierValueError(f"key {key!r} is already in the store; drop() it first or use another key")
            self._room.check_fits(key, nbytes, home)
            state.register(entry)
        if nbytes == 0:
            return Handle(done_future(), key, home)
        try:
            with state.lock:
                staging = self._new_copy(entry, Tier.HOST if home is Tier.NVME else home)
                if home is Tier.NVME:
                    assert state.engine is not None
                    entry.copies[Tier.NVME] = Copy(Tier.NVME, version=-1, extent=state.engine.allocate(nbytes))
                state.view(entry, staging).copy_(tensor)
                if home is not Tier.NVME or not write_home:
                    return Handle(done_future(), key, home)
                fut = self._transfers.start_writeback(entry)
            assert fut is not None
            return Handle(fut, key, home, self._reporter(entry))
        except BaseException:
            with state.lock:
                state.drop_entry(entry)
            raise

    def _new_copy(self, entry: Entry, tier: Tier) -> Copy:
        buf = self._room.alloc(tier, entry.nbytes, may_skip=False, for_key=entry.key)
        assert buf is not None
        copy = Copy(tier, version=0, buffer=buf, last_use=next(self._state.tick))
        entry.copies[tier] = copy
        return copy

    def fence(self, keys: list[str], done: Future, writer: int, *, settle: Callable[[], None] | None = None) -> None:
        """Until ``done`` completes, a :meth:`get` of these keys by any thread but ``writer`` (a thread ident)
        waits for it, and raises ``FencedWriteError`` if it failed (until :meth:`unfence`); a prefetch of one
        starts once it is done (see [Note: Fenced keys]). For work queued to change them on another thread.
        ``settle``: called by such a get before it waits, to complete ``done`` on the reading thread, or to let
        paced work run at once."""
        self._fences.fence(keys, done, writer, settle)

    def _fenced_wait(self, start: float, end: float, key: str, tier: Tier) -> None:
        self.stats.add_wait(start, end, key=key, tier=tier.label)
        self.stats.add("fenced_waits")
        self.stats.add("fenced_wait_seconds", end - start)

    def keep_version(self, keys: list[str]) -> KeptVersions:
        """Keep the version each key holds now until ``commit()`` or ``restore()`` of what this returns: the next
        write-back of each goes to a spare extent taken now (``StoreFullError`` where the drive has no room for
        them, before anything changes), and ``restore()`` brings the kept versions back, reading and writing
        nothing (see [Note: Kept versions]). Each key's home must be the drive; a changed copy is written home
        first."""
        state = self._state
        state.check_open()
        with state.lock:
            entries = [state.lookup(k) for k in keys]
            for entry in entries:  # the changed ones' writes started together, then each waited for
                if entry.writeback is None and not entry.home_is_current():
                    self._transfers.start_writeback(entry)
            for entry in entries:  # (a write begun meanwhile, an eviction's, too: the kept version is the newest)
                while entry.writeback is not None or not entry.home_is_current():
                    if entry.writeback is None and self._transfers.start_writeback(entry) is None:
                        break
                    state.wait_for(entry.writeback or done_future())
                    if entry.error is not None:
                        err, entry.error = entry.error, None
                        raise err
            return keep_versions(state, entries)

    def unfence(self, keys: list[str]) -> None:
        """Lift the fences of ``keys`` (those a failed writer left: see :meth:`fence`)."""
        self._fences.lift(keys)

    def prefetch(self, key: str, tier: Tier | str = Tier.DEVICE) -> Handle:
        """Start bringing ``key`` into ``tier`` in the background; idempotent while in flight (after its fence:
        see :meth:`fence`)."""
        state = self._state
        state.check_open()
        tier = _memory_tier(tier)
        if self._fences.after(key, self.prefetch, key, tier):  # no closure made where no fence is
            return Handle(done_future(), key, tier)
        with state.lock:
            entry = state.lookup(key)
            copy = entry.copies.get(tier)
            if entry.nbytes == 0 or (copy is not None and copy.loading is None and copy.version == entry.version):
                if copy is not None:
                    copy.last_use = next(state.tick)
                return Handle(done_future(), key, tier)
            entry.prefetch_asked[tier] = next(state.tick)
            pending = entry.prefetches.get(tier)
            if pending is not None and not pending.done():
                return Handle(pending, key, tier)
            fut: Future = Future()
            entry.prefetches[tier] = fut
            self.stats.add("prefetches")
        self._transfers.submit_prefetch(entry, tier, fut)
        return Handle(fut, key, tier)

    def get(self, key: str, tier: Tier | str = Tier.DEVICE, *, sync_views: bool = False) -> torch.Tensor:
        """The tensor in ``tier``, held until :meth:`release`; waits for an in-flight prefetch.

        Time spent waiting here is counted as stall time (as background wait time on a thread
        inside ``stats.background()``). ``sync_views``: copies of the key freed while views of them lived (see
        [Note: A freed buffer still viewed]) get its current value, so that those views read it as views of
        the tensor itself would.
        """
        state = self._state
        state.check_open()
        tier = _memory_tier(tier)
        if (done := self._fences.pending(key)) is not None:  # see [Note: Fenced keys]
            self._fences.wait(key, done, lambda a, b: self._fenced_wait(a, b, key, tier))
        start = time.perf_counter()
        with state.lock:
            entry = state.lookup(key)
            entry.last_get = next(state.tick)
            self.stats.add("get_calls")
            if entry.error is not None:
                err, entry.error = entry.error, None
                raise err
            if entry.nbytes == 0:
                return torch.empty(entry.shape, dtype=entry.dtype, device=state.pools[tier].device)
            copy = entry.copies.get(tier)
            if copy is not None and copy.loading is None and copy.version == entry.version:
                self.stats.add("hits")
            else:
                # A get that finds its copy still loading waited on a late prefetch; any other had to fetch.
                late = copy is not None and copy.loading is not None
                self.stats.add("late_prefetches" if late else "misses")
                entry.getting += 1
                try:
                    copy = self._transfers.materialize(entry, tier, may_skip=False)
                finally:
                    entry.getting -= 1
                    self.stats.add_wait(start, time.perf_counter(), key=key, tier=tier.label)
            assert copy is not None
            me = threading.get_ident()
            copy.holders[me] = copy.holders.get(me, 0) + 1
            copy.last_use = next(state.tick)
            t = state.view(entry, copy)
            if sync_views and copy.buffer is not None:
                state.pools[tier].copy_into_viewed(key, copy.buffer.data, entry.nbytes)
            return t

    def read(self, key: str) -> torch.Tensor:
        """A copy of the tensor's current value in ordinary CPU memory (read through the host tier)."""
        t = self.get(key, Tier.HOST)
        try:
            return t.clone()
        finally:
            self.release(key, Tier.HOST)

    def read_mapped(self, key: str) -> torch.Tensor:
        """A copy of the tensor's current value, as :meth:`read` gives, in a private file on the drive mapped into
        memory (see [Note: Tensors mapped from a file]): for a caller that holds more such copies at once than the
        host budget (a whole state dict a saver walks). Its file lies beside the swap files, outside
        ``nvme_budget_bytes``, while the tensor lives; StoreFullError where the drive cannot take it beside
        ``nvme_reserve_bytes``. An ordinary copy where the store has no NVMe tier."""
        if self._state.engine is None:
            return self.read(key)
        t = self.get(key, Tier.HOST)
        try:
            return self.mapped(t, what=f"a mapped copy of tensor {key!r}")
        finally:
            self.release(key, Tier.HOST)

    def mapped(self, tensor: torch.Tensor, *, what: str = "a mapped copy of a tensor") -> torch.Tensor:
        """A copy of ``tensor`` (a CPU tensor) mapped from a private file, as :meth:`read_mapped` gives a stored
        tensor's (a value computed from one, such as decoded optimizer state, for a whole state dict). An
        ordinary copy where the store has no NVMe tier."""
        engine = self._state.engine
        if engine is None:
            return tensor.clone()
        engine.require_free(tensor.numel() * tensor.element_size(), what)
        return mapped_copy(engine.directory, tensor)

    def release(self, key: str, tier: Tier | str = Tier.DEVICE, *, guard_views: bool = False) -> None:
        """The caller is done with the tensor :meth:`get` returned; the copy becomes evictable.

        ``guard_views``: a view of that tensor may still be read later (by autograd, say); while one is alive
        the copy's memory is not reused once it is freed (see [Note: A freed buffer still viewed])."""
        state = self._state
        tier = Tier.parse(tier)
        with state.lock:
            entry = state.lookup(key)
            copy = entry.copies.get(tier)
            if entry.nbytes == 0:
                return
            if copy is None or copy.pins == 0:
                raise TierValueError(f"release({key!r}, {tier.label!r}) without a matching get()")
            # Released by the thread that got it, or (a hand-over) by another: one of the holders lets go.
            holder = threading.get_ident()
            if holder not in copy.holders:
                holder = next(iter(copy.holders))
            copy.holders[holder] -= 1
            if not copy.holders[holder]:
                del copy.holders[holder]
            if copy.buffer is not None and tier is Tier.DEVICE:
                state.device.record_use(copy.buffer)
            if copy.buffer is not None and guard_views:
                copy.buffer.guarded = True
            state.drop_if_stale(entry, copy)
            state.lock.notify_all()

    def mark_dirty(self, key: str, tier: Tier | str = Tier.DEVICE) -> None:
        """Say that the held copy in ``tier`` was modified; it is written back before it is dropped."""
        state = self._state
        tier = Tier.parse(tier)
        with state.lock:
            entry = state.lookup(key)
            if entry.nbytes == 0:
                return
            copy = entry.copies.get(tier)
            if copy is None or copy.pins == 0 or copy.version != entry.version:
                raise TierValueError(f"mark_dirty({key!r}, {tier.label!r}): get() the tensor in that tier first")
            entry.version += 1
            copy.version = entry.version
            for other in list(entry.copies.values()):
                if other is not copy:
                    state.drop_if_stale(entry, other)

    # ---- what is there -----------------------------------------------------------------
    def contains(self, key: str) -> bool:
        with self._state.lock:
            return key in self._state.entries

    __contains__ = contains

    def keys(self) -> list[str]:
        with self._state.lock:
            return list(self._state.entries)

    def info(self, key: str) -> dict[str, Any]:
        """Shape, dtype, strides (None when contiguous: see ``put``), size, home and, per tier holding a copy,
        its state."""
        with self._state.lock:
            entry = self._state.lookup(key)
            copies = {tier.label: {"state": entry.state(c), "pins": c.pins} for tier, c in entry.copies.items()}
            return {"shape": tuple(entry.shape), "dtype": entry.dtype, "stride": entry.stride, "nbytes": entry.nbytes,
                    "home": entry.home.label, "copies": copies}

    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes held and peak per tier."""
        return self._state.memory()

    def stats_dict(self) -> dict[str, Any]:
        """All counters as a plain dict (bytes/seconds per path, hits, misses, stall time...)."""
        out = self.stats.snapshot()
        out["memory"] = self.memory()
        return out

    def record_timeline(self, enabled: bool = True) -> Timeline | None:
        """Start (or stop, with ``enabled=False``) recording every transfer and stall; returns the
        :class:`Timeline`, which integrations also add their compute spans to."""
        self.stats.timeline = Timeline() if enabled else None
        return self.stats.timeline

    @property
    def timeline(self) -> Timeline | None:
        """The timeline being recorded, or None."""
        return self.stats.timeline

    def nvme_room_bytes(self) -> int:
        """Bytes the NVMe tier could still take (0 without one): what a caller checks before writing a model."""
        return self._state.engine.room_bytes() if self._state.engine is not None else 0

    def require_nvme_room(self, nbytes: int, what: str) -> None:
        """Raise StoreFullError, before anything is written, when the NVMe tier cannot take ``nbytes``; ``what``
        says what they are, with ``{size}`` where their size goes ("AdamW state of {size}")."""
        room = self.nvme_room_bytes()
        if nbytes > room:
            size = f"{nbytes / 2**20:.1f} MiB"
            engine, config = self._state.engine, self.config
            where = f" ({engine.describe_room()})" if engine is not None else " (the store has no nvme_path)"
            fixes = ["free space there", "choose another nvme_path"]
            if config.nvme_reserve_bytes:
                fixes.insert(1, "lower nvme_reserve_bytes")
            if config.nvme_budget_bytes is not None:
                fixes.insert(1, "raise nvme_budget_bytes")
            raise StoreFullError(f"{what.format(size=size)} needs that much room on the drive, but only "
                                 f"{room / 2**20:.1f} MiB is free for it under {config.nvme_path!r}{where}: "
                                 f"{', '.join(fixes[:-1])} or {fixes[-1]}")

    @property
    def swap_directory(self) -> str | None:
        return self._state.engine.directory if self._state.engine else None

    @property
    def direct_io(self) -> bool:
        """Whether the NVMe tier reads and writes with O_DIRECT (False without one, or where refused)."""
        return bool(self._state.engine and self._state.engine.direct)

    # ---- lifetime ----------------------------------------------------------------------
    def attach_user(self, user: StoreUser) -> None:
        """``user`` keeps values here that exist nowhere else (``offload_model`` attaches its offload): ``close()``
        gives them back through it first, or refuses (see :class:`~tierstore.StoreUser`)."""
        self._state.check_open()
        if user not in self._users:
            self._users.append(user)

    def detach_user(self, user: StoreUser) -> None:
        """``user`` no longer keeps values here (an offload's ``remove()``)."""
        if user in self._users:
            self._users.remove(user)

    def close(self) -> None:
        """Give back what attached users keep only here, wait for background work, free every buffer and delete
        the swap files.

        An offloaded model still attached (``offload_model`` without ``remove()``) first gets its values back
        as ordinary tensors, as ``off.remove()`` gives them (its optimizer's state goes with it), so that
        closing loses no trained weight. Where they cannot be given back (more than the memory free to hold
        them, or a forward running), :class:`~tierstore.StoreInUseError` says what to call first and nothing is
        closed.
        """
        state = self._state
        with state.lock:
            if state.closed:
                return
        users = list(self._users)
        claimed: dict[str, int] = {}  # what the users before take of each device's memory
        refusals = [why for why in (u.close_refusal(claimed) for u in users) if why]
        if refusals:
            raise StoreInUseError(f"store.close(): {refusals[0]}. Nothing was closed")
        for i, user in enumerate(users):
            try:
                user.store_closing()
            except BaseException as e:
                if hasattr(e, "add_note"):
                    e.add_note(f"tierstore: store.close() could not give an offloaded model its values back"
                               f"{f' ({i} before it were)' if i else ''}; the store is still open: close() again "
                               f"tries again from where it stopped")
                raise
            self.detach_user(user)
        with state.lock:
            if state.closed:
                return
            state.closed = True
        self._transfers.movers.shutdown(wait=True)
        if state.engine is not None:
            state.engine.close()
        with state.lock:
            # Every copy's buffer back to its pool, so that each arena is wholly free and goes back to the system
            # now, not when the store is collected (a tensor still viewing a buffer keeps its memory alive).
            for entry in state.entries.values():
                for copy in list(entry.copies.values()):
                    copy.extent = None  # the swap files went with the engine
                    state.free_copy(entry, copy)
            state.entries.clear()
            for pool in state.pools.values():
                pool.close()
        state.device.close()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __enter__(self) -> TierStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """``close()``; where it refuses (see there) while the block raises, the block's exception goes on with a
        note of why the store is still open, instead of being replaced by the refusal."""
        try:
            self.close()
        except Exception as refusal:  # noqa: BLE001 (noted on the block's own exception, which goes on)
            if exc is None:
                raise
            note = (f"tierstore: the store was left open, its swap files removed at exit: "
                    f"{type(refusal).__name__}: {refusal}")
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            else:  # Python 3.10
                warnings.warn(note, RuntimeWarning, stacklevel=2)


def _settle_config(config: StoreConfig | None, overrides: dict[str, Any]) -> StoreConfig:
    """The config a TierStore was given, with keyword overrides applied; misspelt settings name the closest."""
    check_settings(overrides, "TierStore(...)")
    if config is None:
        config = StoreConfig(**overrides)
    elif overrides:
        config = config.replace(**overrides)
    if not isinstance(config, StoreConfig):
        raise TierTypeError(f"config must be a StoreConfig, not {type(config).__name__}")
    return config


def _memory_tier(tier: Tier | str) -> Tier:
    tier = Tier.parse(tier)
    if tier is Tier.NVME:
        raise TierValueError("NVMe copies are files, not tensors: get or prefetch into 'host' or 'device'")
    return tier


def open_store(config: StoreConfig | None = None, **overrides: Any) -> TierStore:
    """Create a :class:`TierStore` from a config and/or keyword overrides."""
    return TierStore(config, **overrides)
