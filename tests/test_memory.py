"""The tier pools: buffers carved from pre-faulted arenas, within the budget, reused across sizes."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import Tier
from tierstore._memory import PAGE_BYTES, TierPool, _give_pages_back, aligned_empty

KIB = 1024


def _pool(budget: int, arena: int) -> TierPool:
    return TierPool(Tier.HOST, budget, torch.device("cpu"), arena_bytes=arena)


def _counting(pool: TierPool) -> list[int]:
    made: list[int] = []
    new = pool._new

    def counted(size: int) -> object:
        made.append(size)
        return new(size)

    pool._new = counted  # type: ignore[method-assign]
    return made


def test_shifting_sizes_reuse_the_same_memory():
    # The mix of sizes in use changes through a training step; the memory must not be given back and faulted
    # in again for it (it was: 1.6 GB a step on ViT-large).
    pool = _pool(4096 * KIB, 1024 * KIB)
    made = _counting(pool)
    bufs = [pool.try_alloc(1024 * KIB) for _ in range(4)]
    assert len(made) == 4 and all(b is not None for b in bufs)
    for size, count in ((256 * KIB, 16), (768 * KIB, 4), (512 * KIB, 8)):
        for b in bufs:
            pool.free(b)
        bufs = [pool.try_alloc(size) for _ in range(count)]
        assert all(b is not None for b in bufs), size
    assert len(made) == 4  # no new arena after the first four
    assert pool.held_bytes == pool.peak_held_bytes == 4096 * KIB


def test_freed_neighbours_coalesce_and_pieces_do_not_fit():
    pool = _pool(1024 * KIB, 1024 * KIB)
    a, b, c, d = (pool.try_alloc(256 * KIB) for _ in range(4))
    pool.free(a)
    pool.free(c)
    # Half the budget is free, but in two pieces: a request of half the budget does not fit without dissolving.
    assert pool.budget_bytes - pool.live_bytes == 512 * KIB
    assert not pool.can_fit(512 * KIB) and pool.try_alloc(512 * KIB) is None
    pool.free(b)  # joins a and c into one range
    assert pool.can_fit(768 * KIB)
    big = pool.try_alloc(768 * KIB)
    assert big is not None and big.data.data_ptr() == a.data.data_ptr()
    pool.free(big)
    pool.free(d)
    assert pool.live_bytes == 0


def test_pieces_dissolve_when_nothing_else_can_make_room():
    # Every buffer held (nothing to evict) and the free half in two pieces: the pieces' pages go back to the
    # system and a new arena holds the request; the held buffers keep their bytes.
    pool = _pool(1024 * KIB, 1024 * KIB)
    a, b, c, d = (pool.try_alloc(256 * KIB) for _ in range(4))
    b.data.fill_(7)
    d.data.fill_(9)
    pool.free(a)
    pool.free(c)
    assert pool.try_alloc(768 * KIB, dissolve=True) is None  # beyond the budget beside the live bytes
    e = pool.try_alloc(512 * KIB, dissolve=True)
    assert e is not None
    assert pool.held_bytes == pool.live_bytes == 1024 * KIB
    assert bool((b.data == 7).all()) and bool((d.data == 9).all())
    pool.free(b)  # a dissolved arena's pages go as its buffers are freed
    assert pool.held_bytes == 768 * KIB
    pool.free(d)
    pool.free(e)
    assert pool.held_bytes == 512 * KIB and pool.live_bytes == 0
    assert pool.try_alloc(512 * KIB) is not None  # the new arena is reused


def test_pages_of_an_unaligned_range_are_never_given_back():
    data = aligned_empty(2 * PAGE_BYTES)
    with pytest.raises(ValueError, match="unaligned"):
        _give_pages_back(data, 0, PAGE_BYTES + 1)  # the kernel would zero the whole second page
    with pytest.raises(ValueError, match="unaligned"):
        _give_pages_back(data, 100, PAGE_BYTES)


def test_pinned_and_gpu_pools_reuse_exact_sizes_only():
    pool = TierPool(Tier.HOST, 1024 * KIB, torch.device("meta"), arena_bytes=1024 * KIB)
    assert not pool.carve_any
    a = pool.try_alloc(512 * KIB)
    assert a is not None and pool.held_bytes == 512 * KIB  # an arena of the request's size
    pool.free(a)
    b = pool.try_alloc(256 * KIB)  # not carved from the free 512 KiB: a new arena
    assert b is not None and pool.held_bytes == 768 * KIB
    c = pool.try_alloc(512 * KIB)  # the free one, reused
    assert c is not None and pool.held_bytes == 768 * KIB
    pool.free(c)
    d = pool.try_alloc(768 * KIB)  # the free 512 KiB arena goes back to make room
    assert d is not None and pool.held_bytes == 1024 * KIB


class PageLocks:
    """Stands in for cudaHostRegister/cudaHostUnregister (see [Note: Pinned host memory]): the ranges locked now,
    each checked to be an arena's whole memory, locked once, unlocked once."""

    def __init__(self) -> None:
        self.locked: dict[int, int] = {}  # address -> bytes
        self.peak = 0

    def pin(self, data: torch.Tensor):
        ptr, nbytes = data.data_ptr(), data.numel()
        assert ptr % PAGE_BYTES == 0 and nbytes % PAGE_BYTES == 0
        assert all(ptr + nbytes <= a or a + n <= ptr for a, n in self.locked.items())  # no range locked twice
        self.locked[ptr] = nbytes
        self.peak = max(self.peak, self.bytes)
        return lambda: self.locked.pop(ptr)

    @property
    def bytes(self) -> int:
        return sum(self.locked.values())


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 700 * KIB), st.integers(0, 50)), min_size=1, max_size=60))
def test_pinned_memory_is_the_arenas_held_byte_for_byte(ops):
    """The bytes page-locked are the pool's arenas exactly, never over the budget (no power-of-two rounding, no
    freed block left locked), and none stay locked once the pool closes."""
    locks = PageLocks()
    pool = TierPool(Tier.HOST, 2048 * KIB + 1234, torch.device("cpu"), pin=locks.pin)
    assert not pool.carve_any
    live: list = []
    for alloc, nbytes, pick in ops:
        if alloc or not live:
            buf = pool.try_alloc(nbytes)
            if buf is None:  # exact sizes only: refused when the live arenas leave no room for it
                assert pool.live_bytes + pool.capacity_for(nbytes) > pool.budget_bytes
                continue
            live.append(buf)
        else:
            pool.free(live.pop(pick % len(live)))
        assert locks.bytes == pool.pinned_bytes == pool.held_bytes <= pool.budget_bytes
        assert sorted(locks.locked.items()) == sorted((a.data.data_ptr(), a.size) for a in pool._arenas)
    assert locks.peak <= pool.budget_bytes
    for buf in live:
        pool.free(buf)
    pool.close()
    assert locks.locked == {} and pool.pinned_bytes == pool.held_bytes == 0


