"""Room in the memory tiers: allocation under the budgets, eviction, and waiting for other threads.

[Note: Waiting for room] When a tier is full and nothing in it can be evicted
or written home, what remains is held by get()s. Held by other threads (the
optimizer's worker, the training thread), it will be released as they go on:
an allocation waits, as long as one of them is not itself waiting for room
in that tier (then no one could go on), and for at most BUDGET_WAIT_SECONDS
(a holder may be waiting for this thread some other way). Otherwise it fails
at once with a TierBudgetError naming what each thread holds. A thread that
gives way (``TierStore.giving_way``: work that may be dropped, such as an
update made before it is known to be the step's) does not make others wait:
where another thread waits for room in the tier it needs, its allocation
raises RoomYieldedError, its caller lets go of what it holds, and the other
goes on; while it waits itself, the others count it as one that will release.

[Note: Several owners' victim orders] Each owner (an offloaded model) ranks
its own keys (Belady over its own trace); no owner can say when another's
copy is next used. So keys no owner claims go first (least recently used
first), then the owners give up their farthest copy in turn, round robin.

[Note: Changed copies keep their rank] Eviction takes copies in the victim
order and frees a changed copy by writing it home first: a clean copy ranked
after it waits for that write, although dropping it would cost nothing now
(unless no write-back can start, its staging tier being full: then the clean
copies after it go). It would cost a read later, and soon: the owners rank
last what they use next, such as the unit just read ahead. Freeing clean
copies first, ahead of their rank, made backward in Trainer's loop (gradients
written as it goes, filling the host tier with changed copies) drop the next
unit's weights read ahead for it and read them again: each weight was read
twice in each backward (170.6M Llama, 160 MiB host budget, fp32 gradients: the
step moved 38.4 B/param against 34.7 in the same order, weights read 4.9-5.2
B/param a micro-batch against 3.5).

[Note: Kept copies] An owner may ask that some copies stay in a tier for the
whole run (a placement: see tierstore/_placement.py). A prefetch never evicts
them, and never starts their write-back: it skips instead. A get() takes them
only when nothing else can go, last of all, so that a plan that was too
hopeful costs bytes, never a failure (counted as kept_evictions). Copies an
owner stops keeping are written home then, if changed, so that the allocations
that need their room later find them clean instead of waiting for each write
in turn; when eviction still freed clean copies first (before [Note: Changed
copies keep their rank]), the changed ones outstayed the copies read ahead for
a near use, which went and were read again. Measured on the 1B ViT (bf16,
8-bit moments, split masters, batch 1, 700 MiB host budget): the step after
its placement was dropped moved 14.9 GiB (its optimizer state read 1.3 times)
against 12.7 without the write-backs and 12.7 in the steps after.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from ._copies import Copy, Entry, StoreState
from ._memory import Buffer, TierPool
from ._types import RoomYieldedError, StoreClosedError, Tier, TierBudgetError

# How long an allocation waits for other threads to release what they hold (see [Note: Waiting for room]).
BUDGET_WAIT_SECONDS = 30.0

VictimOrder = Callable[[Tier, list[str]], list[str]]


class Room:
    """Finds memory for new copies in the device and host tiers: frees clean copies nobody holds, starts
    write-backs of changed ones, and waits for other threads' holds, in eviction order."""

    def __init__(self, state: StoreState, start_writeback: Callable[[Entry], Future | None]) -> None:
        self.state = state
        self.start_writeback = start_writeback
        self.victim_order: VictimOrder | None = None
        # token -> (victim order, which keys it ranks) of each owner (see [Note: Several owners' victim orders])
        self.owner_orders: dict[object, tuple[VictimOrder, Callable[[str], bool]]] = {}
        # (thread ident, tier) -> its alloc calls waiting for other threads to release room in that tier
        self.waiting: dict[tuple[int, Tier], int] = {}
        # threads whose allocations give way to the others' (see [Note: Waiting for room])
        self.giving_way: set[int] = set()
        # owner token -> (tier, keys whose copies there stay), and their union by tier (see [Note: Kept copies])
        self.kept: dict[object, tuple[Tier, frozenset[str]]] = {}
        self._kept_in: dict[Tier, frozenset[str]] = {}

    def check_fits(self, key: str, nbytes: int, home: Tier) -> None:
        """A tensor must fit the budget of its home tier, and of the host tier it is staged through."""
        config = self.state.config
        cap = TierPool.capacity_for(nbytes)
        if home is Tier.DEVICE and cap > config.device_budget_bytes:
            raise TierBudgetError(
                f"put({key!r}): {nbytes} bytes exceed device_budget_bytes={config.device_budget_bytes}; "
                "raise the budget or give it a slower home")
        if home is not Tier.DEVICE and cap > config.host_budget_bytes:
            raise TierBudgetError(
                f"put({key!r}): {nbytes} bytes exceed host_budget_bytes={config.host_budget_bytes}, "
                "through which every transfer is staged; raise host_budget_bytes or split the tensor")

    def alloc(self, tier: Tier, nbytes: int, *, may_skip: bool, for_key: str) -> Buffer | None:
        """A buffer in ``tier`` (lock held; let go while waiting). None only with ``may_skip`` (a prefetch) when
        what fills the tier is held."""
        state, pool = self.state, self.state.pools[tier]
        waited_since: float | None = None
        while True:
            if state.closed:
                raise StoreClosedError("the store was closed while waiting for space")
            buf = pool.try_alloc(nbytes)
            if buf is not None:
                return buf
            if self._make_room(tier, pool.capacity_for(nbytes), kept=False):
                continue
            # Last of all, kept copies (see [Note: Kept copies]).
            if not may_skip and self.kept_keys(tier) and self._make_room(tier, pool.capacity_for(nbytes), kept=True):
                continue
            buf = pool.try_alloc(nbytes, dissolve=True)  # nothing left to evict: the free bytes are in pieces
            if buf is not None:
                return buf
            if may_skip:
                return None
            if threading.get_ident() in self.giving_way and self._others_wait(tier):
                raise RoomYieldedError(f"{tier.label} tier: the allocation for {for_key!r} gave way to another "
                                       f"thread waiting for room there")
            if not self._others_will_release(tier):
                raise TierBudgetError(self._budget_message(tier, nbytes, for_key, waited_since))
            if waited_since is None:
                waited_since = time.perf_counter()
                state.stats.add("budget_waits")
            if time.perf_counter() - waited_since >= BUDGET_WAIT_SECONDS:
                raise TierBudgetError(self._budget_message(tier, nbytes, for_key, waited_since))
            self._wait_for_release(tier)

    def _make_room(self, tier: Tier, need: int, *, kept: bool) -> bool:
        """Free copies that could go (kept ones too, if ``kept``) or start writing one home; True when the caller
        should try again (room was made, or a write-back or transfer in flight will make some)."""
        if self._evict_clean(tier, need, kept=kept, past_changed=False):
            return True
        writing = self._start_eviction_writebacks(tier, kept=kept)
        if writing is None:  # the copy it would have written went home meanwhile: evict again
            return True
        if writing or (not kept and self._busy(tier)):
            self.state.lock.wait(0.05)
            return True
        # No changed copy can be written home (its staging tier is full): the clean ones ranked after it go.
        return self._evict_clean(tier, need, kept=kept, past_changed=True)

    def _busy(self, tier: Tier) -> bool:
        """An unheld copy in ``tier`` is being filled or read: it becomes evictable when that is done."""
        return any(not c.pins and c.busy for c in self.state.in_tier[tier])

    def _others_will_release(self, tier: Tier) -> bool:
        """Other threads hold copies in ``tier`` and one of them is not itself waiting for room there (see
        [Note: Waiting for room])."""
        me = threading.get_ident()
        others = {t for c in self.state.in_tier[tier] for t in c.holders if t != me}
        return bool(others) and not others <= self._waiting_in(tier)

    def _others_wait(self, tier: Tier) -> bool:
        """Another thread, one that does not give way, waits for room in ``tier``."""
        return bool(self._waiting_in(tier) - {threading.get_ident()})

    def _waiting_in(self, tier: Tier) -> set[int]:
        """The threads waiting for room in ``tier`` that do not give way (see [Note: Waiting for room])."""
        return {t for t, waits_in in self.waiting if waits_in is tier and t not in self.giving_way}

    def _wait_for_release(self, tier: Tier) -> None:
        waiter = (threading.get_ident(), tier)
        self.waiting[waiter] = self.waiting.get(waiter, 0) + 1
        try:
            self.state.lock.wait(0.05)
        finally:
            self.waiting[waiter] -= 1
            if not self.waiting[waiter]:
                del self.waiting[waiter]

    def is_waiting(self, thread_ident: int) -> bool:
        return any(t == thread_ident for t, _ in self.waiting)

    def _budget_message(self, tier: Tier, nbytes: int, for_key: str, waited_since: float | None) -> str:
        pool = self.state.pools[tier]
        need = pool.capacity_for(nbytes)
        copies = [(e, c) for c, e in self.state.in_tier[tier].items() if c.buffer is not None]
        homes = sum(c.buffer.capacity for e, c in copies if e.home is tier and not c.pins)
        unsaved = sum(c.buffer.capacity for e, c in copies if e.home is not tier and not c.pins and e.unsaved(c))
        names = {t.ident: t.name for t in threading.enumerate()}
        by_thread: dict[str, list[str]] = {}
        for e, c in copies:
            for t in c.holders:
                by_thread.setdefault(names.get(t, f"thread {t}"), []).append(e.key)
        held = "; ".join(f"{who} holds {len(keys)} ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''})"
                         for who, keys in by_thread.items()) or "none held"
        waited = (f" after waiting {time.perf_counter() - waited_since:.1f} s for other threads to release theirs"
                  if waited_since is not None else "")
        viewed, labels = pool.viewed_bytes()
        # See [Note: A freed buffer still viewed].
        views = (f"; {viewed} more bytes are freed copies ({', '.join(sorted(set(labels))[:4])}"
                 f"{', ...' if len(set(labels)) > 4 else ''}) kept because tensors viewing them are still alive: "
                 f"views of tensors released with guard_views=True, such as an offloaded parameter's view kept "
                 f"past its module's forward (a custom autograd.Function storing ctx.w = weight.t() rather than "
                 f"ctx.save_for_backward(weight)); drop such views" if viewed else "")
        return (f"{tier.label} tier cannot fit {need} bytes for {for_key!r}{waited}: {pool.live_bytes} of "
                f"{pool.budget_bytes} budget bytes are in use, {homes} by tensors whose home is this tier, "
                f"{unsaved} by changed copies that could not be written home (through the host tier) and the "
                f"rest by get() without release(): {held}{views}. Release tensors you are done with or raise "
                f"{tier.label}_budget_bytes")

    # ---- eviction order ----------------------------------------------------------------
    def add_owner_order(self, fn: VictimOrder, owns: Callable[[str], bool]) -> object:
        token = object()
        self.owner_orders[token] = (fn, owns)
        return token

    def set_kept(self, owner: object, tier: Tier, keys: frozenset[str]) -> None:
        before = self.kept_keys(tier)
        if keys:
            self.kept[owner] = (tier, keys)
        else:
            self.kept.pop(owner, None)
        self._kept_in = {t: frozenset().union(*(k for t2, k in self.kept.values() if t2 is t))
                         for t in {t for t, _ in self.kept.values()}}
        self._write_home_no_longer_kept(tier, before - self.kept_keys(tier))

    def _write_home_no_longer_kept(self, tier: Tier, keys: frozenset[str]) -> None:
        """Start writing home the changed copies in ``tier`` that were kept and no longer are (see [Note: Kept
        copies]): eviction frees clean copies first, so left changed they would stay while copies read ahead
        for a near use went in their place, to be read again."""
        for key in keys:
            entry = self.state.entries.get(key)
            copy = None if entry is None else entry.copies.get(tier)
            if copy is None or copy.pins or copy.busy or not self._to_write_home(entry, copy):
                continue
            try:
                self.start_writeback(entry)
            except TierBudgetError:  # its staging tier is full: eviction writes it home later
                continue

    @staticmethod
    def _to_write_home(entry: Entry, copy: Copy) -> bool:
        """Whether ``copy`` must be written home before it can go, and no write-back of it is running or failed."""
        return entry.unsaved(copy) and entry.writeback is None and entry.error is None

    def kept_keys(self, tier: Tier) -> frozenset[str]:
        return self._kept_in.get(tier, frozenset())

    def candidates(self, tier: Tier, kept: bool = True) -> list[tuple[Entry, Copy]]:
        """Copies in ``tier`` that could go (not home, unheld, not in a transfer), the first to go first; kept
        copies last, or (``kept=False``) none (see [Note: Kept copies])."""
        out = [(e, c) for c, e in self.state.in_tier[tier].items()
               if tier is not e.home and not c.pins and not c.busy]
        keep = self.kept_keys(tier)
        if not keep:
            return self._ordered(tier, out)
        # Kept copies are ranked apart, and only when asked for: ranking them with the rest on every
        # allocation would cost the training thread CPU time for copies that are not to go.
        last = self._ordered(tier, [ec for ec in out if ec[0].key in keep]) if kept else []
        return self._ordered(tier, [ec for ec in out if ec[0].key not in keep]) + last

    def _ordered(self, tier: Tier, out: list[tuple[Entry, Copy]]) -> list[tuple[Entry, Copy]]:
        out.sort(key=lambda ec: ec[1].last_use)
        if self.victim_order is not None and out:
            by_key = {e.key: (e, c) for e, c in out}
            order = self.victim_order(tier, list(by_key))
            out = [by_key[k] for k in order if k in by_key] + [ec for k, ec in by_key.items() if k not in order]
        elif self.owner_orders and out:
            out = self._by_owner_orders(tier, out)
        return out

    def _by_owner_orders(self, tier: Tier, out: list[tuple[Entry, Copy]]) -> list[tuple[Entry, Copy]]:
        """See [Note: Several owners' victim orders]."""
        by_key = {e.key: (e, c) for e, c in out}
        claimed: set[str] = set()
        ranked: list[list[str]] = []
        for fn, owns in list(self.owner_orders.values()):
            mine = [k for k in by_key if k not in claimed and owns(k)]
            claimed.update(mine)
            ranked.append([k for k in fn(tier, mine) if k in by_key] if mine else [])
        order = [k for k in by_key if k not in claimed]
        for turn in itertools.zip_longest(*ranked):
            order.extend(k for k in turn if k is not None)
        return [by_key[k] for k in order]

    def _evict_clean(self, tier: Tier, need: int, *, kept: bool, past_changed: bool) -> bool:
        """Free clean, unheld copies in ``tier`` (kept ones too, if ``kept``) in eviction order until ``need``
        bytes could fit: up to the first changed copy, or (``past_changed``) past changed copies too (see [Note:
        Changed copies keep their rank]). True if any freed."""
        freed = 0
        pool = self.state.pools[tier]
        keep = self.kept_keys(tier)
        for entry, copy in self.candidates(tier, kept):
            if entry.unsaved(copy):
                if not past_changed and entry.error is None:
                    break
                continue
            freed += copy.buffer.capacity if copy.buffer else 0
            self.state.free_copy(entry, copy)
            self.state.stats.add("evictions")
            if entry.key in keep:
                self.state.stats.add("kept_evictions")
            if pool.can_fit(need):
                break
        return freed > 0

    def _start_eviction_writebacks(self, tier: Tier, *, kept: bool) -> bool | None:
        """Start writing home the first changed copy that eviction would take. True if a write-back is running
        anywhere (it frees a copy when done); None if the copy turned out to be home already (staging it
        through the host tier lets the lock go, and its write-back may have finished meanwhile)."""
        for entry, copy in self.candidates(tier, kept):
            if self._to_write_home(entry, copy):
                try:
                    return True if self.start_writeback(entry) is not None else None
                except TierBudgetError:  # its staging tier is full: another candidate may not need it
                    continue
        return any(e.writeback is not None for e in self.state.entries.values())
