"""The worker of ``OffloadedAdamW(stream_update=True)``: a step's updates run while the next forward computes.

[Note: Updates streamed into the next forward] Clipping by the global norm needs every gradient before any update,
so after backward the update is on the critical path: its state's reads and writes move while nothing computes. Once
the clip coefficient is recorded, though, every update's inputs are known. With ``stream_update=True``, ``step()``
queues the updates of the offloaded parameters in the order the last forward used them (their units' first places
in the trace), with the learning rate and hyper-parameters each has at that ``step()``, and returns; one worker runs
them with the pipeline's read-ahead and write-behind while the training loop goes on (a scheduler step,
``zero_grad()``, the next batch, its forward). Each queued update fences the keys it changes in the store (see
[Note: Fenced keys]): the forward's fetch of a unit waits only for its own parameters' updates, and whatever else
reads them first (a parameter read, ``state_dict()``, a checkpoint) waits for exactly those. The arithmetic is the
pipeline's on the same inputs, so the results are those of the step that runs after backward, bit for bit.
Parameters kept resident are stepped inside ``step()``: the forward reads them where no fence is.

The gradients an update reads are claimed (``GradientStore.claim``): ``zero_grad()`` lets them go from the model
while their bytes stay until the update has read them, and a write into one (``zero_grad(set_to_none=False)``,
``p.grad.mul_(...)``) waits for its update. A second ``step()``, ``wait()``, ``close()`` and the optimizer's state
dicts wait for the whole queue.

[Note: Paced streamed updates] Run as fast as it can, the worker finished updates far ahead of the forward, and the
weights they wrote went from the host tier before the forward reached them, to be read again: a third read of every
weight a step (the 0.17B Llama in `Trainer`, 8 micro-batches layer by layer, 160 MiB host budget: 6.0 bytes a
parameter of weights read a step against 3.8 paced, 19.8 a step in all against 17.8). So while a forward runs on its
recorded trace, an update starts only once the forward is at most the prefetch depth and ``AHEAD`` unit uses from
its parameter: the weight it writes is then among the next the forward reads, which eviction keeps. Outside a
forward (before it starts, once it has returned or raised, off its trace, once past the parameter) the queue runs at
once: a script whose forward raised exits (the interpreter's exit joins the worker). So it does once the interpreter
begins to exit, whatever said the forward runs (an FSDP2 rank's forward, the root module's, sees no end when Ctrl-C
stops it). It runs unpaced once anything waits for it: up to the update waited for where that is a fenced read (the
forward reaching a parameter the worker has not updated yet, a parameter read), the whole queue for ``settle()`` (a
second ``step()``, ``wait()``, a state dict) and ``close()``.

An update that fails stops the queue: the keys of those not run give ``FencedWriteError`` to whoever reads them
(the next forward, say), the model's values refuse use (``off.broken``), and ``step()`` again runs the updates left
with the gradients and hyper-parameters they were queued with (see [Note: A step that stops part-way] in optim.py).
"""

from __future__ import annotations

import functools
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tierstore import TierStore, TierStoreError

from ._contract import OffloadedParameters
from ._pipeline import StatePipeline, UnrestorableUpdateError, changed_keys


AHEAD = 1
"""An update starts once the forward is at most its prefetch depth and this many unit uses from the parameter (see
[Note: Paced streamed updates])."""
PACE_POLL_SECONDS = 0.002
"""How often a paced worker looks where the forward is."""

# Set as the interpreter begins to exit, before it joins the worker threads (the threading module's exit hooks run
# last registered first, so this one before the one that joins the executors' threads).
_exiting = threading.Event()
try:
    threading._register_atexit(_exiting.set)  # type: ignore[attr-defined]  (Python 3.9 and later)
except RuntimeError:  # imported as the interpreter exits
    _exiting.set()


@dataclass(frozen=True)
class Queued:
    """One update as ``step()`` queued it: the parameter, the gradient it applies, its step count and its group's
    (lr, betas, eps, weight_decay, maximize) at that ``step()``."""

    name: str
    key: str
    param: torch.nn.Parameter
    grad: Any
    step: float
    hyper: tuple


class StreamingOptimizer(Protocol):
    """What the worker uses of the optimizer it steps for (``OffloadedAdamW``): its model and store, its pipeline,
    the queue with its progress (``_progress``, set whole: evicting threads read it), the update of one parameter
    (``_timed_step``), whether gradients stay after their update (``keep_grads``) and what marks a step stopped
    part-way (``_part_way``)."""

    offloaded: OffloadedParameters
    store: TierStore
    keep_grads: bool
    _pipeline: StatePipeline
    _progress: tuple[list[tuple], int]

    def _timed_step(self, name: str, key: str | None, p: torch.nn.Parameter, grad: Any, *, step: float,
                    hyper: tuple) -> None: ...

    def _part_way(self, error: BaseException, stopped: str, again: str) -> None: ...


