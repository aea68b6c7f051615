"""The optimizer's state pipeline: each parameter's update reads its state ahead into the host tier, applies the
AdamW arithmetic there, and writes the state behind (see [Note: Pipelined step] in optim.py)."""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch

from tierstore import Handle, Tier, TierStore, TierStoreError

from . import _adamw
from ._contract import optimizer_key
from ._grads import store_key_of
from ._layouts import StateLayout, compressed_update, seed_of

# (parameter name, its store key or None for a resident parameter, the parameter, its gradient)
Item = tuple[str, "str | None", torch.nn.Parameter, "torch.Tensor | None"]


PLAIN = StateLayout()


def state_keys(name: str, key: str | None, p: torch.nn.Parameter, layout: StateLayout = PLAIN) -> list[str]:
    """The store keys one update reads and writes: both moments, then what the update steps of an offloaded
    parameter: its fp32 master (for a bf16/fp16 weight under ``master="fp32"``), the master's low half and the
    weight (``"split"``), or the weight's own store copy (an fp32 weight, or ``"none"``)."""
    keys = [optimizer_key(name, "exp_avg"), optimizer_key(name, "exp_avg_sq")]
    if key is not None:
        master = layout.master_of(key, p)
        keys += [optimizer_key(name, "master")] if master == "fp32" else [optimizer_key(name, "master"), key] \
            if master == "split" else [key]
    return keys


def changed_keys(name: str, key: str | None, p: torch.nn.Parameter, layout: StateLayout = PLAIN) -> list[str]:
    """The store keys one update changes: those it reads and writes (``state_keys``) and, under ``master="fp32"``,
    the weight, rounded from its updated master."""
    keys = state_keys(name, key, p, layout)
    if key is not None and layout.master_of(key, p) == "fp32":
        keys.append(key)
    return keys


# Shown the first moment before an update; returns what is shown it after the update, or None.
Watch = Callable[[torch.Tensor], Callable[[torch.Tensor], None] | None]


class UnrestorableUpdateError(TierStoreError):
    """An update failed half-way and the state of before it is gone (see ``StatePipeline.update``)."""


