"""AdamW whose fp32 master weights and moments live in a TierStore, stepped with read-ahead and write-behind.

[Note: Pipelined step] Parameters are stepped one at a time in a fixed order.
Before parameter i is computed, the state of the next parameters (up to
``readahead_bytes`` of it, by default half the host budget, or half the room a
placement leaves for copies in flight, and ``readahead``
parameters if given; none where the model's prefetch depth is 0) is already
being read into the host tier; after it is computed its state is
marked dirty and a write-back is started at once, so the drive writes
parameter i while the CPU computes i+1. The arithmetic is torch.optim.AdamW's
own, with the implementation its ``foreach``/``fused`` flags choose (see
[Note: Which AdamW] in _adamw.py), so fp32 training is bit-identical to it
given the same flags.

[Note: A step that stops part-way] An update that fails (a read of
its state, say) leaves that parameter as it was, but those updated
before it stay updated: the model is part of a step ahead, which no
resident training ever is. A gradient whose update succeeded is marked
as applied (the tensor and its version), so calling step() again with
the same gradients updates only the rest, and the step ends as if it
had not failed; step() twice with the same gradients is refused. Until
it is finished, forward, zero_grad() and checkpoints refuse (through
the model's ``broken``, a ``BrokenValues`` this optimizer owns), since
their values would mix two steps.
"""

from __future__ import annotations

import contextlib
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tierstore import Tier, TierStore, TierStoreError, TierTypeError, TierValueError

from . import _adamw
from ._adamw import HYPER, check_hyper
from ._budget import HostBudget
from ._contract import BrokenValues, Mend, OffloadedParameters, PassConsumer, note_interrupt, optimizer_key
from ._grads import generation, store_key_of, values_of
from ._in_backward import BackwardSteps
from ._layouts import StateLayout
from ._optim_params import (
    check_code_grads,
    check_flags,
    check_speculating,
    check_streaming,
    positive_bytes,
    stepped_items,
    torch_groups,
)
from ._optim_state import AdamWState
from ._optim_state_dict import StateDictIO, StateView
from ._pipeline import StatePipeline, UnrestorableUpdateError, Watch
from ._speculated import SpeculatedUpdates
from ._streamed import Queued, StreamedUpdates
from .policies import OptimizerStatePolicy


class _StateConsumer(PassConsumer):
    """What an :class:`OffloadedAdamW` hears of its model's passes (see [Note: Consumers of a pass]): its state goes
    with the offload (a later one may reuse the names), a load remakes the masters of what it wrote, and eviction
    weighs the queue of updates still to run."""

    def __init__(self, opt: OffloadedAdamW) -> None:
        self._opt = opt
        self.stepping = True  # until opt.close(): then its queue is nothing eviction weighs

    def loaded(self, names: list[str]) -> None:
        self._opt._remake_masters(names)

    def finish(self) -> None:
        self._opt.close()  # the updates in flight in backward end
        with contextlib.suppress(BaseException):  # a failed write leaves its copy in memory, read back all the same
            self._opt.wait()

    def removed(self) -> None:
        self._opt._drop_state()

    def next_uses(self) -> dict[str, int]:
        return self._opt._queued() if self.stepping else {}

    def held_host_bytes(self) -> int:
        """With ``stream_update`` alone, the room for the updates queued into the next forward, as for the
        gradients a worker in backward may hold queued (see [Note: Updates behind backward] in _placing.py):
        ``max_grad_backlog_bytes``. A speculating optimizer's worker counts its own queue."""
        opt = self._opt
        streams = opt._streamed is not None and opt._speculated is None
        return opt.max_grad_backlog_bytes if self.stepping and streams else 0