def test_pinned_arenas_a_tensor_still_views_are_unlocked_at_close():
    locks = PageLocks()
    pool = TierPool(Tier.HOST, 1024 * KIB, torch.device("cpu"), pin=locks.pin)
    buf = pool.try_alloc(100 * KIB)
    assert buf is not None and locks.bytes == pool.capacity_for(100 * KIB)
    view = buf.data[:10]  # kept by its user, the buffer never freed
    pool.close()
    assert locks.locked == {} and pool.pinned_bytes == 0
    view.fill_(7)  # the memory is still there, unlocked
    assert bool((view == 7).all())


def test_wholly_free_arenas_go_back_for_a_larger_request():
    pool = _pool(2048 * KIB, 1024 * KIB)
    x, y = pool.try_alloc(1024 * KIB), pool.try_alloc(1024 * KIB)
    assert pool.try_alloc(2048 * KIB) is None  # both arenas in use
    pool.free(x)
    assert not pool.can_fit(2048 * KIB)
    pool.free(y)
    assert pool.can_fit(2048 * KIB)
    z = pool.try_alloc(2048 * KIB)
    assert z is not None and pool.held_bytes == 2048 * KIB
    pool.free(z)
    pool.clear()
    assert pool.held_bytes == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 700 * KIB), st.integers(0, 50)), min_size=1, max_size=60),
       st.sampled_from([0, 1234]))
def test_buffers_never_overlap_and_stay_within_budget(ops, odd_bytes):
    # A budget that is not whole pages (a third of a model's state, say) must not give an arena an odd tail:
    # giving its pages back would zero the bytes past its end.
    pool = _pool(2048 * KIB + odd_bytes, 512 * KIB)
    live: list = []
    for alloc, nbytes, pick in ops:
        if alloc or not live:
            buf = pool.try_alloc(nbytes)
            if buf is None:
                # Refused only when no free range holds it and no arena can be made for it; then dissolving
                # arenas meets any request that fits beside the live bytes.
                assert not pool.can_fit(nbytes)
                fits = pool.live_bytes + pool.capacity_for(nbytes) <= pool.budget_bytes
                buf = pool.try_alloc(nbytes, dissolve=True)
                assert (buf is not None) == fits
                if buf is None:
                    continue
            assert buf.capacity >= nbytes and buf.capacity % PAGE_BYTES == 0
            assert buf.data.data_ptr() % PAGE_BYTES == 0 and buf.data.numel() == buf.capacity
            buf.data.fill_(len(live) % 251)
            live.append((buf, len(live) % 251))
        else:
            buf, _ = live.pop(pick % len(live))
            pool.free(buf)
        assert pool.held_bytes <= pool.budget_bytes
        assert all(a.size % PAGE_BYTES == 0 for a in pool._arenas)
        assert pool.live_bytes == sum(b.capacity for b, _ in live)
        spans = sorted((b.data.data_ptr(), b.data.data_ptr() + b.capacity) for b, _ in live)
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    for buf, value in live:  # no buffer was written through another
        assert bool((buf.data == value).all())


def _smaps_field(address: int, name: str) -> str | None:
    """The /proc/self/smaps field ``name`` of the mapping holding ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    return None


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_arenas_of_plain_memory_ask_for_huge_pages():
    pool = _pool(16 * 1024 * KIB, 8 * 1024 * KIB)
    buf = pool.try_alloc(4 * 1024 * KIB)
    assert buf is not None
    start = buf.data.data_ptr()
    assert start % (2 * 1024 * KIB) == 0  # the arena starts on a huge page
    assert _smaps_field(start, "THPeligible") == "1"
    small = aligned_empty(64 * KIB)  # less than a huge page: a plain page-aligned buffer
    assert small.data_ptr() % PAGE_BYTES == 0