class StreamedUpdates:
    """The updates one optimizer queued at its last ``step()``, run in order on one worker thread. Called on the
    training thread (``queue``, ``settle``, ``run_left``, ``close``); ``_run`` on the worker."""

    def __init__(self, opt: StreamingOptimizer) -> None:
        self.opt = opt
        self._worker: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="tierstore-adamw-stream")
        self._writer = self._worker.submit(threading.get_ident).result()
        self._futures: list[Future] = []
        self._failed: BaseException | None = None  # the update that stopped the last queue
        self.left: list[Queued] = []  # the updates a failure left (``step()`` again runs them)
        # The updates up to this place in the queue run unpaced (see [Note: Paced streamed updates]); _wake wakes a
        # paced worker to look again.
        self._through: float = math.inf
        self._wake = threading.Event()

    @property
    def open(self) -> bool:
        """Whether it still queues (until ``close()``: then ``step()`` runs every update itself)."""
        return self._worker is not None

    @property
    def busy(self) -> bool:
        """Whether updates of the last ``step()`` are still queued or running."""
        return any(not f.done() for f in self._futures)

    def queue(self, items: list[Queued]) -> None:
        """Run ``items`` in order on the worker, each fencing the keys it changes; returns at once."""
        assert self._worker is not None and not self.left
        opt = self.opt
        grads = opt.offloaded.grads
        for it in items:
            grads.claim(it.grad)
        self._failed = None
        opt.store.stats.add("updates_streamed", len(items))
        ready = [(it.name, it.key, it.param, it.grad) for it in items]
        opt._progress = (ready, 0)
        layout = opt._pipeline.layout
        self._through = -1
        for i, it in enumerate(items):
            fut = self._worker.submit(self._run, items, ready, i)
            # a reader that waits lets the queue run unpaced up to what it reads
            opt.store.fence(changed_keys(it.name, it.key, it.param, layout), fut, self._writer,
                            settle=functools.partial(self._hurry, i))
            self._futures.append(fut)

    def _run(self, items: list[Queued], ready: list[tuple], i: int) -> None:
        opt = self.opt
        if self._failed is not None:
            raise TierStoreError(f"not run: an update queued before it failed ({type(self._failed).__name__})")
        it = items[i]
        self._pace(i, it)
        try:
            with opt.store.stats.background():
                opt._pipeline.read_ahead(ready, i)
                opt._timed_step(it.name, it.key, it.param, it.grad, step=it.step, hyper=it.hyper)
        except BaseException as e:
            self._failed = e
            self.left = list(items[i:])
            self._break(e, done=i)
            raise
        opt.offloaded.grads.release_claim(it.grad, drop=not opt.keep_grads)
        ready[i] = (it.name, it.key, it.param, None)
        opt._progress = (ready, i + 1)
        if i + 1 == len(items):
            opt._pipeline.end_step()

    def _pace(self, i: int, it: Queued) -> None:
        """Wait until the forward nears the parameter of ``it``, the ``i``-th update, or something waits for it or
        for one after it (see [Note: Paced streamed updates])."""
        off = self.opt.offloaded
        while True:
            self._wake.clear()  # before looking: a _hurry from now on wakes the wait below
            if (i <= self._through or _exiting.is_set()  # the interpreter exits: it joins this thread
                    or not off.prefetch_policy.depth + AHEAD < off.forward_distance(it.key) < math.inf):
                return
            self._wake.wait(PACE_POLL_SECONDS)

    def _hurry(self, i: float) -> None:
        """A reader waits for the ``i``-th update: it and those before it run at once."""
        self._through = max(self._through, i)
        self._wake.set()

    def _break(self, error: BaseException, done: int) -> None:
        """The queue stopped at an update that failed: the model is part of a step ahead (on the worker)."""
        opt = self.opt
        opt._progress = ([], 0)
        opt._pipeline.drop_window()
        if isinstance(error, UnrestorableUpdateError):
            return  # its update marked the values broken for good
        opt._part_way(error, f"the updates step() queued stopped after {done} of {done + len(self.left)}",
                      f"it runs the {len(self.left)} left with the gradients and learning rates they were queued with")

    def settle(self) -> None:
        """Wait for every queued update (a failure stays for ``run_left`` and the fenced readers)."""
        futures, self._futures = self._futures, []
        self._hurry(math.inf)
        for f in futures:
            f.exception()

    def run_left(self) -> bool:
        """Run, on this thread, the updates a failure left; False when there were none."""
        if not self.left:
            return False
        left, self.left = self.left, []
        opt = self.opt
        grads = opt.offloaded.grads
        layout = opt._pipeline.layout
        opt.store.unfence([k for it in left for k in changed_keys(it.name, it.key, it.param, layout)])
        for i, it in enumerate(left):
            try:
                self.opt._timed_step(it.name, it.key, it.param, it.grad, step=it.step, hyper=it.hyper)
            except BaseException:
                self.left = left[i:]
                raise
            grads.release_claim(it.grad, drop=not self.opt.keep_grads)
        self.opt._pipeline.end_step()
        return True

    def forget(self) -> None:
        """The state is being dropped: the updates left by a failure go, and their fences with them."""
        layout = self.opt._pipeline.layout
        self.opt.store.unfence([k for it in self.left for k in changed_keys(it.name, it.key, it.param, layout)])
        self.left = []

    def close(self) -> None:
        """Wait for the queue and stop the worker."""
        if self._worker is None:
            return
        self.settle()
        self._worker.shutdown(wait=True)
        self._worker = None


__all__ = ["Queued", "StreamedUpdates"]
