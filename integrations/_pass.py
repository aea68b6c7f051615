"""The state of a pass of an offloaded model: which forward or backward runs, on which thread, what it holds.

[Note: Pass phases] A pass is in one :class:`Phase`: ``IDLE`` (no forward or
backward of the model runs), ``FORWARD`` (the model's forward runs on
``forward_thread``, ``forward_depth`` calls deep) or ``BACKWARD`` (a backward
that held parameters runs; the callback that ends it is queued). A backward
may run inside a forward (``torch.autograd.grad`` of a gradient penalty):
it ends back in ``FORWARD``. A forward run by a backward (checkpointing,
on autograd's own threads) belongs to that backward. The phase decides who
may start a forward (see [Note: One pass at a time]) and what a read of an
unheld parameter fetches for.

[Note: Saved views of parameters] Autograd saves some tensors that alias a
parameter's storage -- ``F.linear`` saves ``weight.t()``, a view -- and a
view keeps the storage the parameter had in forward, not the one it gets back
for backward. Since the store reuses device buffers, such a view would read
another tensor's bytes in backward. So while a forward of the model (or of
any of its modules, called on its own) runs, saved-tensor hooks replace every
saved tensor that aliases a held parameter by (parameter, size, stride,
offset), rebuilt in backward from the parameter's current copy (held on
demand). Inside backward (a checkpointed forward rerun) the saved views are
kept by checkpointing itself, so a module rerun there keeps its parameters
held until their gradients are accumulated.

[Note: One pass at a time] Forward and backward share the holds, the
running units and the step's trace: two threads running the model at
once would release each other's parameters (a crash, or values from
another tensor's memory). A forward started while another thread is in
the model's forward, or in its backward, raises instead. A forward run
by a backward (checkpointing, on autograd's own threads) is part of
that pass. (A thread whose backward raised counts as in backward until
it runs the model again.)

[Note: A forward stopped by Ctrl-C] torch runs a module's always-call
forward hooks when its forward raises an Exception, not a BaseException
that is none (KeyboardInterrupt: Ctrl-C in a notebook, SystemExit), so
such a forward would leave its units on the running stack (reads after
it would be taken for reads inside a forward), its saved-tensor hooks
pushed, its parameters held and its pass counted (other threads refused
for good). The model's forward is wrapped to clear all of that as it
propagates; a forward rerun inside backward is left to the backward's
own settling.
"""

from __future__ import annotations

import enum
import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from tierstore import TierBudgetError

from ._contract import NotCopyable, OffloadedParameterError
from ._param import ComputeSite, StoredParam, call_weakly, leaves
from ._unit import WHOLE_MODEL, eager

if TYPE_CHECKING:
    from ._contract import Consumers, KeptGradients
    from ._placing import StepStarts, UnitSchedule
    from ._unit import Unit


class Phase(enum.Enum):
    """See [Note: Pass phases]."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, eq=False)
class _SavedView:
    """A saved tensor that aliased a held parameter, as its geometry (see [Note: Saved views of parameters])."""

    param: StoredParam
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset relative to the parameter's own


def _graph_task() -> bool:
    """Whether this thread runs inside autograd's engine now (a backward, or a forward it reruns)."""
    return torch._C._current_graph_task_id() != -1


