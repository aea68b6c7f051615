"""The copy state machine: a key's copies in each tier, their versions, and the rules read off them.

[Note: Versions, not flags] Every key has a version, bumped by mark_dirty().
Each copy remembers the version of the bytes it holds. A copy whose version
is the key's is *current*; the home copy being current means every current
copy is clean; a current copy that is the only holder of the newest version
is dirty and is never freed before a write-back of it has completed. Copies
of an older version are stale and are dropped as soon as nobody holds them.
This keeps the rules right when a write-back races a new mark_dirty().
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ._config import StoreConfig
from ._device import Device
from ._memory import Buffer, TierPool
from ._monitor import Monitor
from ._nvme import Extent, NvmeEngine
from ._stats import StoreStats
from ._types import StoreClosedError, Tier, TierKeyError, TierTypeError, TierValueError

UNSUPPORTED_DTYPES = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


@dataclass(eq=False)
class Copy:
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

    @property
    def busy(self) -> bool:
        """A transfer is reading it or filling it."""
        return self.loading is not None or bool(self.io_refs)


class CopyMap(dict):
    """An entry's copies by tier, keeping the store's index of the copies in each tier (``StoreState.in_tier``)
    current: eviction looks at the copies of one tier, not at every entry (see ``Room.candidates``)."""

    def __init__(self, entry: Entry, index: dict[Tier, dict[Copy, Entry]]) -> None:
        super().__init__(entry.copies)
        self._entry = entry
        self._index = index
        for tier, copy in self.items():
            index[tier][copy] = entry

    def __setitem__(self, tier: Tier, copy: Copy) -> None:
        old = self.get(tier)
        if old is not None:
            self._index[tier].pop(old, None)
        super().__setitem__(tier, copy)
        self._index[tier][copy] = self._entry

    def __delitem__(self, tier: Tier) -> None:
        copy = self[tier]
        super().__delitem__(tier)
        self._index[tier].pop(copy, None)

    def _refused(self, *args: Any, **kwargs: Any) -> None:
        raise TierTypeError("an entry's copies change by [tier] = copy and del [tier] only (they keep the index)")

    pop = popitem = clear = update = setdefault = __ior__ = _refused  # type: ignore[assignment]


@dataclass(eq=False)
class Entry:
    key: str
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    home: Tier
    stride: tuple[int, ...] | None = None  # a dense layout other than contiguous (see dense_strides)
    version: int = 0
    copies: dict[Tier, Copy] = field(default_factory=dict)
    error: BaseException | None = None  # a background failure, raised by the next get()
    error_in_write: bool = False  # the failure was a write-back (a later good one clears it)
    writeback: Future | None = None
    prefetches: dict[Tier, Future] = field(default_factory=dict)
    dropped: bool = False
    last_get: int = 0  # the store's tick at its latest get() (see [Note: A prefetch overtaken by its get])
    getting: int = 0  # get() calls of this entry fetching it now
    prefetch_asked: dict[Tier, int] = field(default_factory=dict)  # the tick of the latest prefetch() into a tier
    kept: Any = None  # its kept version (a ``_versions.KeptVersion``: see [Note: Kept versions])

    def reported(self, err: BaseException) -> None:
        """``err`` was raised to a caller: the next get() does not raise it again (call under the state lock)."""
        if self.error is err:
            self.error = None

    def home_copy(self) -> Copy | None:
        return self.copies.get(self.home)

    def home_is_current(self) -> bool:
        home = self.home_copy()
        return home is not None and home.version == self.version

    def unsaved(self, copy: Copy) -> bool:
        """True if dropping ``copy`` now would lose bytes or cost a staged write: it is current, the home copy is
        not, and no other current copy can be written home directly. A device copy is written to an NVMe home
        through a host copy, so while a current host copy is there, the host copy is the one written back: drop it
        unsaved and the device copy would have to be staged back through a host tier that may then be full."""
        if copy.version != self.version or self.home_is_current():
            return False
        return not any(c is not copy and c.version == self.version and c.loading is None
                       and not (self.home is Tier.NVME and c.tier is Tier.DEVICE)
                       for c in self.copies.values())

    def stale_and_free(self, copy: Copy) -> bool:
        """An older version's copy outside home that nobody holds or transfers: drop it."""
        return (copy.version < self.version and copy.tier is not self.home and not copy.pins
                and not copy.busy)

    def source(self, target: Tier) -> Copy | None:
        """The current copy to fill ``target`` from: the nearest tier (host before NVMe for the device, device
        before NVMe for the host)."""
        current = [c for c in self.copies.values()
                   if c.version == self.version and c.loading is None and c.tier is not target]
        if not current:
            return None
        return min(current, key=lambda c: (abs(c.tier - target), c.tier))

    def state(self, copy: Copy) -> str:
        """loading, stale, dirty or clean (what ``TierStore.info`` shows)."""
        if copy.loading is not None:
            return "loading"
        if copy.version < self.version:
            return "stale"
        return "dirty" if copy.tier is not self.home and not self.home_is_current() else "clean"


