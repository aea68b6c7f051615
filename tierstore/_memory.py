"""Byte-budgeted pools of page-aligned, pre-faulted memory, one per memory tier.

[Note: Allocate once, reuse] First touch of fresh memory costs about as much
as reading the drive (page faults and zeroing: 0.6-1.2 GB/s here), and reads
into a few recycled small buffers run far slower than reads into memory
already faulted in. So a pool takes its budget from the system in a few
large arenas, faults them in once, and carves every buffer out of them:
best fit among the free ranges, neighbours coalesced when freed. Arenas go
back to the system only when wholly free and a request could not otherwise
fit. Before, a pool kept freed buffers by exact size, and as the mix of
sizes in use shifted through a step (forward weights, then Adam moments)
it gave whole buffers back to make one of another size: ViT-large under a
host budget of a third of its state faulted in 1.6 GB of fresh memory on
every step, 1-2 s of CPU on two cores.

[Note: Huge pages] Each O_DIRECT read or write pins the pages of its
buffer in the kernel, one 4 KiB page at a time: with plain pages that was
most of the I/O threads' CPU (0.040 s of system time per GB read here, against
0.007 with huge pages; user time unchanged), on two cores where compute
wants every cycle. So arenas of plain host memory start on a 2 MiB boundary
and are madvised MADV_HUGEPAGE before they are faulted in (where transparent
huge pages are "madvise", the default of most distributions, nothing else
gets them; where "never", the call is refused and nothing changes). Giving
pages back (below) splits a huge page as needed.

A request fits when one free range holds it, so budget minus live bytes can
exceed a request that still does not fit (the free bytes lie in pieces);
:meth:`TierPool.can_fit` tells the store, which then evicts more. Where
nothing more can be evicted (every copy held by get() under a tight budget),
a pool of plain host memory dissolves its most fragmented arenas: their free
pages go back to the system (madvise), their live buffers stay where they
are and give their pages back when freed, and the room made holds a new
arena. So any request that fits the budget beside the live bytes is met, as
with one buffer per request. Pinned and GPU memory cannot give pages back
piecemeal, so their pools carve a free range only for a request of its exact
size: no pieces, and the old reuse by size.

[Note: Pinned host memory] With CUDA the host tier is page-locked, so that
copies to and from the device run asynchronously at the link's rate. Its
arenas are not ``torch.empty(pin_memory=True)``: torch's caching host
allocator (aten/src/ATen/core/CachingHostAllocator.h, ``allocate``) rounds
every request up to a power of two (``c10::llvm::PowerOf2Ceil``; a 64 MiB
arena plus its alignment page would pin 128 MiB), never splits a block, and
keeps freed blocks page-locked in its free lists until
``torch.cuda.host_memory_empty_cache()``: the host budget would understate
pinned memory by up to 2x, and an arena the pool gave back would stay pinned.
So an arena is plain page-aligned memory (:func:`aligned_empty`, huge pages
included) that the device page-locks in place (``cudaHostRegister``, what the
same allocator does under ``pinned_use_cuda_host_register``), exactly its
size; the pool unlocks it (``cudaHostUnregister``) when it gives the arena
back and when the store closes. ``TierPool.pinned_bytes`` is what is locked
now: the arenas held, byte for byte. Pinned pools carve no pieces (above),
so a pinned arena is one buffer, and its size is the buffer's capacity.
"""

from __future__ import annotations

import bisect
import ctypes
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ._types import Tier, TierOSError, TierValueError

PAGE_BYTES = 4096
# Size of the arenas a pool takes its budget in (a larger request gets an arena of its own size).
ARENA_BYTES = 64 * 1024**2


