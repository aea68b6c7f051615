"""The tiered tensor store: keys, home tiers, cached copies, budgets, prefetch handles.

[Note: Versions, not flags] Every key has a version, bumped by mark_dirty().
Each copy remembers the version of the bytes it holds. A copy whose version
is the key's is *current*; the home copy being current means every current
copy is clean; a current copy that is the only holder of the newest version
is dirty and is never freed before a write-back of it has completed. Copies
of an older version are stale and are dropped as soon as nobody holds them.
This keeps the rules right when a write-back races a new mark_dirty().

[Note: Who waits on whom] Background work runs on two pools: the I/O engine's
threads, which only do syscalls, and the mover threads, which run prefetches
end to end (allocate, read, copy between tiers). A mover waits only on engine
futures, on write-backs (engine work), and on copies that a mover already
running is loading, so no cycle of waits can form.
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from ._config import StoreConfig
from ._device import Device, default_device
from ._memory import Buffer, TierPool
from ._nvme import Extent, NvmeEngine, Syscalls
from ._stats import StoreStats
from ._timeline import Timeline
from ._types import StoreClosedError, StoreFullError, Tier, TierBudgetError, TierStoreError

_UNSUPPORTED_DTYPES = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


@dataclass(eq=False)
class _Copy:
    tier: Tier
    version: int
    buffer: Buffer | None = None  # DEVICE / HOST
    extent: Extent | None = None  # NVME
    loading: Future | None = None  # set while bytes are being read into it
    holders: dict[int, int] = field(default_factory=dict)  # thread ident -> its get()s not yet released
    io_refs: int = 0  # transfers reading from or writing into it
    last_use: int = 0

    @property
    def pins(self) -> int:
        """get()s not yet released, by any thread."""
        return sum(self.holders.values())


@dataclass(eq=False)
class _Entry:
    key: str
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    home: Tier
    version: int = 0
    copies: dict[Tier, _Copy] = field(default_factory=dict)
    error: BaseException | None = None  # a background failure, raised by the next get()
    error_in_write: bool = False  # the failure was a write-back (a later good one clears it)
    writeback: Future | None = None
    prefetches: dict[Tier, Future] = field(default_factory=dict)
    dropped: bool = False


class Handle:
    """Pending work on one key: ``wait()`` blocks and re-raises a failure; ``done()`` polls."""

    def __init__(self, future: Future, key: str, tier: Tier) -> None:
        self._future = future
        self.key = key
        self.tier = tier

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        try:
            self._future.result(timeout)
        except TierStoreError:
            raise
        except TimeoutError:
            raise
        except BaseException as e:
            raise TierStoreError(f"{self.key!r} -> {self.tier.label}: {e!r}") from e

    @property
    def skipped(self) -> bool:
        """True if a prefetch was dropped because its tier was full of held copies."""
        return self._future.done() and self._future.exception() is None and self._future.result() is False

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"Handle({self.key!r}, {self.tier.label}, {state})"


# How long an allocation waits for other threads to release what they hold (see [Note: Waiting for room]).
BUDGET_WAIT_SECONDS = 30.0


def _check_budgets_fit_memory(config: StoreConfig, separate_device_memory: bool) -> None:
    """Budgets are promises of memory: one this machine cannot keep fails now, not as an out-of-memory kill
    later. Without CUDA the device tier is CPU memory too."""
    total = psutil.virtual_memory().total
    budgets = [("host_budget_bytes", config.host_budget_bytes)]
    if not separate_device_memory:
        budgets.append(("device_budget_bytes", config.device_budget_bytes))
    if sum(v for _, v in budgets) > total:
        given = " + ".join(f"{name}={value / 2**30:.2f} GiB" for name, value in budgets)
        raise ValueError(f"{given} exceeds this machine's memory ({total / 2**30:.2f} GiB); lower them (host "
                         f"memory also holds the model's activations and the program itself)")


def _done_future(result: Any = True) -> Future:
    f: Future = Future()
    f.set_result(result)
    return f


class TierStore:
    """Keeps tensors in a device -> host -> NVMe hierarchy under per-tier byte budgets.

    A tensor is registered with :meth:`put` under a key and a *home* tier, which
    holds its authoritative bytes; :meth:`prefetch` and :meth:`get` bring copies
    into faster tiers. A tensor returned by :meth:`get` aliases the store's
    buffer: modify it in place, call :meth:`mark_dirty`, and stop using it once
    :meth:`release` is called. All methods are thread-safe.
    """

    def __init__(self, config: StoreConfig | None = None, *, syscalls: Syscalls | None = None,
                 device: Device | None = None, **overrides: Any) -> None:
        unknown = sorted(set(overrides) - set(StoreConfig.__dataclass_fields__))
        if unknown:
            fields = StoreConfig.__dataclass_fields__
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, fields, 1)) else repr(k)
                     for k in unknown]
            raise TypeError(f"TierStore got unknown settings {', '.join(hints)}; the settings are: "
                            f"{', '.join(StoreConfig.__dataclass_fields__)}")
        if config is None:
            config = StoreConfig(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        if not isinstance(config, StoreConfig):
            raise TypeError(f"config must be a StoreConfig, not {type(config).__name__}")
        self.config = config
        self.stats = StoreStats()
        # The device: CUDA when there is one; a test passes a simulated one (tierstore.testing.SimulatedDevice).
        self._device = device if device is not None else default_device(pin_host=config.pin_host_memory)
        _check_budgets_fit_memory(config, self._device.separate_memory)
        self.device = self._device.device
        self._pools = {
            Tier.DEVICE: TierPool(Tier.DEVICE, config.device_budget_bytes, self.device),
            Tier.HOST: TierPool(Tier.HOST, config.host_budget_bytes, torch.device("cpu"),
                                pin=self._device.pins_host),
        }
        self._syscalls = syscalls
        self._engine: NvmeEngine | None = None
        if config.nvme_path is not None:
            self._engine = NvmeEngine(config, syscalls=syscalls, stats=self.stats)
        self._cv = threading.Condition(threading.RLock())
        self._entries: dict[str, _Entry] = {}
        self._movers = ThreadPoolExecutor(max(2, config.io_threads // 2), thread_name_prefix="tierstore-mover")
        self._tick = itertools.count(1)
        self._victim_order: Callable[[Tier, list[str]], list[str]] | None = None
        # token -> (victim order, which keys it ranks) of each owner (see [Note: Several owners' victim orders])
        self._owner_orders: dict[object, tuple[Callable[[Tier, list[str]], list[str]], Callable[[str], bool]]] = {}
        # (thread ident, tier) -> its _alloc calls waiting for other threads to release room in that tier
        self._waiting_for_room: dict[tuple[int, Tier], int] = {}
        self._closed = False

    # ---- public API --------------------------------------------------------------------
    def put(self, key: str, tensor: torch.Tensor, home: Tier | str = Tier.NVME) -> Handle:
        """Register ``tensor``'s bytes under ``key`` with ``home`` as its authoritative tier.

        The bytes are copied; for an NVMe home they are staged in the host tier
        and written behind. The handle completes when the home tier holds them.
        """
        self._check_open()
        home = Tier.parse(home)
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must be a non-empty str, not {key!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put({key!r}) needs a torch.Tensor, not {type(tensor).__name__}")
        if tensor.dtype in _UNSUPPORTED_DTYPES or tensor.is_quantized or tensor.is_sparse:
            raise TypeError(f"put({key!r}): dtype {tensor.dtype} / layout {tensor.layout} is not supported; "
                            "store a dense tensor (dequantize or .to_dense() it first)")
        if not tensor.is_contiguous():
            raise ValueError(f"put({key!r}): the tensor is not contiguous; pass tensor.contiguous()")
        if home is Tier.NVME and self._engine is None:
            raise ValueError(f"put({key!r}, home='nvme') needs nvme_path set in the config")
        nbytes = tensor.numel() * tensor.element_size()
        entry = _Entry(key, tensor.shape, tensor.dtype, nbytes, home)
        with self._cv:
            if key in self._entries:
                raise ValueError(f"key {key!r} is already in the store; drop() it first or use another key")
            self._check_fits(key, nbytes, home)
            self._entries[key] = entry
        if nbytes == 0:
            return Handle(_done_future(), key, home)
        try:
            with self._cv:
                if home is Tier.NVME:
                    staging = self._new_copy(entry, Tier.HOST, version=0)
                    entry.copies[Tier.NVME] = _Copy(Tier.NVME, version=-1, extent=self._engine.allocate(nbytes))
                else:
                    staging = self._new_copy(entry, home, version=0)
                self._view(entry, staging).copy_(tensor)
                if home is not Tier.NVME:
                    return Handle(_done_future(), key, home)
                fut = self._start_writeback(entry)
            assert fut is not None
            return Handle(fut, key, home)
        except BaseException:
            with self._cv:
                self._drop_entry(entry)
            raise

    def prefetch(self, key: str, tier: Tier | str = Tier.DEVICE) -> Handle:
        """Start bringing ``key`` into ``tier`` in the background; idempotent while in flight."""
        self._check_open()
        tier = self._check_memory_tier(tier)
        with self._cv:
            entry = self._lookup(key)
            copy = entry.copies.get(tier)
            if entry.nbytes == 0 or (copy is not None and copy.loading is None and copy.version == entry.version):
                if copy is not None:
                    copy.last_use = next(self._tick)
                return Handle(_done_future(), key, tier)
            pending = entry.prefetches.get(tier)
            if pending is not None and not pending.done():
                return Handle(pending, key, tier)
            fut: Future = Future()
            entry.prefetches[tier] = fut
            self.stats.add("prefetches")
        self._movers.submit(self._prefetch_task, entry, tier, fut)
        return Handle(fut, key, tier)

    def get(self, key: str, tier: Tier | str = Tier.DEVICE) -> torch.Tensor:
        """The tensor in ``tier``, held until :meth:`release`; waits for an in-flight prefetch.

        Time spent waiting here is counted as stall time (as background wait time on a thread
        inside ``stats.background()``).
        """
        self._check_open()
        tier = self._check_memory_tier(tier)
        start = time.perf_counter()
        with self._cv:
            entry = self._lookup(key)
            self.stats.add("get_calls")
            if entry.error is not None:
                err, entry.error = entry.error, None
                raise err
            if entry.nbytes == 0:
                return torch.empty(entry.shape, dtype=entry.dtype, device=self._device_of(tier))
            copy = entry.copies.get(tier)
            if copy is not None and copy.loading is None and copy.version == entry.version:
                self.stats.add("hits")
            else:
                # A get that finds its copy still loading waited on a late prefetch; any other had to fetch.
                late = copy is not None and copy.loading is not None
                self.stats.add("late_prefetches" if late else "misses")
                try:
                    copy = self._materialize(entry, tier, may_skip=False)
                finally:
                    self.stats.add_wait(start, time.perf_counter(), key=key, tier=tier.label)
            assert copy is not None
            me = threading.get_ident()
            copy.holders[me] = copy.holders.get(me, 0) + 1
            copy.last_use = next(self._tick)
            return self._view(entry, copy)

    def read(self, key: str) -> torch.Tensor:
        """A copy of the tensor's current value in ordinary CPU memory (read through the host tier)."""
        t = self.get(key, Tier.HOST)
        try:
            return t.clone()
        finally:
            self.release(key, Tier.HOST)

    def release(self, key: str, tier: Tier | str = Tier.DEVICE) -> None:
        """The caller is done with the tensor :meth:`get` returned; the copy becomes evictable."""
        tier = Tier.parse(tier)
        with self._cv:
            entry = self._lookup(key)
            copy = entry.copies.get(tier)
            if entry.nbytes == 0:
                return
            if copy is None or copy.pins == 0:
                raise ValueError(f"release({key!r}, {tier.label!r}) without a matching get()")
            # Released by the thread that got it, or (a hand-over) by another: one of the holders lets go.
            holder = threading.get_ident()
            if holder not in copy.holders:
                holder = next(iter(copy.holders))
            copy.holders[holder] -= 1
            if not copy.holders[holder]:
                del copy.holders[holder]
            if copy.buffer is not None and tier is Tier.DEVICE:
                self._device.record_use(copy.buffer)
            self._drop_if_stale(entry, copy)
            self._cv.notify_all()

    def mark_dirty(self, key: str, tier: Tier | str = Tier.DEVICE) -> None:
        """Say that the held copy in ``tier`` was modified; it is written back before it is dropped."""
        tier = Tier.parse(tier)
        with self._cv:
            entry = self._lookup(key)
            if entry.nbytes == 0:
                return
            copy = entry.copies.get(tier)
            if copy is None or copy.pins == 0 or copy.version != entry.version:
                raise ValueError(f"mark_dirty({key!r}, {tier.label!r}): get() the tensor in that tier first")
            entry.version += 1
            copy.version = entry.version
            for other in list(entry.copies.values()):
                if other is not copy:
                    self._drop_if_stale(entry, other)

    def write_back(self, key: str) -> Handle:
        """Start writing the newest bytes of ``key`` to its home tier."""
        self._check_open()
        with self._cv:
            entry = self._lookup(key)
            fut = self._start_writeback(entry)
        return Handle(fut or _done_future(), key, entry.home)

    def flush(self) -> None:
        """Write every dirty copy back to its home tier and wait; raises the first failure."""
        self._check_open()
        with self._cv:
            while True:
                pending = []
                for entry in list(self._entries.values()):
                    fut = self._start_writeback(entry)  # None when home is current; the one in flight if any
                    if fut is not None:
                        pending.append(fut)
                if not pending:
                    return
                for fut in pending:
                    self._wait_unlocked(fut)
                    if fut.exception() is not None:
                        raise fut.exception()

    def evict(self, key: str, tier: Tier | str) -> None:
        """Drop the cached copy of ``key`` in ``tier``, writing it back first if it is dirty."""
        self._check_open()
        tier = Tier.parse(tier)
        with self._cv:
            entry = self._lookup(key)
            if tier is entry.home:
                raise ValueError(f"evict({key!r}, {tier.label!r}): that is its home tier; use drop() to remove it")
            while True:
                copy = entry.copies.get(tier)
                if copy is None:
                    return
                if copy.pins:
                    raise ValueError(f"evict({key!r}, {tier.label!r}): the copy is held; release() it first")
                if copy.loading is not None or copy.io_refs:
                    self._wait_unlocked(copy.loading or entry.writeback or _done_future())
                    if copy.io_refs and entry.writeback is None:
                        self._cv.wait(0.01)
                    continue
                if self._unsaved(entry, copy):
                    fut = self._start_writeback(entry)
                    self._wait_unlocked(fut)
                    if fut.exception() is not None:
                        raise fut.exception()
                    continue
                self._free_copy(entry, copy)
                self.stats.add("evictions")
                return

    def drop(self, key: str) -> None:
        """Remove ``key`` and free every copy, discarding unwritten changes."""
        self._check_open()
        with self._cv:
            entry = self._lookup(key)
            self._drop_entry(entry)

    def contains(self, key: str) -> bool:
        with self._cv:
            return key in self._entries

    __contains__ = contains

    def keys(self) -> list[str]:
        with self._cv:
            return list(self._entries)

    def info(self, key: str) -> dict[str, Any]:
        """Shape, dtype, size, home and, per tier holding a copy, its state."""
        with self._cv:
            entry = self._lookup(key)
            copies = {}
            for tier, c in entry.copies.items():
                state = "loading" if c.loading is not None else (
                    "stale" if c.version < entry.version else
                    "dirty" if tier is not entry.home and self._home(entry).version != entry.version
                    else "clean")
                copies[tier.label] = {"state": state, "pins": c.pins}
            return {"shape": tuple(entry.shape), "dtype": entry.dtype, "nbytes": entry.nbytes,
                    "home": entry.home.label, "copies": copies}

    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes held and peak per tier."""
        out = {t.label: {"held_bytes": p.held_bytes, "live_bytes": p.live_bytes,
                         "peak_bytes": p.peak_held_bytes, "budget_bytes": p.budget_bytes}
               for t, p in self._pools.items()}
        e = self._engine
        out["nvme"] = {"held_bytes": e.used_bytes if e else 0, "live_bytes": e.used_bytes if e else 0,
                       "peak_bytes": e.peak_used_bytes if e else 0,
                       "budget_bytes": self.config.nvme_budget_bytes or -1}
        return out

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

    def set_victim_order(self, fn: Callable[[Tier, list[str]], list[str]] | None) -> None:
        """Install an eviction policy for every key: given a tier and candidate keys (least recently used
        first), return them in the order they should be evicted. None restores LRU."""
        self._victim_order = fn

    def add_victim_order(self, fn: Callable[[Tier, list[str]], list[str]], owns: Callable[[str], bool]) -> object:
        """Install the eviction policy of one owner (an offloaded model) for the keys ``owns`` says are its own;
        returns a token for :meth:`remove_victim_order`. See [Note: Several owners' victim orders]."""
        token = object()
        with self._cv:
            self._owner_orders[token] = (fn, owns)
        return token

    def remove_victim_order(self, token: object) -> None:
        with self._cv:
            self._owner_orders.pop(token, None)

    def close(self) -> None:
        """Wait for background work, free every buffer and delete the swap files."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
        self._movers.shutdown(wait=True)
        if self._engine is not None:
            self._engine.close()
        with self._cv:
            self._entries.clear()
            for pool in self._pools.values():
                pool.clear()
        self._device.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def is_waiting_for_room(self, thread_ident: int) -> bool:
        """Whether that thread is waiting for other threads to release memory (see [Note: Waiting for room])."""
        with self._cv:
            return any(t == thread_ident for t, _ in self._waiting_for_room)

    def nvme_room_bytes(self) -> int:
        """Bytes the NVMe tier could still take (0 without one): what a caller checks before writing a model."""
        return self._engine.room_bytes() if self._engine is not None else 0

    def require_nvme_room(self, nbytes: int, what: str) -> None:
        """Raise StoreFullError, before anything is written, when the NVMe tier cannot take ``nbytes``; ``what``
        says what they are, with ``{size}`` where their size goes ("AdamW state of {size}")."""
        room = self.nvme_room_bytes()
        if nbytes > room:
            size = f"{nbytes / 2**20:.1f} MiB"
            raise StoreFullError(f"{what.format(size=size)} needs that much room on the drive, but only "
                                 f"{room / 2**20:.1f} MiB is free under {self.config.nvme_path!r} (within "
                                 f"nvme_budget_bytes): free space there, or choose another nvme_path")

    def undo_puts(self, handles: list[Handle]) -> None:
        """Take back what the puts of ``handles`` registered (their writes finished or failed): what a
        constructor that fails part-way calls, so that nothing of it is left in the store."""
        for h in handles:
            with contextlib.suppress(BaseException):
                h.wait()
            if self.contains(h.key):
                self.drop(h.key)

    @property
    def swap_directory(self) -> str | None:
        return self._engine.directory if self._engine else None

    def __enter__(self) -> TierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- checks ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed; create a new TierStore")

    def _check_memory_tier(self, tier: Tier | str) -> Tier:
        tier = Tier.parse(tier)
        if tier is Tier.NVME:
            raise ValueError("NVMe copies are files, not tensors: get or prefetch into 'host' or 'device'")
        return tier

    def _lookup(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            self._check_open()  # after close() every key is gone: say so, not "put() it first"
            raise KeyError(f"unknown key {key!r}: put() it into the store first") from None

    def _check_fits(self, key: str, nbytes: int, home: Tier) -> None:
        cap = TierPool.capacity_for(nbytes)
        if home is Tier.DEVICE and cap > self.config.device_budget_bytes:
            raise TierBudgetError(
                f"put({key!r}): {nbytes} bytes exceed device_budget_bytes={self.config.device_budget_bytes}; "
                "raise the budget or give it a slower home")
        if home is not Tier.DEVICE and cap > self.config.host_budget_bytes:
            raise TierBudgetError(
                f"put({key!r}): {nbytes} bytes exceed host_budget_bytes={self.config.host_budget_bytes}, "
                "through which every transfer is staged; raise host_budget_bytes or split the tensor")

    def _device_of(self, tier: Tier) -> torch.device:
        return self._pools[tier].device

    # ---- copies ------------------------------------------------------------------------
    def _home(self, entry: _Entry) -> _Copy | None:
        return entry.copies.get(entry.home)

    def _view(self, entry: _Entry, copy: _Copy) -> torch.Tensor:
        """The copy as a tensor, ready for whoever reads it next (see [Note: Ordering device work])."""
        assert copy.buffer is not None
        if copy.tier is Tier.DEVICE:
            self._device.ready_for_compute(copy.buffer)
        else:
            self._device.ready_for_cpu(copy.buffer)
        return copy.buffer.view(entry.shape, entry.dtype, entry.nbytes)

    def _unsaved(self, entry: _Entry, copy: _Copy) -> bool:
        """True if dropping ``copy`` now would lose bytes or cost a staged write: it is current, the home copy is
        not, and no other current copy can be written home directly. A device copy is written to an NVMe home
        through a host copy, so while a current host copy is there, the host copy is the one written back: drop it
        unsaved and the device copy would have to be staged back through a host tier that may then be full."""
        if copy.version != entry.version:
            return False
        home = entry.copies.get(entry.home)
        if home is not None and home.version == entry.version:
            return False
        return not any(c is not copy and c.version == entry.version and c.loading is None
                       and not (entry.home is Tier.NVME and c.tier is Tier.DEVICE)
                       for c in entry.copies.values())

    def _new_copy(self, entry: _Entry, tier: Tier, version: int, *, may_skip: bool = False) -> _Copy | None:
        buf = self._alloc(tier, entry.nbytes, may_skip=may_skip, for_key=entry.key)
        if buf is None:
            return None
        copy = _Copy(tier, version=version, buffer=buf, last_use=next(self._tick))
        entry.copies[tier] = copy
        return copy

    def _free_copy(self, entry: _Entry, copy: _Copy) -> None:
        if entry.copies.get(copy.tier) is copy:
            del entry.copies[copy.tier]
        if copy.buffer is not None:
            self._pools[copy.tier].free(copy.buffer)
            copy.buffer = None
        if copy.extent is not None and self._engine is not None:
            self._engine.free(copy.extent)
            copy.extent = None
        self._cv.notify_all()

    def _drop_if_stale(self, entry: _Entry, copy: _Copy) -> None:
        if copy.version < entry.version and copy.tier is not entry.home and not copy.pins \
                and copy.loading is None and not copy.io_refs:
            self._free_copy(entry, copy)

    def _drop_entry(self, entry: _Entry) -> None:
        if entry.dropped:
            return
        # In-flight transfers keep their buffers; wait for them so nothing is reused under them.
        while any(c.loading is not None or c.io_refs for c in entry.copies.values()):
            self._cv.wait(0.05)
        entry.dropped = True
        self._entries.pop(entry.key, None)
        for copy in list(entry.copies.values()):
            self._free_copy(entry, copy)

    def _wait_unlocked(self, fut: Future) -> None:
        """Wait for ``fut`` with the store lock released (it is re-taken before returning)."""
        while not fut.done():
            self._cv.wait(0.05)

    def _release_all(self) -> Any:
        """Release the store lock however deeply it is held; returns what re-takes it."""
        return self._cv._release_save()  # type: ignore[attr-defined]

    def _retake(self, state: Any) -> None:
        self._cv._acquire_restore(state)  # type: ignore[attr-defined]

    # ---- budgets and eviction -----------------------------------------------------------
    def _alloc(self, tier: Tier, nbytes: int, *, may_skip: bool, for_key: str) -> Buffer | None:
        pool = self._pools[tier]
        waited_since: float | None = None
        while True:
            if self._closed:
                raise StoreClosedError("the store was closed while waiting for space")
            buf = pool.try_alloc(nbytes)
            if buf is not None:
                return buf
            need = pool.capacity_for(nbytes)
            if self._evict_clean(tier, need):
                continue
            if self._start_eviction_writebacks(tier):
                self._cv.wait(0.05)
                continue
            busy = [c for e in self._entries.values() for c in e.copies.values()
                    if c.tier is tier and not c.pins and (c.loading is not None or c.io_refs)]
            if busy:
                self._cv.wait(0.05)
                continue
            buf = pool.try_alloc(nbytes, dissolve=True)  # nothing left to evict: the free bytes are in pieces
            if buf is not None:
                return buf
            if may_skip:
                return None
            # [Note: Waiting for room] What remains is held by get()s. Held by other threads (the optimizer's
            # worker, the training thread), it will be released as they go on: wait, as long as one of them is
            # not itself waiting here for room in this tier (then no one could go on), and for at most
            # BUDGET_WAIT_SECONDS (a holder may be waiting for this thread some other way).
            me = threading.get_ident()
            others = {t for e in self._entries.values() for c in e.copies.values() if c.tier is tier
                      for t in c.holders if t != me}
            if others and not others <= {t for t, waits_in in self._waiting_for_room if waits_in is tier}:
                if waited_since is None:
                    waited_since = time.perf_counter()
                    self.stats.add("budget_waits")
                if time.perf_counter() - waited_since < BUDGET_WAIT_SECONDS:
                    waiter = (me, tier)
                    self._waiting_for_room[waiter] = self._waiting_for_room.get(waiter, 0) + 1
                    try:
                        self._cv.wait(0.05)
                    finally:
                        self._waiting_for_room[waiter] -= 1
                        if not self._waiting_for_room[waiter]:
                            del self._waiting_for_room[waiter]
                    continue
            raise TierBudgetError(self._budget_message(tier, need, for_key, waited_since))

    def _budget_message(self, tier: Tier, need: int, for_key: str, waited_since: float | None) -> str:
        pool = self._pools[tier]
        copies = [(e, c) for e in self._entries.values() for c in e.copies.values()
                  if c.tier is tier and c.buffer is not None]
        homes = sum(c.buffer.capacity for e, c in copies if e.home is tier and not c.pins)
        unsaved = sum(c.buffer.capacity for e, c in copies if e.home is not tier and not c.pins and self._unsaved(e, c))
        names = {t.ident: t.name for t in threading.enumerate()}
        by_thread: dict[str, list[str]] = {}
        for e, c in copies:
            for t in c.holders:
                by_thread.setdefault(names.get(t, f"thread {t}"), []).append(e.key)
        held = "; ".join(f"{who} holds {len(keys)} ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''})"
                         for who, keys in by_thread.items()) or "none held"
        waited = (f" after waiting {time.perf_counter() - waited_since:.1f} s for other threads to release theirs"
                  if waited_since is not None else "")
        return (f"{tier.label} tier cannot fit {need} bytes for {for_key!r}{waited}: {pool.live_bytes} of "
                f"{pool.budget_bytes} budget bytes are in use, {homes} by tensors whose home is this tier, "
                f"{unsaved} by changed copies that could not be written home (through the host tier) and the "
                f"rest by get() without release(): {held}. Release tensors you are done with or raise "
                f"{tier.label}_budget_bytes")

    def _candidates(self, tier: Tier) -> list[tuple[_Entry, _Copy]]:
        out = [(e, c) for e in self._entries.values() for c in e.copies.values()
               if c.tier is tier and tier is not e.home and not c.pins and c.loading is None and not c.io_refs]
        out.sort(key=lambda ec: ec[1].last_use)
        if self._victim_order is not None and out:
            by_key = {e.key: (e, c) for e, c in out}
            order = self._victim_order(tier, list(by_key))
            out = [by_key[k] for k in order if k in by_key] + [ec for k, ec in by_key.items() if k not in order]
        elif self._owner_orders and out:
            out = self._by_owner_orders(tier, out)
        return out

    def _by_owner_orders(self, tier: Tier, out: list[tuple[_Entry, _Copy]]) -> list[tuple[_Entry, _Copy]]:
        """[Note: Several owners' victim orders] Each owner ranks its own keys (Belady over its own trace); no
        owner can say when another's copy is next used. So keys no owner claims go first (least recently used
        first), then the owners give up their farthest copy in turn, round robin."""
        by_key = {e.key: (e, c) for e, c in out}
        claimed: set[str] = set()
        ranked: list[list[str]] = []
        for fn, owns in list(self._owner_orders.values()):
            mine = [k for k in by_key if k not in claimed and owns(k)]
            claimed.update(mine)
            ranked.append([k for k in fn(tier, mine) if k in by_key] if mine else [])
        order = [k for k in by_key if k not in claimed]
        for turn in itertools.zip_longest(*ranked):
            order.extend(k for k in turn if k is not None)
        return [by_key[k] for k in order]

    def _evict_clean(self, tier: Tier, need: int) -> bool:
        """Free clean, unheld copies in ``tier`` until ``need`` bytes could fit. True if any freed."""
        freed = 0
        pool = self._pools[tier]
        for entry, copy in self._candidates(tier):
            if self._unsaved(entry, copy):
                continue
            freed += copy.buffer.capacity if copy.buffer else 0
            self._free_copy(entry, copy)
            self.stats.add("evictions")
            if pool.can_fit(need):
                break
        return freed > 0

    def _start_eviction_writebacks(self, tier: Tier) -> bool:
        started = False
        for entry, copy in self._candidates(tier):
            if self._unsaved(entry, copy) and entry.writeback is None and entry.error is None:
                try:
                    if self._start_writeback(entry) is not None:
                        started = True
                except TierBudgetError:
                    continue
                break  # one at a time: each frees a whole copy
        return started or any(e.writeback is not None for e in self._entries.values())

    # ---- transfers ---------------------------------------------------------------------
    def _source(self, entry: _Entry, target: Tier) -> _Copy | None:
        current = [c for c in entry.copies.values()
                   if c.version == entry.version and c.loading is None and c.tier is not target]
        if not current:
            return None
        # Nearest tier first: host before NVMe for a device target, device before NVMe for host.
        return min(current, key=lambda c: (abs(c.tier - target), c.tier))

    def _copy_memory(self, src: _Copy, dst: _Copy, entry: _Entry) -> None:
        """Copy between DEVICE and HOST buffers (lock released by the caller)."""
        t0 = time.perf_counter()
        assert src.buffer is not None and dst.buffer is not None
        n = entry.nbytes
        self._device.copy(dst.buffer, src.buffer, n)  # returns once queued (see [Note: Ordering device work])
        self.stats.add_transfer(src.tier, dst.tier, n, time.perf_counter() - t0, entry.key)

    def _prefetch_task(self, entry: _Entry, tier: Tier, fut: Future) -> None:
        try:
            with self._cv:
                copy = self._materialize(entry, tier, may_skip=True)
                if copy is None:
                    self.stats.add("prefetch_skipped")
            fut.set_result(copy is not None)
        except BaseException as e:  # an I/O failure was also kept for the next get()
            fut.set_exception(e)

    def _materialize(self, entry: _Entry, tier: Tier, *, may_skip: bool) -> _Copy | None:
        """Make a current, readable copy of ``entry`` in ``tier``. Lock held; released while waiting."""
        while True:
            if entry.dropped:
                raise KeyError(f"key {entry.key!r} was dropped")
            if self._closed:
                raise StoreClosedError("the store was closed while a transfer was pending")
            copy = entry.copies.get(tier)
            if copy is not None and copy.loading is not None:
                loading = copy.loading
                self._wait_unlocked(loading)
                err = loading.exception()
                if err is not None and not may_skip:
                    if entry.error is err:  # this get() is the one that reports it
                        entry.error = None
                    raise err
                continue
            if copy is not None and copy.version == entry.version:
                return copy
            if copy is not None:  # stale
                if copy.pins:
                    raise TierStoreError(
                        f"{entry.key!r} is held in the {tier.label} tier at an older version; "
                        "release() it before getting the new one")
                if copy.io_refs:  # the store's own write-back of it is in flight: it is freed when done
                    self._cv.wait(0.05)
                    continue
                self._free_copy(entry, copy)
            src = self._source(entry, tier)
            if src is None:
                raise TierStoreError(f"{entry.key!r} has no readable copy (an earlier write failed?)")
            if tier is Tier.DEVICE and src.tier is Tier.NVME:
                staged = self._materialize(entry, Tier.HOST, may_skip=may_skip)
                if staged is None:
                    return None
                continue
            version = entry.version
            buf = self._alloc(tier, entry.nbytes, may_skip=may_skip, for_key=entry.key)
            if buf is None:
                return None
            if entry.dropped or tier in entry.copies or src.version != entry.version \
                    or entry.copies.get(src.tier) is not src:
                self._pools[tier].free(buf)  # the world moved while we waited for space
                continue
            done: Future = Future()
            copy = _Copy(tier, version=version, buffer=buf, loading=done, last_use=next(self._tick))
            entry.copies[tier] = copy
            src.io_refs += 1
            error: BaseException | None = None
            lock_state = self._release_all()
            try:
                if src.tier is Tier.NVME:
                    assert self._engine is not None and src.extent is not None
                    self._engine.read(src.extent, buf.data, label=entry.key).result()
                else:
                    self._copy_memory(src, copy, entry)
            except BaseException as e:
                error = e
            finally:
                self._retake(lock_state)
            src.io_refs -= 1
            copy.loading = None
            if error is not None:
                self._free_copy(entry, copy)
                if may_skip and not entry.dropped:  # a prefetch: the next get() reports it
                    entry.error, entry.error_in_write = error, False
                done.set_exception(error)
                self._cv.notify_all()
                raise error
            done.set_result(True)
            self._drop_if_stale(entry, src)
            self._cv.notify_all()
            return copy

    def _start_writeback(self, entry: _Entry) -> Future | None:
        """Start writing the newest bytes to the home tier; lock held. None if home is current."""
        if entry.writeback is not None:
            return entry.writeback
        home = self._home(entry)
        if home is None or entry.nbytes == 0 or home.version == entry.version:
            return None
        src = self._source(entry, entry.home)
        if src is None:
            raise TierStoreError(f"{entry.key!r}: no current copy to write back")
        version = entry.version
        if entry.home is Tier.NVME and src.tier is Tier.DEVICE:
            src = self._materialize(entry, Tier.HOST, may_skip=False)
            if entry.writeback is not None:
                return entry.writeback
            if home.version == entry.version:
                return None
        if entry.home is not Tier.NVME:
            home.io_refs += 1
            self._copy_memory(src, home, entry)
            home.io_refs -= 1
            home.version = version
            return _done_future()
        assert self._engine is not None and home.extent is not None and src.buffer is not None
        src.io_refs += 1
        home.io_refs += 1
        self.stats.add("write_backs")
        self._device.ready_for_cpu(src.buffer)  # a device-to-host copy into it may still be running
        fut = self._engine.write(home.extent, src.buffer.data, label=entry.key)
        outer: Future = Future()
        entry.writeback = outer

        def finished(f: Future, src: _Copy = src) -> None:
            with self._cv:
                src.io_refs -= 1
                home.io_refs -= 1
                entry.writeback = None
                err = f.exception()
                if err is None:
                    home.version = max(home.version, version)
                    if entry.error_in_write:
                        entry.error = None  # an earlier failed write-back has now succeeded
                    self._drop_if_stale(entry, src)
                    outer.set_result(True)
                else:
                    if not entry.dropped:
                        entry.error, entry.error_in_write = err, True
                    outer.set_exception(err)
                self._cv.notify_all()

        fut.add_done_callback(finished)
        return outer


def open_store(config: StoreConfig | None = None, **overrides: Any) -> TierStore:
    """Create a :class:`TierStore` from a config and/or keyword overrides."""
    return TierStore(config, **overrides)


def iter_tiers() -> Iterable[Tier]:
    return iter(Tier)