def dense_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """``t``'s strides when it covers its memory without gaps or overlaps in an order other than a contiguous
    tensor's of its shape (channels_last, a transpose, a size-1 dim's odd stride), else None. A copy of it keeps
    that layout: a channels_last convolution weight given back contiguous would run another kernel, which rounds
    otherwise."""
    if t.numel() <= 1 or t.stride() == contiguous_strides(t.shape):
        return None
    expected = 1
    for d in sorted((d for d in range(t.dim()) if t.size(d) != 1), key=t.stride):
        if t.stride(d) != expected:
            return None
        expected *= t.size(d)
    return tuple(t.stride())


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    out, n = [], 1
    for size in reversed(shape):
        out.append(n)
        n *= size
    return tuple(reversed(out))


def check_put(key: object, tensor: object, home: Tier, has_nvme: bool) -> None:
    """What ``put()`` refuses, before anything changes."""
    if not isinstance(key, str) or not key:
        raise TierTypeError(f"key must be a non-empty str, not {key!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TierTypeError(f"put({key!r}) needs a torch.Tensor, not {type(tensor).__name__}")
    if tensor.dtype in UNSUPPORTED_DTYPES or tensor.is_quantized or tensor.is_sparse:
        raise TierTypeError(f"put({key!r}): dtype {tensor.dtype} / layout {tensor.layout} is not supported; "
                            "store a dense tensor (dequantize or .to_dense() it first)")
    if not tensor.is_contiguous() and dense_strides(tensor) is None:
        raise TierValueError(f"put({key!r}): the tensor has gaps or overlaps in its memory (a slice, an expand); pass "
                             f"tensor.contiguous()")
    if home is Tier.NVME and not has_nvme:
        raise TierValueError(f"put({key!r}, home='nvme') needs nvme_path set in the config")


class StoreState:
    """What the store's parts share, guarded by ``lock``: the entries, the memory pools, the drive, the device."""

    def __init__(self, config: StoreConfig, stats: StoreStats, device: Device, pools: dict[Tier, TierPool],
                 engine: NvmeEngine | None) -> None:
        self.config = config
        self.stats = stats
        self.device = device
        self.pools = pools
        self.engine = engine
        self.lock = Monitor()
        self.entries: dict[str, Entry] = {}
        self.in_tier: dict[Tier, dict[Copy, Entry]] = {t: {} for t in Tier}  # every copy, by its tier
        self.tick = itertools.count(1)
        self.closed = False

    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes held and peak per tier."""
        out = {t.label: {"held_bytes": p.held_bytes, "live_bytes": p.live_bytes,
                         "peak_bytes": p.peak_held_bytes, "budget_bytes": p.budget_bytes,
                         "frees_kept_for_views": p.viewed_frees,  # see [Note: A freed buffer still viewed]
                         "pinned_bytes": p.pinned_bytes}  # see [Note: Pinned host memory]
               for t, p in self.pools.items()}
        e = self.engine
        out["nvme"] = {"held_bytes": e.used_bytes if e else 0, "live_bytes": e.used_bytes if e else 0,
                       "peak_bytes": e.peak_used_bytes if e else 0,
                       "budget_bytes": self.config.nvme_budget_bytes or -1}
        return out

    def register(self, entry: Entry) -> None:
        """``entry`` is the store's now (lock held): its copies are indexed by tier from here on."""
        entry.copies = CopyMap(entry, self.in_tier)
        self.entries[entry.key] = entry

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosedError("the store is closed; create a new TierStore")

    def lookup(self, key: str) -> Entry:
        try:
            return self.entries[key]
        except KeyError:
            self.check_open()  # after close() every key is gone: say so, not "put() it first"
            raise TierKeyError(f"unknown key {key!r}: put() it into the store first") from None

    def view(self, entry: Entry, copy: Copy) -> torch.Tensor:
        """The copy as a tensor, ready for whoever reads it next (see [Note: Ordering device work])."""
        assert copy.buffer is not None
        if copy.tier is Tier.DEVICE:
            self.device.ready_for_compute(copy.buffer)
        else:
            self.device.ready_for_cpu(copy.buffer)
        t = copy.buffer.view(entry.shape, entry.dtype, entry.nbytes)
        return t if entry.stride is None else t.as_strided(entry.shape, entry.stride)

    def free_copy(self, entry: Entry, copy: Copy) -> None:
        if entry.copies.get(copy.tier) is copy:
            del entry.copies[copy.tier]
        if copy.buffer is not None:
            self.pools[copy.tier].free(copy.buffer, entry.key)
            copy.buffer = None
        if copy.extent is not None and self.engine is not None:
            self.engine.free(copy.extent)
            copy.extent = None
        self.lock.notify_all()

    def drop_if_stale(self, entry: Entry, copy: Copy) -> None:
        if entry.stale_and_free(copy):
            self.free_copy(entry, copy)

    def drop_entry(self, entry: Entry) -> None:
        if entry.dropped:
            return
        # In-flight transfers keep their buffers; wait for them so nothing is reused under them.
        while any(c.busy for c in entry.copies.values()):
            self.lock.wait(0.05)
        entry.dropped = True
        self.entries.pop(entry.key, None)
        for copy in list(entry.copies.values()):
            self.free_copy(entry, copy)
        if entry.kept is not None:
            entry.kept.free(self.engine)
            entry.kept = None

    def wait_for(self, fut: Future) -> None:
        """Wait for ``fut`` with the lock let go (it is held again on return)."""
        while not fut.done():
            self.lock.wait(0.05)