class PassState(NotCopyable):
    """The forward and backward passes of one offloaded model (see [Note: Pass phases])."""

    def __init__(self, params: dict[int, StoredParam], site: ComputeSite, schedule: UnitSchedule,
                 consumers: Consumers, grads: KeptGradients, handles: list[Any], steps: StepStarts) -> None:
        """Of one model: its parameters' records (``params``, filled as it is built), where they compute, the
        units' schedule, its consumers (a gradient goes to them or is kept in ``grads``), the list of hook handles
        its offload removes, and which forwards start a step."""
        self.params = params
        self.site = site
        self.schedule = schedule
        self.consumers = consumers
        self.grads = grads
        self._handles = handles
        self._steps = steps
        self.backwards_failed = 0  # backward passes that raised (an optimizer stepping in backward asks)
        self.phase = Phase.IDLE
        self.forward_thread: int | None = None
        self.forward_depth = 0
        self.backward_thread: int | None = None
        # Units whose forward is running, innermost last, each with whether it started inside backward.
        self.running: list[tuple[Unit, bool]] = []
        # Parameters a unit's forward output is a view of, held until the model's forward returns (see [Note: A
        # forward output that is a view of a parameter]).
        self.held_for_outputs: list[StoredParam] = []
        self.backward_used: set[str] = set()  # the units whose backward fetch this backward has made
        self.storage_owner: dict[int, StoredParam] = {}  # data_ptr of a held copy's storage -> its parameter
        self._saved_hooks: Any = None
        self._saved_hooks_thread = 0
        self._stale_hooks: dict[int, Any] = {}  # thread -> hooks a stopped pass left pushed there (see clear)
        self._eager_hooks: tuple[Any, Any] = (None, None)  # _pack and _unpack disabled for dynamo, once made
        self._unhooked: list[StoredParam] | None = None  # gradients not yet taken as they complete (frozen ones)
        # Threads whose forwards are one pass: a layer-major step's micro-batches, which take turns (see [Note: A
        # layer-major step] in _layer_major.py); anything with ``in``, filled by the step.
        self.group: Any = {}

    # ---- phases ---------------------------------------------------------------------------
    def in_backward(self) -> bool:
        return self.phase is Phase.BACKWARD or _graph_task()

    def queue_end_backward(self) -> None:
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
            self.backward_thread = threading.get_ident()
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def one_pass_at_a_time(self) -> None:
        """A forward may start now: see [Note: One pass at a time]."""
        if _graph_task():
            return
        me = threading.get_ident()
        if self.forward_thread not in (None, me) and not (me in self.group and self.forward_thread in self.group):
            other, doing = self.forward_thread, "forward"
        elif self.phase is Phase.BACKWARD and self.backward_thread not in (None, me):
            other, doing = self.backward_thread, "backward"
        else:
            self.forward_thread = me
            self.forward_depth += 1
            if self.phase is Phase.IDLE:
                self.phase = Phase.FORWARD
            return
        names = {t.ident: t.name for t in threading.enumerate()}
        raise OffloadedParameterError(
            f"the offloaded model was called from thread {names.get(me, me)!r} while thread "
            f"{names.get(other, other)!r} is in its {doing}: an offloaded model runs one forward or backward at a "
            f"time (its parameters are fetched into memory the running pass holds). Serialize the calls (a "
            f"threading.Lock around the forward and backward), or give each thread its own model")

    def end_pass(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The model's forward returned (or raised): see [Note: One pass at a time]."""
        me = threading.get_ident()
        if (self.forward_thread == me or me in self.group) and not _graph_task():
            self.forward_depth -= 1
            if not self.forward_depth:
                self._forward_ended()

    def thread_part(self) -> tuple[Any, ...]:
        """What of the pass belongs to the thread running now: its running units, the parameters held for its
        outputs, its saved-tensor hooks (pushed on its own stack). A layer-major step's threads take turns and
        swap it in and out with :meth:`set_thread_part`."""
        return self.running, self.held_for_outputs, self._saved_hooks, self._saved_hooks_thread

    def set_thread_part(self, part: tuple[Any, ...] = ([], [], None, 0)) -> None:
        self.running, self.held_for_outputs, self._saved_hooks, self._saved_hooks_thread = part

    def end_group(self) -> None:
        """The threads of ``group`` have all ended (a layer-major step's micro-batches, done or stopped): the
        forward they were one pass of is over."""
        if self.forward_thread is not None and self.forward_thread in self.group:
            self._forward_ended()
        self.group = {}
        self.set_thread_part()

    def joined(self) -> bool:
        """Whether the forward starting on this thread joins a pass a thread of its group began (see ``group``)."""
        return threading.get_ident() in self.group and self.forward_depth > 1

    def _forward_ended(self) -> None:
        self.forward_thread, self.forward_depth = None, 0
        if self.phase is Phase.FORWARD:
            self.phase = Phase.IDLE

    def stopped_by_interrupt(self) -> None:
        """The model's forward was stopped by a BaseException: see [Note: A forward stopped by Ctrl-C]."""
        if _graph_task():
            return
        self.settle_failed_backward()
        self.clear()
        if self.forward_thread == threading.get_ident():
            self._forward_ended()

    def clear(self) -> None:
        """Let go of what a pass left that no hook ended: its running units (a module called on its own and
        stopped by Ctrl-C leaves them too: the model's next forward clears them), its saved-tensor hooks (popped
        from their thread's stack when that thread next runs the model: the interrupted one is the main thread,
        and the next forward may come from another), its holds."""
        self.running.clear()
        hooks, self._saved_hooks = self._saved_hooks, None
        if hooks is not None:  # pushed on its thread's stack of hooks: only that thread can pop them
            self._stale_hooks[self._saved_hooks_thread] = hooks
        me = threading.get_ident()
        if me in self._stale_hooks:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is not None and top[0] in (self._pack, self._eager_hooks[0]):  # or another context popped it
                self._stale_hooks[me].__exit__(None, None, None)
            del self._stale_hooks[me]
        self.release_all()

    # ---- a unit's forward -------------------------------------------------------------------
    def enter_forward(self, unit: Unit) -> bool:
        """Push ``unit`` on the running units; True when the forward runs inside backward."""
        # Traced by dynamo, or run eagerly inside a compiled region (where dynamo falls back to eager on this
        # hook's raise): either way parameters would be traced as graph constants or inputs, not fetched. A
        # compiled unit's hooks run outside its compiled code (see [Note: Compiled units]), so this is a whole
        # model compiled after offload_model.
        if torch.compiler.is_compiling() or torch._C._dynamo.eval_frame.get_eval_frame_callback():
            raise OffloadedParameterError(f"{WHOLE_MODEL} ({unit.name or 'the root'} ran inside compiled code)")
        in_backward = self.in_backward()
        if not self.running and not in_backward and torch.is_grad_enabled() and self._saved_hooks is None:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(*self._saved_tensor_hooks())
            self._saved_hooks.__enter__()
            self._saved_hooks_thread = threading.get_ident()
        self.running.append((unit, in_backward))
        return in_backward

    def exit_forward(self, unit: Unit) -> None:
        at = next((i for i in range(len(self.running) - 1, -1, -1) if self.running[i][0] is unit), None)
        if at is not None:  # not at the top when a forward that raised inside an inner module left it there
            del self.running[at:]
        if not self.running:
            held, self.held_for_outputs = self.held_for_outputs, []
            for sp in held:
                if sp.holds:
                    sp.unhold()
        if not self.running and self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)

    def _saved_tensor_hooks(self) -> tuple[Any, Any]:
        """(pack, unpack) for saved tensors. Once torch.compile is in use they are disabled for dynamo: a compiled
        unit's forward saves its tensors from inside compiled code, where dynamo would compile them too, once for
        each kind of tensor saved (see [Note: Compiled units])."""
        if "torch._dynamo" not in sys.modules:
            return self._pack, self._unpack
        if self._eager_hooks[0] is None:
            self._eager_hooks = (eager(self._pack), eager(self._unpack))
        return self._eager_hooks

    def viewed_by(self, output: Any) -> list[StoredParam]:
        """The held parameters that a tensor of ``output`` is a view of (see [Note: A forward output that is a
        view of a parameter])."""
        viewed = []
        for t in leaves(output, torch.Tensor):
            sp = self._held_param_of(t)
            if sp is not None and t is not sp.param and sp not in viewed:
                viewed.append(sp)
        return viewed

    def _held_param_of(self, t: torch.Tensor) -> StoredParam | None:
        """The held parameter whose memory ``t`` is (a view of), or None."""
        if not self.storage_owner or t.layout is not torch.strided:
            return None
        return self.storage_owner.get(t.untyped_storage().data_ptr())

    def _pack(self, t: torch.Tensor) -> Any:
        if self._saved_hooks is None:  # left pushed by a pass stopped by Ctrl-C in a thread that did not clear it
            return t
        sp = self._held_param_of(t)
        if sp is None:
            return t
        if t.dtype != sp.param.dtype:
            return t.clone()  # a reinterpreting view: keep its bytes
        return _SavedView(sp, tuple(t.size()), tuple(t.stride()), t.storage_offset() - sp.param.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedView):
            return saved
        sp = saved.param
        if not sp.backward_hold:  # used in backward before its unit's backward fetch
            self.backward_hold(sp, self.schedule.unit_of(sp))
        data = sp.param.data
        return data.as_strided(saved.size, saved.stride, data.storage_offset() + saved.offset)

    def fetch_on_demand(self, sp: StoredParam) -> bool:
        """Hold ``sp`` for a read that its units' hooks did not foresee (see [Note: Reads of an offloaded
        parameter]); False when no forward or backward of the model is running to hold it for."""
        if self.running:
            unit = self.running[-1][0]
            if unit.learn(sp):  # held from now on by this unit's pre-hook, released by its post-hook
                self.schedule.learned(unit, sp)
            sp.hold(unit)  # the unit's post-hook releases it, as it does its own
            if self.in_backward() and torch.is_grad_enabled() and not sp.backward_hold:
                self.backward_hold(sp, unit)
            return True
        if self.in_backward():
            self.backward_hold(sp, self.schedule.unit_of(sp))
            return True
        return False

    # ---- backward ---------------------------------------------------------------------------
    def backward_hold(self, sp: StoredParam, unit: Unit) -> None:
        self.queue_end_backward()
        self.hold_in_backward(sp, unit)
        sp.backward_hold = True

    def hold_in_backward(self, sp: StoredParam, unit: Unit) -> None:
        """A hold in backward, whose budget error says why backward holds what it does."""
        try:
            sp.hold(unit)
        except TierBudgetError as e:
            total = sum(q.nbytes for q in self.params.values())
            raise TierBudgetError(f"{e}. {_backward_holds(total, self.site.tier.label)}") from e

    def hook_gradients(self) -> None:
        """Take each trainable parameter's gradient as it completes; also of one unfrozen since the last step
        (a frozen parameter cannot have the hook, and its gradient would otherwise stay unseen in ``.grad``)."""
        still = []
        for sp in list(self.params.values()) if self._unhooked is None else self._unhooked:
            if sp.param.requires_grad:
                self._handles.append(sp.param.register_post_accumulate_grad_hook(
                    partial(call_weakly, weakref.WeakMethod(self._grad_accumulated), weakref.ref(sp))))
            else:
                still.append(sp)
        self._unhooked = still

    def _grad_accumulated(self, sp: StoredParam, param: torch.Tensor) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            grad = param.grad
            param.grad = None
        had = grad is not None
        if grad is not None:  # it leaves the compute tier as soon as it is complete
            if self.consumers.takes_part(sp.key, grad):  # see [Note: Tied parameters layer by layer]
                pass
            elif self.consumers.consumes_grads():  # an optimizer steps it now (see [Note: Stepping in backward])
                self.grads.hand_over(sp.key, grad)
            else:  # see [Note: Gradients in the tiers]
                self.grads.accumulate(sp.key, grad, sp.param.dtype)
            del grad
        if sp.backward_hold:
            sp.backward_hold = False
            sp.unhold()
        self.schedule.unit_of(sp).backward_done()
        if had:
            self.consumers.grad_ready(sp.key)

    def settle_failed_backward(self) -> None:
        """Release what a backward that raised still holds (the callback that ends a backward runs only when
        it completes)."""
        if self.phase is Phase.BACKWARD and not _graph_task():
            self.backwards_failed += 1
            self.end_backward()

    def end_backward(self) -> None:
        """Release every hold backward left.

        Besides parameters that got no gradient, non-reentrant checkpointing
        stops its forward rerun as soon as the tensors backward needs exist, so
        the forward post-hooks of the last modules of a rerun never fire. A
        backward may also run inside a forward (``torch.autograd.grad`` of a
        gradient penalty): the units whose forward runs on around it keep
        holding their parameters, one hold each, as their pre-hooks took them.
        """
        assert self.phase is Phase.BACKWARD, self.phase
        self.phase = Phase.FORWARD if self.forward_thread is not None else Phase.IDLE
        self.backward_thread = None
        self._steps.backward()
        self.backward_used.clear()
        self.running = [(unit, rerun) for unit, rerun in self.running if not rerun]
        outer = Counter(id(sp) for unit, _ in self.running for sp in unit.params)
        outer.update(id(sp) for sp in self.held_for_outputs)
        for sp in self.params.values():
            sp.backward_hold = False
            keep = outer[id(sp)]
            if sp.holds > keep:
                sp.holds = keep + 1
                sp.unhold()

    def release_all(self) -> None:
        self.held_for_outputs.clear()
        for sp in self.params.values():
            sp.release()


def _backward_holds(total: int, tier: str) -> str:
    """Why backward holds what it holds: said when a hold in backward goes over the compute tier's budget."""
    return (
        f"In backward each offloaded parameter is held from its unit's backward until its gradient is "
        f"complete; a forward rerun there (activation checkpointing) holds its whole segment's parameters "
        f"until their gradients are complete, beside what backward holds (checkpoint smaller segments: "
        f"a layer each); when one loss sums several forwards of the model (two views of a batch, a siamese "
        f"pair), or a forward calls one module several times (a layer shared across depth, as ALBERT's), "
        f"a gradient is complete only when the backward of the earliest use reaches it, a "
        f"gradient differentiated again (create_graph=True: a gradient penalty) uses every parameter in "
        f"the second backward, and torch.autograd.grad(loss, parameters) accumulates no .grad, so each "
        f"parameter is held until that backward ends: up to every parameter ({total / 2**20:.1f} MiB) is "
        f"held at once. Call backward() on each forward's loss instead (gradients accumulate; step once), "
        f"or raise the {tier} budget above that")
