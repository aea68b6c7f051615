"""The worker of ``OffloadedAdamW(step_in_backward=True)``: each parameter stepped as its gradient completes.

[Note: Stepping in backward] With ``step_in_backward=True`` a parameter is
stepped as soon as its gradient is complete, on a worker thread, while
backward goes on with the layers below: the optimizer's reads and writes
overlap backward compute instead of following it (ZeRO-Infinity's overlap of
the optimizer with backward). ``step()`` then only waits for those updates
(and steps parameters that stay resident). Gradients must be complete after
one backward: no accumulation over several backward passes and no clipping
by the global norm (use the default mode for those). Gradients queued for
the worker are memory that no tier budget counts, so backward waits (counted
as stall time) while more than ``max_grad_backlog_bytes`` of them are queued.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tierstore import TierStore, TierStoreError

from ._contract import BrokenValues, Mend, OffloadedParameters, PassConsumer
from ._pipeline import StatePipeline, UnrestorableUpdateError


class Backlog:
    """The bytes of gradients queued for a worker's updates and not yet read by it, with the most queued at once
    in this round and in the round before (a round: a backward's updates, ended by ``roll()`` at ``step()``)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.peak_bytes = 0
        self.last_peak_bytes = 0
        self._lock = threading.Lock()  # added to on backward's thread, taken from on the worker's

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)

    def remove(self, nbytes: int) -> None:
        with self._lock:
            self.bytes -= nbytes

    def roll(self) -> None:
        """A round ends: its peak becomes the last round's; the next starts from what is still queued."""
        with self._lock:
            self.last_peak_bytes, self.peak_bytes = self.peak_bytes, self.bytes

    def held_bytes(self, bound: int) -> int:
        """The bytes of gradients a worker whose backlog is bounded by ``bound`` may hold queued (the placement's
        room counts them: see [Note: Updates behind backward] in _placing.py): the bound, or the most the last
        round queued if more (it may pass the bound by a gradient, or while the worker waits for room)."""
        return max(bound, self.last_peak_bytes)


def wait_for_backlog(store: TierStore, over: Callable[[], bool], oldest: Callable[[], Future | None],
                     worker: int | None) -> None:
    """Backward waits (stall time) while ``over()``: gradients queued for a worker's updates exceed their bound;
    ``oldest()`` is the update to wait for (None: none left), ``worker`` the worker's thread ident."""
    if not over():
        return
    t0 = time.perf_counter()
    while over() and (fut := oldest()) is not None:
        try:
            fut.exception(timeout=0.05)
        except FutureTimeoutError:
            # The worker waits for host memory that backward holds: backward goes on (and releases
            # it), the backlog over its bound for a while, rather than both waiting for each other.
            if worker is not None and store.is_waiting_for_room(worker):
                break
    store.stats.add_wait(t0, time.perf_counter(), key="gradient backlog")


class SteppingOptimizer(Protocol):
    """What the worker uses of the optimizer it steps for (``OffloadedAdamW``): its model, store and items, its
    queue of updates with how many of them are done (``_progress``, a tuple set whole: evicting threads read it),
    the update of one parameter (``_timed_step``, with ``_pipeline`` reading ahead), the backlog bound, the
    parameters it keeps no state for (``_frozen``) and what it says of one, and the count of failed backward passes
    it last saw (``_backwards_failed``)."""

    offloaded: OffloadedParameters
    store: TierStore
    max_grad_backlog_bytes: int
    _items: list[tuple[str, str | None, torch.nn.Parameter]]
    _frozen: list[tuple[str, str | None, torch.nn.Parameter]]
    _progress: tuple[list[tuple[str, str | None, torch.nn.Parameter, Any]], int]
    _backwards_failed: int
    _pipeline: StatePipeline

    def _timed_step(self, name: str, key: str | None, p: torch.nn.Parameter, grad: Any) -> None: ...

    def _thawed_message(self, names: list[str]) -> str: ...