class StatePipeline:
    """Read-ahead, update, write-behind over one store."""

    def __init__(self, store: TierStore, *, readahead: int, readahead_bytes: Callable[[], int],
                 impl: str = "single", layout: StateLayout = PLAIN, threads: int = 1) -> None:
        self.store = store
        self.impl = impl  # which of torch's AdamW implementations (see [Note: Which AdamW])
        self.layout = layout  # how the state is stored (see [Note: Compressed optimizer state])
        self.threads = threads  # threads a compressed update may use
        self.readahead = readahead
        self.readahead_bytes = readahead_bytes  # asked at each read-ahead: the room may change with the placement
        self.state_bytes: dict[str, int] = {}  # name -> bytes of its state (what read-ahead counts)
        self.pending: list[Handle] = []  # write-behind handles of the last step
        self.current: list[Handle] = []  # ... and of this one
        # The read-ahead window over one step's items (see [Note: A read-ahead window]).
        self._window_of: list[Item] | None = None
        self._start = self._end = self._window_bytes = 0
        self._counted: dict[int, int] = {}  # index in the window -> the bytes counted for it when it entered

    def read_ahead(self, items: list[Item], i: int) -> None:
        """Prefetch the state of items[i] and of those after it, within readahead and readahead_bytes.

        [Note: A read-ahead window] The window over ``items`` (one step's list, which may grow while it is
        read, as backward hands over gradients) starts at the item about to be updated and ends where the
        bytes or the count run out. Each call issues only the items that enter the window, and issues the
        next item again (an evicted read-ahead copy comes back one update before it is needed; prefetching
        what is in memory or in flight costs nothing else). Issuing the whole window before each update
        made a step's prefetch calls grow with the square of its parameter count: 12,960 calls a step for
        ViT-small's 80 tensors when the window held them all, most of the optimizer's time. An item leaves
        with the bytes it entered with: a queue replaces each item done with one without its gradient, and
        counting it again then left a stored gradient's bytes in the window for good (on the anchor model of
        docs/optimizer.md the speculated updates' window grew to 432 MB against 240 in a step, and read one
        update ahead)."""
        if items is not self._window_of:  # a new step's list
            self._window_of, self._start, self._end, self._window_bytes = items, i, i, 0
            self._counted = {}
        while self._start < i:  # the updates done leave the window
            self._window_bytes -= self._counted.pop(self._start, 0)
            self._start += 1
        self._end = max(self._end, i)
        if i + 1 < self._end:
            self._prefetch(items[i + 1])
        limit = self.readahead_bytes()
        while self._end < len(items) and self._end <= i + self.readahead:
            nbytes = self._read_bytes(items[self._end])
            if self._window_bytes + nbytes > limit and self._end > i:
                break
            self._prefetch(items[self._end])
            self._window_bytes += nbytes
            self._counted[self._end] = nbytes
            self._end += 1

    def _read_bytes(self, item: Item) -> int:
        """What reading ``item`` ahead brings into the host tier: its state, and its gradient where that is kept in
        the store (read ahead with it). Counting the state alone, the window held up to 1.7x what it was given
        with fp32 gradients beside 8-bit state (10 bytes a parameter read, 6 counted), and its reads evicted
        each other before their updates: each state tensor was read 2.3 times a step after backward."""
        name, _, _, grad = item
        nbytes = self.state_bytes.get(name, 0)
        if store_key_of(grad) is not None:
            nbytes += grad.numel() * grad.element_size()
        return nbytes

    def _prefetch(self, item: Item) -> None:
        name, key, p, grad = item
        for k in state_keys(name, key, p, self.layout):
            self.store.prefetch(k, Tier.HOST)
        if (k := store_key_of(grad)) is not None:  # a gradient kept in the store is read ahead with the state
            self.store.prefetch(k, Tier.HOST)

    def update(self, name: str, key: str | None, p: torch.nn.Parameter, grad: torch.Tensor, step: float,
               hyper: Callable[[], tuple], watch: Watch | None = None) -> None:
        """Apply one AdamW update to the parameter's state in the host tier and start writing it behind.
        ``hyper()`` gives the group's (lr, betas, eps, weight_decay), read once the state is in memory. On a
        failure nothing of the update persists, or (state kept in the host tier and changed since it was last
        written home) UnrestorableUpdateError says so. ``watch``, for an update of torch's arithmetic (a plain
        layout), is shown the first moment before the update; what it returns, if anything, is called with the
        moment after it (see [Note: A kept gradient coded against its moments] in _grad_code.py)."""
        st = self.store
        layout = self.layout
        keys = state_keys(name, key, p, layout)
        master = layout.master_of(key, p)
        kept = st.kept(Tier.HOST)  # written home when they go, not behind each update (see [Note: Kept copies])
        held: dict[str, torch.Tensor] = {}
        try:
            for k in keys:
                held[k] = st.get(k, Tier.HOST)
            for k in keys:  # the last step's write of these bytes must not see a half-done update
                (st.writing(k) if k in kept else st.write_back(k)).wait()
        except BaseException:
            for k in held:
                st.release(k, Tier.HOST)
            raise
        exp_avg, exp_avg_sq = held[keys[0]], held[keys[1]]
        param = p.data if key is None else held[keys[2]] if master == "fp32" else held[keys[-1]]
        try:
            if layout.is_plain(key, p, param.numel()):
                after = watch(exp_avg) if watch is not None else None
                _adamw.adamw_update(param, exp_avg, exp_avg_sq, grad, step, hyper(), self.impl)
                if after is not None:
                    after(exp_avg)
            else:
                compressed_update(moments=layout.moments_of(key, p, param.numel()), master=master, weight=param,
                                  low=held[keys[2]] if master == "split" else None, exp_avg=exp_avg,
                                  exp_avg_sq=exp_avg_sq, grad=grad, step=step, hyper=hyper(),
                                  seed=seed_of(name, step), threads=self.threads)
        except BaseException as e:
            # The error's frames keep their views of the state alive, which keeps that memory from being reused
            # (see [Note: A freed buffer still viewed]): nothing reads them again.
            del param, exp_avg, exp_avg_sq
            held.clear()
            traceback.clear_frames(e.__traceback__)
            # A partial update must not persist: copies written home before it are dropped, which brings back
            # the state of before this step. A kept copy changed since it was last written home cannot be.
            lost = []
            for k in keys:
                st.release(k, Tier.HOST)
                info = st.info(k)
                if info["home"] == Tier.HOST.label:
                    continue
                if info["copies"].get(Tier.HOST.label, {}).get("state") == "dirty":
                    lost.append(k)
                else:
                    st.evict(k, Tier.HOST)
            if lost:
                raise UnrestorableUpdateError(
                    f"the AdamW update of {name!r} failed half-way ({type(e).__name__}: {e}), and its "
                    f"{', '.join(lost)} stay in the host tier under the placement and were changed since they "
                    "were last written home, so the values of before the update are gone: load a checkpoint "
                    "(offload_model(..., placement=False) makes a failed update roll back, at the cost of "
                    "writing every update home)") from e
            raise
        for k in keys:
            st.mark_dirty(k, Tier.HOST)
            st.release(k, Tier.HOST)
            if k not in kept:
                self.current.append(st.write_back(k))  # write-behind
        if master == "fp32":  # the weight is rounded from its updated master
            assert key is not None
            low = st.get(key, Tier.HOST)
            master_copy = st.get(keys[2], Tier.HOST)
            (st.writing(key) if key in kept else st.write_back(key)).wait()  # its last write reads it
            low.copy_(master_copy)
            st.release(keys[2], Tier.HOST)
            st.mark_dirty(key, Tier.HOST)
            st.release(key, Tier.HOST)
            if key not in kept:
                self.current.append(st.write_back(key))

    def write_behind(self, keys: list[str]) -> None:
        """Start writing home those of ``keys`` an update left changed in the host tier (a kept copy, which
        ``update`` leaves there), waited for with this step's write-behind."""
        kept = self.store.kept(Tier.HOST)
        self.current.extend(self.store.write_back(k) for k in keys if k in kept)

    def take_previous(self) -> list[Handle]:
        """The last step's write-behind, for the next step to wait on; this step's becomes the last."""
        previous, self.pending = self.pending, []
        return previous

    def end_step(self) -> None:
        self.pending, self.current = self.current, []
        self.drop_window()

    def drop_window(self) -> None:
        """Forget the step's read-ahead window (its list holds the step's gradients)."""
        self._window_of = None
        self._counted = {}

    def wait(self) -> None:
        """Wait for every write-behind; raises the first failure (the data stays in memory)."""
        pending, self.pending, self.current = self.pending + self.current, [], []
        for h in pending:
            h.wait()
