"""The worker of ``OffloadedAdamW(speculate=True)``: each update made in backward, kept or undone at ``step()``.

[Note: Speculated updates] A loop that clips by the global norm cannot step a parameter before its backward ends:
the clip coefficient needs every gradient. But where the norm stays under ``max_norm`` the coefficient is exactly 1,
and the update made with the gradient as backward left it is the step's, bit for bit (``x * 1`` is ``x``). With
``speculate=True`` each offloaded parameter is updated on a worker as soon as its gradient is complete (as with
``step_in_backward``, beside the rest of backward), and ``step()`` decides:

- The update stands where nothing changed its gradient since the worker read it but products by exactly 1 (torch's
  ``clip_grad_norm_`` multiplies every gradient by its clamped coefficient: 1 when it does not clip; a non-finite
  norm gives NaN, a clip anything else), the parameter's group has the hyper-parameters the update used, and the
  update ran. Nothing more moves for it: ``step()`` frees what it kept.
- Any other is undone and made again by ``step()`` as without speculation (streamed with ``stream_update=True``):
  the update kept the version of every key it changes (moments, master, weight: see [Note: Kept versions] in
  tierstore/_versions.py), at no cost in bytes, and the gradient stays in the store, so the redo reads the state of
  before and the gradient as clipped; the same arithmetic on the same inputs gives the step's result.

Until ``step()`` decides, the keys of the speculated updates are fenced (see [Note: Fenced keys]). Whatever reads
one first (the next micro-batch's forward in a loop that accumulates, a parameter or state read, a checkpoint,
``zero_grad()`` with no step, a skipped step of GradScaler) undoes them all, and speculation rests until the next
``step()``: every value anyone reads is a whole step's. A second backward before ``step()`` does the same. Under
``off.accumulate`` only the backward of the last micro-batch speculates (see [Note: The last micro-batch]). Counted
in the store's stats: ``updates_speculated``, ``speculated_kept``, ``speculated_undone``.

[Note: When to speculate] An update undone costs its reads and writes twice, and the clip decides: a fine-tune with
``max_grad_norm=1.0`` may clip on every step (measured in docs/optimizer.md), a pretraining run rarely. With
``speculate="auto"`` a step whose speculated updates did not all stand (a clip, an lr changed between backward and
``step()``, a read before it) pauses speculation, and it starts again after a step that, run without it, had one
backward (a loop that accumulates has several, and the second forward would undo the first backward's updates) and
whose gradients nothing but products by exactly 1 changed (read off the clip recorded on each stored gradient, at no
cost). So a run that clips every step pays for one undone step, and one that stops clipping speculates from the step
after (measured in docs/optimizer.md: a fine-tune clipping all 200 steps took 0.99x the time without speculation),
which makes ``"auto"`` the default. It runs as ``False`` where speculating cannot run (``step_in_backward``, no
drive, a model whose reads do not all go through the store, a host budget below what one update needs beside
backward); ``speculate=True`` speculates in every backward, and is refused there. Near that minimum, what the
check cannot see (a module's views kept across steps) may leave backward waiting for host room an update holds:
the update gives way (see ``_run``).

[Note: The last micro-batch] A loop that accumulates over k micro-batches completes each gradient in the last
one's backward; an update speculated in an earlier one would be undone by the next forward. ``off.accumulate``
(and ``accumulate_layer_major(trainer)``) says which gradients are the step's (``off.final_gradients``): layer by
layer, those micro-batch k-1's backward completes (the head's in the forward, each segment's in its last rerun, the
glue's), but a tied weight's, whose parts are summed at the end of the step (see [Note: Tied parameters layer by
layer]); run as the loop, those of its last micro-batch. A loop of one's own says so with
``opt.set_is_last_micro_batch(False)`` before the micro-batches but the last and ``(True)`` before the last, as
FSDP2's ``set_requires_gradient_sync`` is called. Where nothing says so every backward may be the last, and
``speculate="auto"`` pauses once the second forward of a step has undone the first backward's updates.

Cost: the gradient is kept (in the store, written to the drive only where the host tier has no room for it; with
``code_grads=True`` and ``keep_grads=False``, coded against its moments at about a byte an element: see [Note: A kept
gradient coded against its moments] in _grad_code.py) and a spare extent is taken for each changed key (the drive
needs room for the speculated updates' state twice). The drive's room is taken at the first update of a backward: the
updates backward completes first speculate while it lasts, and those beyond it step at ``step()`` (one warning says
so). The updates run where eviction and the placement expect those of ``step_in_backward``: right after their
parameter's last use; backward waits while the gradients the worker has not yet read pass
``max_grad_backlog_bytes``, so that it reads them from the host tier. A parameter whose state is not on the drive
is not speculated and steps at ``step()``, nor is one whose whole state the placement keeps in the host tier: the
drive must hold the version to keep, so a kept copy changed since it was last written home is written home each
step, where the placement writes it only when it goes; for an update that moves no drive bytes without speculation
that is all cost (a model whose state it keeps whole moved no bytes a step without speculation). A speculated update
writes such copies behind it, as it writes the others (written home at the next step's update instead, each
write waited for there behind the reads in flight: on the anchor model of docs/optimizer.md 22 of them a step held
its worker 0.37 s a step). Where part of the state is on the drive the update reads and writes that part anyway,
and speculating it pays: on the anchor model of docs/optimizer.md (its weights partly kept) leaving out every update
with a kept copy left 240 of 864 to step() and took 2.75 s a step against 2.43-2.46 (one run, alternating).
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tierstore import KeptVersions, RoomYieldedError, StoreFullError, Tier, TierKeyError, TierStore

from . import _grad_code
from ._contract import OffloadedParameters, PassConsumer, optimizer_key
from ._grads import GradientStore, store_key_of
from ._in_backward import Backlog, wait_for_backlog
from ._pipeline import StatePipeline, changed_keys


_ALIGN = 4096  # what an extent may take beyond its bytes


class WatchedGradients(Protocol):
    """What the worker uses of the gradients the offload keeps (``GradientStore``, or FSDP2's shards of them)."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def watched_values(self, grad: torch.Tensor) -> Any: ...

    def unchanged(self, grad: torch.Tensor) -> bool: ...

    def scaled_by_one(self, grad: torch.Tensor) -> bool: ...

    def dtype_of(self, param: torch.Tensor) -> torch.dtype: ...


class SpeculatingOptimizer(Protocol):
    """What the worker uses of the optimizer it updates for (``OffloadedAdamW``): its model and store, its items
    and pipeline, the queue with its progress (``_progress``, set whole: evicting threads read it), the update of
    one parameter with given values (``_timed_step``), each parameter's step count, what each last update applied
    (``steps``, ``_applied``) and its group's hyper-parameters now (``_hyper``)."""

    offloaded: OffloadedParameters
    store: TierStore
    max_grad_backlog_bytes: int
    speculate: bool | str
    keep_grads: bool
    code_grads: bool
    steps: dict[str, float]
    _items: list[tuple[str, str | None, torch.nn.Parameter]]
    _applied: dict[str, Any]
    _pipeline: StatePipeline
    _progress: tuple[list[tuple], int]

    def _timed_step(self, name: str, key: str | None, p: torch.nn.Parameter, grad: Any, *, step: float,
                    hyper: tuple, values: torch.Tensor | None = None, watch: Any = None) -> None: ...

    def _hyper(self, name: str) -> tuple: ...

    def updates_done(self) -> None: ...


@dataclass(eq=False)
class _Speculated:
    """One update made in backward: what it applied and what undoes it."""

    name: str
    key: str
    param: torch.nn.Parameter
    grad: Any
    step: float
    hyper: tuple
    before: tuple[float | None, Any]  # the parameter's step count and last applied gradient before it
    nbytes: int = 0  # of its gradient
    kept: KeptVersions | None = None  # set by the worker once it has kept the versions (None: not updated)
    future: Future | None = None
    coded: bool = False  # its gradient stored coded against its moments (see _grad_code.py)
    coding: Future | None = None  # the coder's work on it
    left: threading.Event = field(default_factory=threading.Event)  # the worker is done with it


@dataclass(eq=False)
class _Round:
    """The updates speculated in one backward, and the future their fences wait on (completed by ``decide``)."""

    items: list[_Speculated] = field(default_factory=list)
    by_key: dict[str, _Speculated] = field(default_factory=dict)
    queue: list[tuple] = field(default_factory=list)  # (name, key, param, grad): the read-ahead's list
    decided: Future = field(default_factory=Future)
    free: int = 0  # the drive's room when it began
    room: int = 0  # of that, what the gradients may not take
    reserved: int = 0  # of that room, what its updates take (see SpeculatedUpdates._room_for)


class SpeculatedUpdates(PassConsumer):
    """The updates one optimizer speculates in backward, on one worker thread (see [Note: Speculated updates]).
    ``grad_ready`` on the backward's thread; ``decide``, ``undo`` and ``close`` on the training thread (``undo``
    also on whichever thread reads a fenced key first); ``_run`` on the worker."""

    watches_grads = True

    def __init__(self, opt: SpeculatingOptimizer, *, auto: bool = False) -> None:
        self.opt = opt
        self.auto = auto  # pause after a step whose updates did not stand (see [Note: When to speculate])
        self.paused = False
        self.is_last_micro_batch = True  # opt.set_is_last_micro_batch's
        self._backwards = 0  # backward passes since the last step(), and the keys of the last one's gradients
        self._seen: set[str] = set()
        self.by_key = {key: (name, key, p) for name, key, p in opt._items if key is not None}
        layout = opt._pipeline.layout
        self._changed = {key: changed_keys(name, key, p, layout) for key, (name, _, p) in self.by_key.items()}
        self._worker: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="tierstore-adamw-spec")
        self._writer = self._worker.submit(threading.get_ident).result()
        self._round: _Round | None = None
        self._resting = False  # undone since the last step(): speculate again after it
        self._homes_on_drive: dict[str, bool] = {}  # key -> whether every key its update changes lives on the drive
        self._lock = threading.RLock()  # of the round: undo may come from any thread that reads a fenced key
        self.room_warned = False
        self._warn_lock = threading.Lock()
        self._need: dict[str, int] = {}  # key -> the drive its speculated update takes (see _room_for)
        self._backlog = Backlog()  # of gradients queued for the worker and not yet read by it
        # Whether kept gradients are coded (see [Note: A kept gradient coded against its moments]): a committed
        # update's gradient goes at step(), and the offload's own store keeps it.
        self._codes = (opt.code_grads and not opt.keep_grads and isinstance(opt.offloaded.grads, GradientStore)
                       and _grad_code.available())
        self._coder: ThreadPoolExecutor | None = None  # codes beside the worker (made at the first coding)
        # Two sets of buffers, taken in turn by the worker: one the coder codes from while the other is filled.
        self._coders = [_grad_code.Coder(), _grad_code.Coder()]
        self._coding_with: list[Future | None] = [None, None]
        self._turn = 0

    # ---- backward's thread ----------------------------------------------------------------------
    def grad_ready(self, key: str) -> None:
        """A gradient is complete: speculate its parameter's update (or, a second time, undo the round)."""
        opt = self.opt
        if key not in self.by_key or self._worker is None or not self.final(key):
            return
        if key in self._seen or not self._backwards:  # a parameter's gradient completes once a backward
            self._backwards += 1
            self._seen = set()
        self._seen.add(key)
        if self._resting or self.paused:
            return
        with self._lock:
            round_ = self._round
            if round_ is not None and key in round_.by_key:  # a second backward before step(): it accumulates
                self._undo_locked()
                return
            name, key_, p = self.by_key[key]
            grad = opt.offloaded.grads.get(key)
            if grad is None or not self._on_drive(key) or opt.store.kept(Tier.HOST).issuperset(self._changed[key]):
                return
            if round_ is None:
                free = opt.store.nvme_room_bytes()
                room = free - self._gradient_bytes()
                if room <= 0:  # none fits: this backward speculates nothing (and "auto" rests a step)
                    self._no_room(self._room_left(free, room))
                    self._resting = True
                    return
                opt.updates_done()  # the last step's streamed updates first: the worker's queue is one at a time
                round_ = self._round = _Round(free=free, room=room)
            if not self._room_for(round_, key):
                return
            spec = _Speculated(name, key_, p, grad, opt.steps.get(name, 0.0) + 1.0, opt._hyper(name),
                               (opt.steps.get(name), opt._applied.get(name)), grad.numel() * grad.element_size())
            round_.items.append(spec)
            round_.by_key[key] = spec
            round_.queue.append((name, key_, p, grad))
            opt._progress = (round_.queue, opt._progress[1] if opt._progress[0] is round_.queue else 0)
            opt.store.fence(self._changed[key], round_.decided, self._writer, settle=self.undo)
            self._backlog.add(spec.nbytes)
            spec.future = self._worker.submit(self._run, round_, len(round_.items) - 1)
            self._wait_for_backlog(round_)

    def _wait_for_backlog(self, round_: _Round) -> None:
        """Backward waits while the gradients the worker has yet to read exceed ``max_grad_backlog_bytes``: read
        while in the host tier, not written to the drive and read back (see [Note: Stepping in backward])."""
        def oldest() -> Future | None:
            return next((s.future for s in round_.items if s.future is not None and not s.future.done()), None)

        wait_for_backlog(self.opt.store, lambda: self._backlog.bytes > self.opt.max_grad_backlog_bytes, oldest,
                         self._writer)

    def held_host_bytes(self) -> int:
        """The gradients queued for the worker, which the placement's room counts as it counts those of the worker
        stepping in backward (see [Note: Updates behind backward] in _placing.py): the backlog's bound, or the most
        the last round queued if more."""
        return self._backlog.held_bytes(self.opt.max_grad_backlog_bytes)

    def final(self, key: str) -> bool:
        """Whether the gradient of ``key`` backward just completed is the step's: ``off.accumulate`` says which
        micro-batch is the last, a loop of its own with ``opt.set_is_last_micro_batch`` (see [Note: The last
        micro-batch])."""
        finals = self.opt.offloaded.final_gradients
        return finals(key) if finals is not None else self.is_last_micro_batch

    def _on_drive(self, key: str) -> bool:
        """Whether every key the parameter's update changes lives on the drive (asked of the store once)."""
        on_drive = self._homes_on_drive.get(key)
        if on_drive is None:
            on_drive = self._homes_on_drive[key] = all(
                self.opt.store.info(k)["home"] == Tier.NVME.label for k in self._changed[key])
        return on_drive

    def _gradient_bytes(self) -> int:
        """The drive the gradients of this backward may still take: each is kept until ``step()`` and may be written
        there, and one that has no place there yet (not stored, or stored in the host tier only) will take one."""
        grads: WatchedGradients = self.opt.offloaded.grads  # type: ignore[assignment]
        store = self.opt.store
        need = 0
        for key, (_, _, p) in self.by_key.items():
            where = store_key_of(grads.get(key))
            try:
                placed = where is not None and Tier.NVME.label in store.info(where)["copies"]
            except TierKeyError:  # dropped meanwhile (zero_grad)
                placed = False
            if not placed:
                local = p.to_local() if hasattr(p, "to_local") else p  # a rank's shard of an FSDP2 parameter
                need += local.numel() * grads.dtype_of(p).itemsize + _ALIGN
        return need

    @staticmethod
    def _room_left(free: int, room: int, reserved: int = 0) -> str:
        return (f"{free / 2**20:.1f} MiB is free, of which the gradients may take {(free - room) / 2**20:.1f} MiB"
                + (f" and the updates before it took {reserved / 2**20:.1f} MiB" if reserved else ""))

    def _room_for(self, round_: _Round, key: str) -> bool:
        """Whether the drive's room at the round's start, less what the backward's gradients may take, still has
        room for a spare extent for every key the update of ``key`` changes. The updates backward completes first
        take it; the others step at ``step()`` (said once: see ``_no_room``)."""
        need = self._need.get(key)
        if need is None:
            store = self.opt.store
            need = self._need[key] = sum(store.info(k)["nbytes"] + _ALIGN for k in self._changed[key])
        if round_.reserved + need <= round_.room:
            round_.reserved += need
            return True
        if not self.room_warned:
            self._no_room(f"{self._room_left(round_.free, round_.room, round_.reserved)}; the update of "
                          f"{self.by_key[key][0]!r} needs {need / 2**20:.1f} MiB more for a second copy of the state "
                          f"it changes")
        return False

    # ---- the worker -----------------------------------------------------------------------------
    def _run(self, round_: _Round, i: int) -> None:
        opt = self.opt
        spec = round_.items[i]
        store = opt.store
        grads: WatchedGradients = opt.offloaded.grads  # type: ignore[assignment]
        try:
            # Backward goes first: where it waits for host room this update holds, the update lets go of it
            # (restored as it was) and steps at step() instead (see [Note: Waiting for room] in tierstore/_room.py).
            with store.stats.background(), store.giving_way():
                opt._pipeline.read_ahead(round_.queue, i)
                try:
                    kept = store.keep_version(self._changed[spec.key])
                except StoreFullError as e:
                    self._no_room(str(e))
                    return
                try:
                    with grads.watched_values(spec.grad) as values:
                        if values is None:  # dropped meanwhile (zero_grad): nothing to speculate
                            kept.commit()
                            return
                        opt._timed_step(spec.name, spec.key, spec.param, spec.grad, step=spec.step,
                                        hyper=spec.hyper, values=values,
                                        watch=self._coding(spec, values) if self._codes else None)
                except BaseException:
                    kept.restore()  # nothing of it persists; step() updates it as without speculation
                    raise
                spec.kept = kept
                opt._pipeline.write_behind(self._changed[spec.key])  # its kept copies (see the note's cost)
                store.stats.add("updates_speculated")
        except RoomYieldedError:
            pass  # not made (spec.kept is None): step() makes it
        finally:
            spec.left.set()
            self._backlog.remove(spec.nbytes)
            round_.queue[i] = (spec.name, spec.key, spec.param, None)
            if opt._progress[0] is round_.queue:
                opt._progress = (round_.queue, i + 1)

    def _coding(self, spec: _Speculated, values: torch.Tensor) -> Any:
        """The pipeline's ``watch`` of one speculated update: the first moment before it is copied, and after it the
        coder codes ``values`` against both and keeps the code in their place (see [Note: A kept gradient coded
        against its moments] in _grad_code.py), on the moment and gradient the worker holds for it (the worker may
        read them, fenced, where the coder may not)."""
        beta1, maximize = spec.hyper[1][0], spec.hyper[4]
        where = store_key_of(spec.grad)
        if maximize or where is None:
            return None
        store = self.opt.store

        def watch(exp_avg: torch.Tensor) -> Any:
            if not _grad_code.codable(values, exp_avg):
                return None
            turn = self._turn
            if (busy := self._coding_with[turn]) is not None and not busy.done():
                return None  # the coder is behind: kept as it is (the worker never waits for it)
            self._turn ^= 1
            coder = self._coders[turn]
            before = coder.snapshot(exp_avg)
            moment = optimizer_key(spec.name, "exp_avg")

            def after(exp_avg: torch.Tensor) -> None:
                held: list[tuple[str, torch.Tensor]] = []
                try:
                    for key in (moment, where):  # the coder reads them: held for it, let go by it
                        held.append((key, store.get(key, Tier.HOST)))
                    if self._coder is None:
                        self._coder = ThreadPoolExecutor(1, thread_name_prefix="tierstore-adamw-code")
                    spec.coding = self._coding_with[turn] = self._coder.submit(
                        self._code, spec, coder, values, before, exp_avg.view(-1), beta1, held)
                except BaseException:
                    for key, _ in held:
                        store.release(key, Tier.HOST)
                    raise

            return after

        return watch

    def _code(self, spec: _Speculated, coder: _grad_code.Coder, values: torch.Tensor, before: torch.Tensor,
              after: torch.Tensor, beta1: float, held: list[tuple[str, torch.Tensor]]) -> None:
        """On the coder: code ``values`` and keep the code in their place; let go of what the worker held for it."""
        store = self.opt.store
        grads: GradientStore = self.opt.offloaded.grads  # type: ignore[assignment]
        try:
            code = coder.code(values, before, after, beta1)
        finally:
            for key, _ in held:
                store.release(key, Tier.HOST)
            del values, after, held
        if code is not None:
            spec.left.wait()  # the worker has let go of the gradient it read (so it may be dropped)
            with store.giving_way():  # backward's allocations go first
                spec.coded = grads.keep_coded(spec.grad, code, self.undo)
            if spec.coded:
                store.stats.add("gradients_coded")

    def _restore_decoding(self, spec: _Speculated) -> None:
        """Undo a speculated update whose gradient is stored coded: decode it from the first moment after the
        update and, restored, before it. On the worker, which may read the fenced moment."""
        store = self.opt.store
        grads: GradientStore = self.opt.offloaded.grads  # type: ignore[assignment]
        assert spec.kept is not None
        key = optimizer_key(spec.name, "exp_avg")
        after = store.read(key)
        spec.kept.restore()
        before = store.get(key, Tier.HOST)
        try:
            grads.uncode(spec.grad, lambda code, out: _grad_code.decode(code, before.view(-1), after.view(-1),
                                                                         spec.hyper[1][0], out.view(-1)))
        finally:
            store.release(key, Tier.HOST)

    def _no_room(self, why: str) -> None:
        """Said once (by backward's thread or the worker's, whichever first): the drive has no room to keep what the
        updates replace."""
        with self._warn_lock:
            warned, self.room_warned = self.room_warned, True
        if not warned:
            warnings.warn(f"OffloadedAdamW(speculate={self.opt.speculate!r}): the drive has no room to keep what more "
                          f"updates made in backward replace, so the parameters beyond it step at step() instead "
                          f"({why}); free space on the drive or raise nvme_budget_bytes to speculate them all, or pass "
                          f"speculate=False to step them all there", stacklevel=2)

    # ---- the training thread --------------------------------------------------------------------
    def _settled(self, round_: _Round, *, cancel: bool = False) -> None:
        """Wait for the round's updates (``cancel``: those not started are not run: they would be undone)."""
        for spec in round_.items:
            assert spec.future is not None
            if cancel and spec.future.cancel():
                self._backlog.remove(spec.nbytes)
                continue
            if not spec.future.cancelled():
                spec.future.exception()  # a failed one kept nothing (see _run)
            if spec.coding is not None:
                spec.coding.exception()  # a failed one is not coded

    def decide(self) -> set[str]:
        """At ``step()``: keep each speculated update that is the step's and undo the others (see [Note:
        Speculated updates]); the keys of the parameters kept, which ``step()`` does not update again."""
        with self._lock:
            round_, self._round = self._round, None
            resting, self._resting = self._resting, False
            self._backlog.roll()
            backwards, seen, self._backwards, self._seen = self._backwards, self._seen, 0, set()
            opt = self.opt
            grads: WatchedGradients = opt.offloaded.grads  # type: ignore[assignment]
            if round_ is None:
                if self.auto and resting:
                    self.paused = True
                elif self.paused:  # see [Note: When to speculate]
                    self.paused = not (backwards == 1 and all(
                        grads.scaled_by_one(g) for k in seen if (g := grads.get(k)) is not None))
                return set()
            self._settled(round_)
            stood: set[str] = set()
            undone = 0
            for spec in round_.items:
                if spec.kept is None:
                    continue
                if grads.unchanged(spec.grad) and opt._hyper(spec.name) == spec.hyper:
                    spec.kept.commit()
                    stood.add(spec.key)
                else:
                    self._undo_one(spec)
                    undone += 1
            opt.store.stats.add("speculated_kept", len(stood))
            opt.store.stats.add("speculated_undone", undone)
            self.paused = self.auto and undone > 0
            round_.decided.set_result(None)  # lifts the fences
            return stood

    def undo(self) -> None:
        """Undo every update speculated since the last ``step()``; none more until the next (a read of a fenced key
        calls it: see [Note: Speculated updates])."""
        with self._lock:
            self._undo_locked()

    def _undo_locked(self) -> None:
        round_, self._round = self._round, None
        if round_ is None:
            return
        self._resting = True
        self._settled(round_, cancel=True)
        undone = 0
        for spec in round_.items:
            if spec.kept is not None:
                self._undo_one(spec)
                undone += 1
        self.opt.store.stats.add("speculated_undone", undone)
        if self.opt._progress[0] is round_.queue:
            self.opt._progress = ([], 0)
        round_.decided.set_result(None)

    def _undo_one(self, spec: _Speculated) -> None:
        opt = self.opt
        assert spec.kept is not None
        if spec.coded and opt.offloaded.grads.is_coded(spec.grad):  # type: ignore[attr-defined]
            if threading.get_ident() == self._writer or self._worker is None:
                self._restore_decoding(spec)
            else:  # the worker is idle here (its updates settled)
                self._worker.submit(self._restore_decoding, spec).result()
        else:
            spec.kept.restore()
        spec.coded = False
        spec.kept = None
        steps, applied = spec.before
        if steps is None:
            opt.steps.pop(spec.name, None)
        else:
            opt.steps[spec.name] = steps
        if applied is None:
            opt._applied.pop(spec.name, None)
        else:
            opt._applied[spec.name] = applied

    def close(self) -> None:
        """Undo what is speculated and stop the worker."""
        if self._worker is None:
            return
        self.undo()
        self._worker.shutdown(wait=True)
        self._worker = None
        if self._coder is not None:
            self._coder.shutdown(wait=True)
            self._coder = None


__all__ = ["SpeculatedUpdates"]