class BackwardSteps(PassConsumer):
    """The updates one optimizer starts during backward, on its one worker thread: a consumer of the model's
    passes that takes each gradient as it completes (see [Note: Consumers of a pass])."""

    consumes_grads = True

    def __init__(self, opt: SteppingOptimizer) -> None:
        self.opt = opt
        self.by_key = {key: (name, key, p) for name, key, p in opt._items if key is not None}
        self.early: dict[str, Future] = {}  # key -> update started in this backward
        self.futures: list[Future] = []  # of the optimizer's queue's updates, in order
        self.backlog = Backlog()  # of gradients queued and not yet consumed
        self._worker: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="tierstore-adamw")
        self._worker_ident: int | None = None

    def grad_ready(self, key: str) -> None:
        """The model's backward completed this parameter's gradient: queue its update."""
        opt = self.opt
        if key not in self.by_key:
            raise TierStoreError(opt._thawed_message([n for n, k, _ in opt._frozen if k == key]))
        name, key_, p = self.by_key[key]
        if key in self.early:
            if opt.offloaded.backwards_failed != opt._backwards_failed:
                broken = opt.offloaded.broken = BrokenValues(opt, (
                    f"a backward raised after stepping in backward had updated some parameters ({name} among them): "
                    f"their updates stand and the rest never came, so the model is part of a step ahead and no "
                    f"step can finish it; load a checkpoint to go on"), Mend.NEVER)
                raise UnrestorableUpdateError(str(broken))
            raise TierStoreError(f"{name}: a second backward before step(); step_in_backward=True steps each "
                                 "parameter after one backward, so gradient accumulation needs step_in_backward=False")
        grad = opt.offloaded.grads.get(key)
        assert self._worker is not None
        self._wait_for_backlog()
        nbytes = grad.numel() * grad.element_size() if grad is not None else 0
        self.backlog.add(nbytes)
        queue = opt._progress[0]
        queue.append((name, key_, p, grad))
        future = self._worker.submit(self._step_ready, len(queue) - 1, nbytes)
        self.futures.append(future)
        self.early[key] = future

    def _wait_for_backlog(self) -> None:
        """Backward waits while the gradients queued before this one exceed the backlog bound."""
        opt = self.opt

        def oldest() -> Future | None:
            done = opt._progress[1]
            return self.futures[done] if done < len(self.futures) else None

        wait_for_backlog(opt.store, lambda: self.backlog.bytes > opt.max_grad_backlog_bytes, oldest,
                         self._worker_ident)

    def held_host_bytes(self) -> int:
        """The bytes of gradients the worker may have queued (``Backlog.held_bytes``)."""
        return self.backlog.held_bytes(self.opt.max_grad_backlog_bytes)

    def grads_taken(self) -> str | None:
        """Why no gradient may be read now: since the last step() a backward has handed its gradients to the
        updates, which consume them as they go (a clip then would race them, or find none and clip nothing)."""
        if not self.early:
            return None
        return ("OffloadedAdamW(step_in_backward=True) applies each gradient as backward produces it, and this "
                "backward's are being applied now, so none is there to read or clip (torch's clip_grad_norm_ "
                "would clip nothing). Clip with step_in_backward=False (off.clip_grad_norm_), or read gradients "
                "after opt.step() with step_in_backward=False")

    def _step_ready(self, i: int, nbytes: int) -> None:
        opt = self.opt
        self._worker_ident = threading.get_ident()
        # Read ahead in the worker's order, within readahead_bytes: reads issued for every gradient as
        # it arrives would overflow the host tier and evict each other before use.
        ready = opt._progress[0]
        try:
            with opt.store.stats.background():
                opt._pipeline.read_ahead(ready, i)
                name, key, p, grad = ready[i]
                opt._timed_step(name, key, p, grad)
            ready[i] = (name, key, p, None)
            opt.offloaded.grads.pop(key, None)  # consumed: its memory goes now, not at zero_grad()
        finally:
            self.backlog.remove(nbytes)
            opt._progress = (ready, i + 1)

    def take(self) -> dict[str, Future]:
        """The updates this backward started (``step()`` waits for them); the next backward starts afresh."""
        early, self.early, self.futures = self.early, {}, []
        self.backlog.roll()
        return early

    def close(self) -> None:
        """Stop the worker (after the updates in flight); the optimizer detaches it from the model."""
        if self._worker is None:
            return
        self._worker.shutdown(wait=True)
        self._worker = None


__all__ = ["Backlog", "BackwardSteps", "wait_for_backlog"]