class OffloadedAdamW(StateDictIO, torch.optim.Optimizer):
    """AdamW over offloaded parameters (an ``OffloadedModel`` or ``FSDPOffload``: see
    :class:`~tierstore.integrations._contract.OffloadedParameters`), with optimizer state in the store.

    For fp32 parameters the master weight is the parameter's own store copy;
    for bf16/fp16 parameters an fp32 master is kept and the parameter is
    rounded from it after each step (mixed precision).

    ``param_groups`` gives some parameters their own hyper-parameters, as
    torch.optim's parameter groups do: a list of dicts, each with ``"params"``
    (parameter names or the model's parameters) and any of ``lr``, ``betas``,
    ``eps``, ``weight_decay``, ``maximize``; parameters in no group form a last
    group with the keyword defaults. The update is torch.optim.AdamW's own
    (``maximize`` included), with the implementation its flags choose for CPU
    tensors: the single-tensor one by default, the multi-tensor one with
    ``foreach=True``, the fused kernel with ``fused=True`` (one pass over the
    state, several times faster here); each is bit-identical to
    torch.optim.AdamW given the same flag, and the fused kernel's results differ
    from the default's in the last bits, as torch's do. ``amsgrad``, ``capturable`` and
    ``differentiable`` must be False. It is a ``torch.optim.Optimizer``, so learning-rate
    schedulers drive it through ``param_groups``; its state lives in the store,
    and ``opt.state`` reads it from there (parameter -> its state, as torch's
    optimizers key it, one tensor at a time; see :class:`StateView`).

    ``keep_grads``: after backward, ``step()`` leaves each gradient in place
    until ``zero_grad()``, as torch's optimizers do (the default); the update
    applies a recorded clip coefficient to a copy, so the stored gradient is not
    changed and making room drops it with no write. With ``keep_grads=False`` it
    lets each go as soon as its update has applied it (``p.grad`` is None after,
    as when stepping in backward), and its room with it. Loops that read no
    gradient after ``step()`` (transformers' ``Trainer``, most training loops)
    lose nothing; the numbers are the same either way.

    ``stream_update``: ``step()`` steps the resident parameters, queues the
    updates of the offloaded ones (in the order the forward uses them, each with
    its group's hyper-parameters at this ``step()``) and returns; a worker runs
    them while the next forward computes, and whatever reads a value one of them
    changes waits for exactly that update (see [Note: Updates streamed into the
    next forward]). For loops that clip by the global norm, which
    ``step_in_backward`` cannot run; the numbers are the same. Call
    :meth:`close` when done with it.

    ``speculate``: each offloaded parameter is updated in backward as its
    gradient completes, beside the rest of backward, before it is known whether
    the update is the step's; ``step()`` keeps those whose gradient nothing but
    a product by exactly 1 changed (a clip that did not clip) and whose group's
    hyper-parameters are as they were, and undoes the others and makes them as
    without it (see [Note: Speculated updates]). For loops that clip and mostly
    do not. ``"auto"`` (the default) stops after a step whose updates did not
    stand and starts again after one with a single backward that did not clip
    (see [Note: When to speculate]), and runs as ``False`` with
    ``step_in_backward``, a store without a drive, or a host budget that holds
    an update after backward but not beside it. ``True`` speculates in every
    backward and is refused there. The numbers are the same either way. Call
    :meth:`close` when done with it.

    ``code_grads`` (with ``speculate`` and ``keep_grads=False``): the gradient a
    speculated update keeps until ``step()`` is stored coded against its first
    moment, about a byte an element instead of 4 (see [Note: A kept gradient
    coded against its moments]): fewer drive bytes for a coder thread's CPU.
    Off by default: on a 2-core machine the anchor model of docs/optimizer.md
    took 2.05-2.12 s a step with it against 1.82-1.84 without, while moving
    0.3-0.4 GB a step fewer; where the drive bounds the step and cores are
    spare, turn it on. The numbers are the same either way.
    """

    steps_offloaded_parameters = True  # other torch optimizers are refused over offloaded parameters

    def __init__(self, offloaded: OffloadedParameters, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, param_groups: list[dict[str, Any]] | None = None,
                 readahead: int | None = None, readahead_bytes: int | str | None = None,
                 home: Tier | str | None = None, step_in_backward: bool = False,
                 max_grad_backlog_bytes: int | str | None = None, maximize: bool = False, amsgrad: bool = False,
                 foreach: bool | None = None, fused: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, moments: str | None = None, master: str | None = None,
                 keep_grads: bool = True, stream_update: bool = False, speculate: bool | str = "auto",
                 code_grads: bool = False, policy: OptimizerStatePolicy | None = None) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        check_hyper(defaults, "")
        check_flags(offloaded, amsgrad=amsgrad, capturable=capturable, differentiable=differentiable)
        check_streaming(offloaded, stream_update=stream_update, step_in_backward=step_in_backward)
        speculating = check_speculating(offloaded, speculate=speculate, step_in_backward=step_in_backward)
        check_code_grads(code_grads=code_grads, keep_grads=keep_grads, speculate=speculate)
        impl = _adamw.impl_of(foreach, fused)
        chosen = (policy or OptimizerStatePolicy()).overridden(moments=moments, master=master, home=home)
        self.layout = StateLayout(chosen.moments, chosen.master)
        if readahead is None:  # prefetch depth 0 turns off reading ahead, the optimizer's as well
            readahead = 0 if offloaded.prefetch_policy.depth == 0 else sys.maxsize  # bytes bound it
        if readahead < 0:
            raise TierValueError(f"readahead={readahead} must be >= 0")
        self.offloaded = offloaded
        self.store: TierStore = offloaded.store
        host = HostBudget(self.store)  # its shares: see [Note: Splitting the host budget]
        # Reads in flight keep the drive busy (measured: half the host tier beat a quarter and 16 parameters
        # by 5-9% a step on ViT-large); the other half is left to the parameters. Under a placement, what it
        # leaves for copies in flight bounds them instead (see integrations/_placing.py).
        fixed = None if readahead_bytes is None else positive_bytes(readahead_bytes, 1, "readahead_bytes")
        self._pipeline = StatePipeline(self.store, readahead=readahead, readahead_bytes=(
            (lambda: fixed) if fixed is not None else (lambda: host.readahead_bytes(offloaded.readahead_room()))),
            impl=impl, layout=self.layout,
            # stepping in backward, one thread beside backward's compute; after it, the CPU's threads are the update's
            # (streamed too: the next forward waits for the updates in its order, so they are its critical path)
            threads=1 if step_in_backward else torch.get_num_threads())
        home = chosen.home
        self.steps: dict[str, float] = {}
        self._items, self._frozen = stepped_items(offloaded)
        self._name_of = {id(p): name for name, _, p in (*self._items, *self._frozen)}
        self._state = AdamWState(offloaded, self.layout, self._items)
        self.layout.check(self._items)
        if speculating and speculate == "auto" and self._state.host_shortfall(host.total_bytes, step_in_backward,
                                                                              speculate=True):
            speculating = False  # a budget that holds an update after backward but not beside it
        self._state.check_host_budget(host.total_bytes, step_in_backward, speculate=speculating)
        # Gradients waiting for their update are memory no tier budgets (see [Note: Stepping in backward]).
        self.max_grad_backlog_bytes = positive_bytes(
            max_grad_backlog_bytes, host.grad_backlog_bytes(), "max_grad_backlog_bytes")
        if any(optimizer_key(name, "exp_avg") in self.store for name, _, _ in self._items):
            raise TierValueError("this model already has an OffloadedAdamW (its state is in the store); keep using "
                                 "that one (opt.load_state_dict() replaces its state), or offload a fresh model")
        self._building = True
        super().__init__(torch_groups(param_groups, defaults, self._items, self._frozen, self._name_of), defaults)
        self._building = False
        self.state = StateView(self)  # type: ignore[assignment]  # torch's is a defaultdict: ours reads the store
        # name -> its group, the very dict a scheduler changes: each update reads its hyper-parameters from it.
        self._group_of = {self._name_of[id(p)]: g for g in self.param_groups for p in g["params"]}
        self._pipeline.state_bytes = self._state.create(home)
        offloaded.follow_optimizer(home)  # see [Note: Gradients in the tiers]
        self.step_in_backward = step_in_backward
        self.keep_grads = keep_grads
        # (name, key, param, grad) in the order they are stepped, and how many of them are: one tuple, replaced
        # whole by the thread that steps (this one, or the worker stepping in backward), so that an evicting
        # thread (``_queued``) reads a queue and its progress that belong together. Stepping in backward the
        # queue is appended to in place (one item at a time, under the GIL); the reader takes one slice of it.
        self._progress: tuple[list[tuple], int] = ([], 0)
        # name -> (the gradient its last update applied, that gradient's version), and why the last step()
        # stopped part-way: see [Note: A step that stops part-way].
        self._applied: dict[str, tuple[weakref.ref, int]] = {}
        self._unfinished: str | None = None
        self._backwards_failed = offloaded.backwards_failed  # as of the last step()
        # See [Note: Stepping in backward].
        self._in_backward = BackwardSteps(self) if step_in_backward else None
        # See [Note: Updates streamed into the next forward].
        self.stream_update = stream_update
        self._streamed = StreamedUpdates(self) if stream_update else None
        # See [Note: Speculated updates].
        self.speculate = speculate
        self.code_grads = code_grads
        self._speculated = SpeculatedUpdates(self, auto=speculate == "auto") if speculating else None
        self._attach(offloaded, step_in_backward)

    def _attach(self, offloaded: OffloadedParameters, step_in_backward: bool) -> None:
        """Tell the model's offload when this state is used (eviction weighs it), and what to do on its removal
        and on a load of its weights (see [Note: Consumers of a pass])."""
        self._state.attach(offloaded.later_uses)
        offloaded.later_uses.in_backward = step_in_backward or self._speculated is not None  # where updates run
        offloaded.later_uses.grads_to_step = self._speculated is not None  # kept until step() all the same
        self._consumer = _StateConsumer(self)
        offloaded.attach(self._consumer)
        if self._in_backward is not None:
            offloaded.attach(self._in_backward)
        if self._speculated is not None:
            offloaded.attach(self._speculated)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Called by ``Optimizer.__init__`` with the groups ``_optim_params.torch_groups`` checked; refused after it.

        Not torch's own, which imports torch._dynamo on its first call: 68 MiB of RSS here.
        """
        if not getattr(self, "_building", False):
            raise TierStoreError("OffloadedAdamW steps the parameters of the model it was given; pass param_groups= "
                                 "when constructing it")
        self.param_groups.append({**self.defaults, **param_group, "params": list(param_group["params"])})

    def _queued(self) -> dict[str, int]:
        """Store keys of the parameters still to be stepped -> their place in the queue (on an evicting thread)."""
        queue, done = self._progress
        out: dict[str, int] = {}
        for pos, item in enumerate(queue[done:]):
            out.update(dict.fromkeys(self._state.use_keys.get(item[0], ()), pos))
        return out

    def _thawed_message(self, names: list[str]) -> str:
        return (f"{len(names)} parameter(s) have a gradient but were frozen (requires_grad=False) when this "
                f"OffloadedAdamW was created, so it keeps no state for them: {', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}. Create the optimizer after unfreezing them")

    def close(self) -> None:
        """Stop the worker of ``step_in_backward`` (after the updates in flight); eviction no longer weighs this
        optimizer's queue. It stays attached to the model's offload, so that removing the offload drops its
        state."""
        if self._in_backward is not None:
            self._in_backward.close()
            self.offloaded.detach(self._in_backward)
        if self._streamed is not None:
            self._streamed.close()
        if self._speculated is not None:
            self._speculated.close()
            self.offloaded.detach(self._speculated)
        self._consumer.stepping = False

    def _drop_state(self) -> None:
        """Drop this optimizer's state from the store (its model's offload is being removed)."""
        self.close()
        with contextlib.suppress(BaseException):
            self.wait()
        if self._streamed is not None:
            self._streamed.forget()
        self._state.drop()
        self._items = []
        self.steps = {}
        self._removed = True

    def named_items(self) -> list[tuple[str, str | None, torch.nn.Parameter]]:
        """(name, store key or None for a resident parameter, parameter) of each parameter this optimizer steps."""
        return list(self._items)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient, or zero each in place (``set_to_none=False``), as torch's optimizers do: then a
        parameter the next backward gives no gradient (an expert no token chose, a branch not taken) is stepped
        with zeros."""
        self._check_attached()
        if self._unfinished is not None:
            raise TierStoreError(self._unfinished)
        if self._speculated is not None:
            self._speculated.undo()  # no step() since the backward: its updates do not stand
        if not set_to_none and self.step_in_backward:
            raise TierValueError("zero_grad(set_to_none=False) keeps every gradient, zeroed, until the next step; with "
                                 "step_in_backward=True each gradient is applied and dropped as backward makes it, so "
                                 "there are none to keep (a parameter that gets no gradient would not be stepped with "
                                 "zeros, as torch would step it): call zero_grad() (set_to_none=True), or use "
                                 "step_in_backward=False")
        self.offloaded.zero_grad(set_to_none)

    def _was_applied(self, name: str, grad: torch.Tensor) -> bool:
        """Whether ``name``'s last update applied this very gradient (see [Note: A step that stops part-way])."""
        seen = self._applied.get(name)
        return seen is not None and seen[0]() is grad and seen[1] == generation(grad)

    def _grad(self, name: str, key: str | None, p: torch.nn.Parameter) -> torch.Tensor | None:
        if key is None:
            return p.grad
        return self.offloaded.grads.get(key)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step over every parameter with a gradient; returns what ``closure`` returned (None without).

        ``closure``, as torch's optimizers take it, is called first with
        gradients enabled (it runs forward and backward and returns the loss).
        Writes of the updated state go on in the background (write-behind)
        while the next forward and backward run; the next ``step()`` (or
        :meth:`wait`) waits for them first and raises any failure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    def _step(self) -> None:
        self._check_attached()
        self._masters_loaded = frozenset()  # a model load from now on gives new weights (see _remake_masters)
        if self._streamed is not None:
            self._streamed.settle()  # the last step's queue first
        broken = self.offloaded.broken
        if broken is not None and not broken.mendable_by(self):
            raise UnrestorableUpdateError(str(broken))
        if self._streamed is not None and self._streamed.left:
            self._streamed.run_left()  # see [Note: Updates streamed into the next forward]
            self._mended()
            return
        early = self._in_backward.take() if self._in_backward is not None else {}
        self._backwards_failed = self.offloaded.backwards_failed
        t0 = time.perf_counter()  # the training loop waits here for I/O-bound work: stall time
        errors = [f.exception() for f in early.values()]  # waits for the updates started in backward
        # waits for the updates speculated in backward, and keeps those that are the step's
        stood = self._speculated.decide() if self._speculated is not None else set()
        # Applied, they go now, before anything below can raise: a coded one no longer decodes once its update is
        # kept (see [Note: A kept gradient coded against its moments] in _grad_code.py).
        if not self.keep_grads:
            for k in stood:
                self.offloaded.grads.pop(k, None)
        self._progress = ([], 0)
        updated = sum(err is None for err in errors)  # by this step so far
        try:
            previous = self._pipeline.take_previous()
            for h in previous:
                h.wait()
            if early or previous or stood:
                self.store.stats.add_wait(t0, time.perf_counter(), key="optimizer")
            for err in errors:
                if err is not None:
                    raise err
            thawed = [n for n, k, p in self._frozen if self._grad(n, k, p) is not None]
            if thawed:
                raise TierStoreError(self._thawed_message(thawed))
            ready = [(n, k, p, g) for n, k, p in self._items
                     if k not in early and k not in stood and (g := self._grad(n, k, p)) is not None]
            work = [item for item in ready if not self._was_applied(item[0], item[3])]
            updated += len(stood)
            if ready and not work and not early and not stood and self._unfinished is None:
                raise TierStoreError("step() again with the gradients the last step() applied: run backward() first "
                                     "(after zero_grad()); a step applies a gradient once")
            queued: list[Queued] = []
            if self._streamed is not None and self._streamed.open:  # queued once the resident ones are stepped
                work, queued = self._to_queue(work)
            self._progress = (work, 0)
            for i, (name, key, p, grad) in enumerate(work):
                self._pipeline.read_ahead(work, i)
                self._timed_step(name, key, p, grad)
                if not self.keep_grads:  # applied: it goes now, and its room with it
                    if key is not None:
                        self.offloaded.grads.pop(key, None)
                    p.grad = None
                updated += 1
                self._progress = (work, i + 1)
        except BaseException as e:
            self._progress = ([], 0)
            self._pipeline.drop_window()
            if updated and not isinstance(e, UnrestorableUpdateError):
                self._stopped_part_way(updated, e)
            raise
        self._progress = ([], 0)
        self._mended()
        if queued:
            self._streamed.queue(queued)
        else:
            self._pipeline.end_step()

    def _mended(self) -> None:
        """A step finished: the model is one whole step ahead again."""
        if self.offloaded.broken is not None and self.offloaded.broken.mendable_by(self):
            self.offloaded.broken = None
        self._unfinished = None

    def _to_queue(self, work: list[tuple]) -> tuple[list[tuple], list[Queued]]:
        """(the resident parameters of ``work``, which step() steps itself; the updates of the offloaded ones, in
        the order the forward uses them, each with its group's hyper-parameters now): see [Note: Updates streamed
        into the next forward]."""
        order = self.offloaded.forward_order()
        offloaded = [item for item in work if item[1] is not None]
        offloaded.sort(key=lambda item: order.get(item[1], len(order)))  # stable: the unseen keep model order
        return ([item for item in work if item[1] is None],
                [Queued(name, key, p, grad, self.steps.get(name, 0.0) + 1.0, self._hyper(name))
                 for name, key, p, grad in offloaded])

    def _stopped_part_way(self, updated: int, error: BaseException) -> None:
        """An update failed after others succeeded: see [Note: A step that stops part-way]."""
        left = sum(1 for n, k, p in self._items
                   if (g := self._grad(n, k, p)) is not None and not self._was_applied(n, g))
        if not left:
            return
        self._part_way(error, f"step() stopped after updating {updated} parameters, {left} not yet",
                       "it updates the rest with the gradients it kept")

    def _part_way(self, error: BaseException, stopped: str, again: str) -> None:
        """The step stopped part-way (``stopped``: where) on ``error``; ``again``: what step() again does. See
        [Note: A step that stops part-way]."""
        why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__  # Ctrl-C has no text
        self._unfinished = (f"{stopped} ({why}). Call opt.step() again, before anything else: {again}, and the step "
                            f"ends as if it had not failed; until then forward, zero_grad() and checkpoints refuse, "
                            f"since the model is part of a step ahead")
        if self.offloaded.broken is None:
            self.offloaded.broken = BrokenValues(self, self._unfinished, Mend.BY_STEPPING_AGAIN)
        note_interrupt(error, self._unfinished, self.store)

    def _timed_step(self, name: str, key: str | None, p: torch.nn.Parameter, grad: torch.Tensor, *,
                    step: float | None = None, hyper: tuple | None = None, values: torch.Tensor | None = None,
                    watch: Watch | None = None) -> None:
        """One parameter's update through the pipeline (a timeline span when one is recorded), as its group
        stands now unless queued with its own ``step`` count and ``hyper``-parameters; ``values``: the gradient's,
        where the caller holds them (else read from ``grad``); ``watch``: see ``StatePipeline.update``."""
        step = self.steps.get(name, 0.0) + 1.0 if step is None else step
        hyper_of = (lambda: self._hyper(name)) if hyper is None else (lambda: hyper)
        timeline = self.store.timeline
        with timeline.span(f"adamw {name}", "optimizer") if timeline is not None else contextlib.nullcontext():
            try:
                # a stored gradient is read into the host tier for its update; one kept after it stays unchanged
                with (contextlib.nullcontext(values) if values is not None
                      else values_of(grad, keep_stored=self.keep_grads)) as read:
                    self._pipeline.update(name, key, p, read, step, hyper_of, watch)
            except UnrestorableUpdateError as e:  # no later step or forward may use the half-updated values
                self.offloaded.broken = BrokenValues(self, str(e), Mend.NEVER)
                raise
        self.steps[name] = step
        self._applied[name] = (weakref.ref(grad), generation(grad))

    def set_is_last_micro_batch(self, is_last: bool) -> None:
        """Whether the backward passes from now on are a step's last (True, the default: a loop that steps after
        every backward); a loop that accumulates over micro-batches calls it with False before the others and
        True before the last, so that ``speculate`` updates in the last one only (see [Note: The last
        micro-batch]). ``off.accumulate`` says so itself."""
        if not isinstance(is_last, bool):
            raise TierTypeError(f"set_is_last_micro_batch({is_last!r}) takes True or False")
        if self._speculated is not None:
            self._speculated.is_last_micro_batch = is_last

    def wait(self) -> None:
        """Wait for the updates the last step queued (``stream_update=True``) and its write-behind; raises the first
        failure of a write (the data stays in memory)."""
        self.updates_done()
        self._pipeline.wait()

    def updates_done(self) -> None:
        if self._streamed is not None:
            self._streamed.settle()

    def _hyper(self, name: str) -> tuple:
        """(lr, betas, eps, weight_decay, maximize) of the parameter's group now: read once per update, so a scheduler
        changing the group during backward never mixes two learning rates in one update."""
        group = self._group_of[name]
        return tuple(group[k] for k in HYPER)

    def __repr__(self) -> str:
        groups = ", ".join(f"({len(g['params'])} params: " + ", ".join(f"{k}={g[k]}" for k in HYPER) + ")"
                           for g in self.param_groups)
        flag = {"single": "", "foreach": ", foreach=True", "fused": ", fused=True"}[self._pipeline.impl]
        return f"OffloadedAdamW({groups}{flag})"


class OffloadedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for :class:`OffloadedAdamW`: loss scaling for fp16 autocast training.

    Used as the stock scaler is (``scaler.scale(loss).backward()``, optionally
    ``scaler.unscale_(opt)`` before ``off.clip_grad_norm_``, then
    ``scaler.step(opt)`` and ``scaler.update()``), it unscales and checks for
    overflow the gradients where the offloaded model keeps them: the stock
    scaler looks in ``param.grad``, where an offloaded parameter has none, and
    would neither unscale them nor see an overflow. A step with an inf or NaN
    gradient is skipped and the scale lowered, as torch does; the numbers are
    those of ``torch.amp.GradScaler`` on the resident model (tested). It needs
    ``step_in_backward=False``: the scale must be checked before any update.
    """

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        if not isinstance(optimizer, OffloadedAdamW) or not optimizer.offloaded.keeps_grads:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)  # they are in param.grad
        if optimizer.step_in_backward:
            raise TierStoreError("loss scaling needs every gradient checked before any update, but this optimizer "
                                 "steps them during backward: use OffloadedAdamW(..., step_in_backward=False)")
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in optimizer.offloaded.grads_in_order():
            if not allow_fp16 and grad.dtype == torch.float16:
                raise TierValueError("Attempting to unscale FP16 gradients: keep the parameters fp32 and compute in "
                                     "fp16 under torch.autocast")
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), grads in groups.items():
                if device not in found:
                    found[device] = found_inf.to(device, copy=True)
                # A stored gradient is read and written one at a time (the kernel takes each tensor in turn).
                plain = [g for g in grads if store_key_of(g) is None]
                for batch in ([plain] if plain else []) + [[g] for g in grads if store_key_of(g) is not None]:
                    torch._amp_foreach_non_finite_check_and_unscale_(batch, found[device], inv_scale.to(device))
        return found