_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
HUGE_PAGE_BYTES = 2 * 1024**2
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _give_pages_back(data: torch.Tensor, offset: int, length: int) -> None:
    """Return the pages of a page-aligned range of plain host memory to the system; they read as zero after.

    The kernel rounds the length up to whole pages: a range that did not end on a page boundary would
    zero bytes past it (a neighbour's, or the allocator's own records), so it is refused.
    """
    assert _libc is not None
    if (data.data_ptr() + offset) % PAGE_BYTES or length % PAGE_BYTES:
        raise TierValueError(f"giving back pages of an unaligned range (offset {offset}, length {length})")
    if _libc.madvise(ctypes.c_void_p(data.data_ptr() + offset), ctypes.c_size_t(length), _MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise TierOSError(err, f"madvise(MADV_DONTNEED) failed: {err}")


def align_up(n: int, alignment: int = PAGE_BYTES) -> int:
    return (n + alignment - 1) // alignment * alignment


def insert_free_range(free: list[tuple[int, int]], offset: int, length: int) -> None:
    """Insert (offset, length) into a sorted list of free ranges, coalescing with its neighbours."""
    i = bisect.bisect_left(free, (offset, 0))
    free.insert(i, (offset, length))
    if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
        free[i] = (free[i][0], free[i][1] + free[i + 1][1])
        del free[i + 1]
    if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
        free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
        del free[i]


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose data starts on a page boundary, pre-faulted; one of a huge page or
    more starts on a huge page and asks for huge pages (see [Note: Huge pages])."""
    huge = _libc is not None and nbytes >= HUGE_PAGE_BYTES
    align = HUGE_PAGE_BYTES if huge else PAGE_BYTES
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % align
    buf = raw[offset:offset + nbytes]
    if huge:
        assert _libc is not None
        # Refused where huge pages are off ("never"): then it is plain pages, as without the call.
        _libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(nbytes // align * align), _MADV_HUGEPAGE)
    buf.zero_()
    return buf


@dataclass(eq=False)
class _Arena:
    data: torch.Tensor
    size: int
    free: list[tuple[int, int]]  # (offset, length), sorted by offset, coalesced
    live: int = 0  # bytes handed out
    dissolved: bool = False  # its free pages went back to the system; nothing more is carved from it
    unpin: Callable[[], None] | None = None  # unlocks its pages (see [Note: Pinned host memory])

    def take(self, offset: int, length: int, index: int) -> None:
        """Carve [offset, offset+length) from the start of free range ``index``."""
        off, n = self.free[index]
        assert off == offset and n >= length
        if n == length:
            del self.free[index]
        else:
            self.free[index] = (off + length, n - length)
        self.live += length

    def give(self, offset: int, length: int) -> None:
        insert_free_range(self.free, offset, length)
        self.live -= length


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(t: torch.Tensor) -> int:
    """The tensors (and storage objects) that share ``t``'s storage, one of them the temporary asked here."""
    return 0 if _storage_use_count is None else _storage_use_count(t.untyped_storage()._cdata)


@dataclass(eq=False)
class Buffer:
    """A block of tier memory; ``data`` is a flat uint8 tensor of ``capacity`` bytes.

    [Note: A freed buffer still viewed] The tensors a buffer hands out are views of
    its storage. One that outlives the buffer (a custom ``autograd.Function``
    keeping ``ctx.wt = weight.t()`` of an offloaded parameter past its module's
    forward, instead of ``save_for_backward``) would read whatever the memory holds
    next. So a buffer released with ``guard_views`` (the offloaded model's holds
    are), freed while its storage is shared by more tensors than when it was made,
    is fenced like one with device work pending, and reused only once they are
    gone: the view keeps its values, as it would have in the resident model. Each
    time the model fetches that parameter again (``get(..., sync_views=True)``) the
    kept buffer gets its current value, so a view cached on a module across steps
    reads the optimizer's updates, as a view of the resident parameter does. If the
    tier then runs out of room, the budget error names what is so kept. Other
    get()s are not guarded: a released tensor left in a variable that nothing reads
    again is common, and must not hold memory.
    """

    data: torch.Tensor
    capacity: int
    tier: Tier
    # Work that still reads or writes this buffer: the last event of each stream that touched it (see
    # [Note: Ordering device work]); it must finish before reuse.
    events: dict = field(default_factory=dict)
    arena: _Arena | None = None
    offset: int = 0
    # Tensors sharing its storage when it was made (see [Note: A freed buffer still viewed]).
    refs: int = field(init=False, default=0)
    guarded: bool = False  # a view of it may be read after release: kept while one is alive
    label: str = ""  # what it held, named when it is kept for a view

    def __post_init__(self) -> None:
        self.refs = _use_count(self.data)

    def kept_for_views(self) -> bool:
        """Whether it is guarded and a tensor it handed out is still alive."""
        return self.guarded and _use_count(self.data) > self.refs

    def view(self, shape: torch.Size, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=self.data.device)
        return self.data[:nbytes].view(dtype).view(shape)

    def add_event(self, stream: object, event: object) -> None:
        """``event`` marks ``stream``'s latest work on this buffer (it covers the stream's earlier events)."""
        self.events[stream] = event

    def pending_events(self) -> tuple:
        return tuple(self.events.values())

    def work_done(self) -> bool:
        return all(event.query() for event in self.pending_events())

    def wait_pending(self) -> None:
        for stream, event in tuple(self.events.items()):
            event.synchronize()
            if self.events.get(stream) is event:  # not replaced meanwhile by later work
                del self.events[stream]


class TierPool:
    """Hands out buffers of one tier without ever holding more than ``budget_bytes``.

    ``pin``: page-locks a new host arena in place and returns what unlocks it (the device's
    :meth:`~tierstore._device.Device.pin`; see [Note: Pinned host memory]).
    """

    def __init__(self, tier: Tier, budget_bytes: int, device: torch.device, *,
                 pin: Callable[[torch.Tensor], Callable[[], None]] | None = None,
                 arena_bytes: int = ARENA_BYTES) -> None:
        self.tier = tier
        self.budget_bytes = budget_bytes
        self.device = device
        self.pin = pin
        self.arena_bytes = align_up(arena_bytes)
        # Plain host memory can carve requests from larger free ranges (see [Note: Allocate once, reuse]).
        self.carve_any = device.type == "cpu" and pin is None and _libc is not None
        self._lock = threading.Lock()
        self._arenas: list[_Arena] = []
        self._fenced: list[Buffer] = []  # freed with device work pending on them: not reusable yet
        self.held_bytes = 0  # arenas taken from the system
        self.live_bytes = 0  # handed out
        self.peak_held_bytes = 0
        self.pinned_bytes = 0  # page-locked now (see [Note: Pinned host memory])
        self.viewed_frees = 0  # freed while a tensor viewed them (see [Note: A freed buffer still viewed])

    @staticmethod
    def capacity_for(nbytes: int) -> int:
        return align_up(max(nbytes, 1))

    def try_alloc(self, nbytes: int, *, dissolve: bool = False) -> Buffer | None:
        """A buffer of at least ``nbytes``, or None if the budget cannot hold one now.

        ``dissolve``: where the free bytes lie in pieces too small, give their pages back to make room
        (plain host memory; the last resort, when nothing can be evicted).
        """
        cap = self.capacity_for(nbytes)
        with self._lock:
            fit = self._fit_locked(cap)
            if fit is not None:
                return self._carve_locked(fit, cap)
            size = self._room_locked(cap)
            if size is None and dissolve and self.carve_any and self.live_bytes + cap <= self.budget_bytes:
                self._dissolve_locked(self.held_bytes + cap - self.budget_bytes)
                size = self._room_locked(cap)
            if size is None:
                return None
            self.held_bytes += size  # reserved while the arena is faulted in
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        try:
            arena = self._new(size)
        except BaseException:
            with self._lock:
                self.held_bytes -= size
            raise
        with self._lock:
            self._arenas.append(arena)
            arena.take(0, cap, 0)
            self.live_bytes += cap
        return Buffer(self._slice(arena, 0, cap), cap, self.tier, arena=arena, offset=0)

    def _slice(self, arena: _Arena, offset: int, cap: int) -> torch.Tensor:
        if not self.carve_any:  # one buffer per arena
            return arena.data[offset:offset + cap]
        # A storage of its own over the arena's bytes: code that tells tensors apart by their storage (saved
        # tensors of an offloaded module, for one) sees one storage per buffer, as with one allocation each.
        return torch.frombuffer(arena.data.numpy()[offset:offset + cap], dtype=torch.uint8)

    def can_fit(self, nbytes: int) -> bool:
        """Whether :meth:`try_alloc` of ``nbytes`` would succeed now without dissolving arenas."""
        cap = self.capacity_for(nbytes)
        with self._lock:
            return self._fit_locked(cap) is not None or self._room_possible_locked(cap)

    def _fit_locked(self, cap: int) -> tuple[_Arena, int] | None:
        """The free range :meth:`_best_fit_locked` picks, after taking back fenced buffers whose work is done
        (and waiting for the rest when nothing fits without them)."""
        self._unfence_locked(wait=False)
        fit = self._best_fit_locked(cap)
        if fit is None and self._fenced:
            self._unfence_locked(wait=True)
            fit = self._best_fit_locked(cap)
        return fit

    def _best_fit_locked(self, cap: int) -> tuple[_Arena, int] | None:
        best: tuple[int, _Arena, int] | None = None
        for arena in self._arenas:
            for i, (_, n) in enumerate(arena.free):
                if n == cap or (n > cap and self.carve_any and (best is None or n < best[0])):
                    best = (n, arena, i)
                    if n == cap:
                        return arena, i
        return None if best is None else (best[1], best[2])

    def _carve_locked(self, fit: tuple[_Arena, int], cap: int) -> Buffer:
        arena, i = fit
        offset = arena.free[i][0]
        arena.take(offset, cap, i)
        self.live_bytes += cap
        return Buffer(self._slice(arena, offset, cap), cap, self.tier, arena=arena, offset=offset)

    def _room_locked(self, cap: int) -> int | None:
        """The size of a new arena for ``cap`` bytes, giving wholly free arenas back if needed; None if none fits."""
        if self.held_bytes + cap > self.budget_bytes:
            if not self._room_possible_locked(cap):
                return None
            self._give_back_idle_locked(cap)
        if not self.carve_any:
            return cap
        # Whole pages only, so that every free range can give its pages back (cap is whole pages itself).
        room = (self.budget_bytes - self.held_bytes) // PAGE_BYTES * PAGE_BYTES
        return min(max(cap, self.arena_bytes), room)

    def _give_back_idle_locked(self, cap: int | None = None) -> None:
        """Give wholly free arenas back to the system, smallest first: until an arena of ``cap`` bytes fits the
        budget, or all of them."""
        for arena in sorted((a for a in self._arenas if a.live == 0), key=lambda a: a.size):
            if cap is not None and self.held_bytes + cap <= self.budget_bytes:
                return
            self._drop_locked(arena)

    def _drop_locked(self, arena: _Arena) -> None:
        """Forget a wholly free arena: its memory goes back to the system once no tensor views it, unlocked now."""
        self._arenas.remove(arena)
        self.held_bytes -= arena.size
        self._unpin_locked(arena)

    def _unpin_locked(self, arena: _Arena) -> None:
        if arena.unpin is not None:
            arena.unpin()
            arena.unpin = None
            self.pinned_bytes -= arena.size

    def _room_possible_locked(self, cap: int) -> bool:
        """Whether an arena for ``cap`` bytes fits the budget once the wholly free arenas are given back."""
        return self.held_bytes - sum(a.size for a in self._arenas if a.live == 0) + cap <= self.budget_bytes

    def _dissolve_locked(self, want: int) -> None:
        """Give back the free pages of the most fragmented arenas until ``want`` bytes have gone."""
        for arena in sorted(self._arenas, key=lambda a: a.size - a.live, reverse=True):
            if want <= 0:
                return
            for offset, length in arena.free:
                _give_pages_back(arena.data, offset, length)
            gone = arena.size - arena.live
            self.held_bytes -= gone
            want -= gone
            arena.free, arena.size, arena.dissolved = [], arena.live, True
            self._arenas.remove(arena)

    def _unfence_locked(self, *, wait: bool) -> None:
        keep = []
        for buf in self._fenced:
            if buf.kept_for_views():
                keep.append(buf)
            elif wait or buf.work_done():
                buf.wait_pending()
                self._give_locked(buf)
            else:
                keep.append(buf)
        self._fenced = keep

    def _give_locked(self, buf: Buffer) -> None:
        arena = buf.arena
        assert arena is not None
        buf.arena = None
        if arena.dissolved:  # its pages go now; the arena's memory is gone with its last buffer
            _give_pages_back(arena.data, buf.offset, buf.capacity)
            arena.live -= buf.capacity
            arena.size -= buf.capacity
            self.held_bytes -= buf.capacity
        else:
            arena.give(buf.offset, buf.capacity)

    def _new(self, size: int) -> _Arena:
        if self.device.type != "cpu":
            return _Arena(torch.empty(size, dtype=torch.uint8, device=self.device), size, [(0, size)])
        arena = _Arena(aligned_empty(size), size, [(0, size)])
        if self.pin is not None:
            arena.unpin = self.pin(arena.data)
            with self._lock:
                self.pinned_bytes += size
        return arena

    def free(self, buf: Buffer, label: str = "") -> None:
        with self._lock:
            self.live_bytes -= buf.capacity
            if buf.kept_for_views():  # see [Note: A freed buffer still viewed]
                buf.label = label
                self.viewed_frees += 1
                self._fenced.append(buf)
            elif buf.events:
                self._fenced.append(buf)
            else:
                self._give_locked(buf)

    def copy_into_viewed(self, label: str, src: torch.Tensor, nbytes: int) -> None:
        """Copy the first ``nbytes`` of ``src`` into the freed buffers that held ``label`` and are kept for its
        views (under the lock: none is reused meanwhile). On every hold of an offloaded model: nothing to do, and
        no lock taken, until a buffer was first kept for a view."""
        if not self.viewed_frees:
            return
        with self._lock:
            for b in self._fenced:
                if b.label == label and b.capacity >= nbytes and b.kept_for_views():
                    b.data[:nbytes].copy_(src[:nbytes])

    def viewed_bytes(self) -> tuple[int, list[str]]:
        """Bytes of freed buffers kept for tensors still viewing them, and what they held."""
        with self._lock:
            kept = [b for b in self._fenced if b.kept_for_views()]
            return sum(b.capacity for b in kept), [b.label for b in kept]

    def clear(self) -> None:
        """Give every wholly free arena back to the system."""
        with self._lock:
            self._unfence_locked(wait=True)
            self._give_back_idle_locked()

    def close(self) -> None:
        """The store is closing: every wholly free arena goes back, and no page stays locked (an arena a tensor
        still views keeps its memory until that tensor goes, unlocked)."""
        self.clear()
        with self._lock:
            for arena in self._arenas:
                self._unpin_locked(arena)
