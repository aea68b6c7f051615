"""One unit of an offloaded model: what its forward pre-hook fetches and its post-hook lets go, its backward
fetch, and how the model's modules are split into units.

[Note: Units] A unit is what one forward pre-hook fetches and one forward
post-hook releases. By default every module is a unit of the parameters it
owns directly, except instances of ``units`` (``nn.MultiheadAttention`` by
default), which own their whole subtree, as FSDP2's ``fully_shard`` of a
module does. What a forward *reads* is learned on top of that: see
[Note: Reads of an offloaded parameter].

[Note: Backward without module backward hooks] A module full-backward hook
makes torch wrap the module's inputs and outputs in a ``BackwardHookFunction``,
so tensors that were the same object (query, key and value of self-attention)
arrive as distinct tensors: ``nn.MultiheadAttention`` then leaves its packed
in-projection path and its gradients round differently. As FSDP2 does, the
backward fetch is a hook on the forward's output tensors (``register_hook``),
which adds nothing to the graph torch builds.

[Note: Frozen parameters in backward] A parameter that requires no gradient
(a frozen base under LoRA, a frozen backbone) gets no gradient whose
completion would end its backward hold, yet its unit's backward may read it
(the input gradient of ``x @ W.T`` is ``g @ W``). Its hold ends when the
gradient of its unit's input has been computed: every operation of the unit
that led from that input has then run. The hook is on the input tensor
(``register_hook``, nothing added to the graph), and where that tensor is the
output of the unit before it -- the common case: one decoder layer's output
is the next one's input -- the one hook of that tensor (``GradArrival``)
lets the later unit's frozen parameters go before the earlier unit's backward
fetch, so the two are never held at once. A unit called several times, or an
operation that needs a frozen parameter and does not lead from the input
(``x @ (W * s)`` with ``s`` trained), reads it again through its saved view
(see [Note: Saved views of parameters]), which holds it until the backward
ends; a unit whose inputs need no gradient (the first layer under LoRA, whose
embeddings are frozen) keeps its frozen parameters until then too.

[Note: A forward output that is a view of a parameter] A module may return a
view of its own parameter (``self.latents.expand(batch, -1, -1)``, as
Perceiver's latent embeddings do) for a later module to compute with. Once the
module's hold ends, the store reuses that memory, so the later module would
read another tensor's bytes. Such a parameter stays held until the model's
forward returns (the later modules run inside it); a view of a parameter
returned from the model's forward itself (or from a module called on its own)
would outlive every hold, so it raises instead.

[Note: Compiled units] A compiled module is a unit of its whole subtree, so
the compiled code holds no hook: its pre-hook fetches every parameter of it,
the compiled code computes with them as the plain tensors it was traced with
(graph inputs, held for the whole call), and its post-hook lets them go. Both
run outside the compiled code, so the module runs the very graph it runs
resident, and nothing recompiles from step to step: with
``torch.compile(block)`` they are hooks on the ``OptimizedModule`` wrapper,
whose own call runs them before the compiled forward; with
``block.compile()``, whose compiled call runs the module's hooks inside the
compiled code, they wrap that call instead of hooking the module
(``CompiledCall``). The saved-tensor hooks (see [Note: Saved views of
parameters]) are called from inside compiled code when it saves a tensor, so
once torch.compile is in use they are disabled for dynamo
(``torch._dynamo.disable``), which would otherwise compile them, once for each
kind of tensor saved. A module compiled after ``offload_model`` is found when
the next step starts and made a unit then, if it holds no other unit; one that
does (a block whose layers are units) is refused, saying to pass it in
``units=``, and so is an ``nn.TransformerEncoderLayer`` whose forward
``offload_model`` wrapped (see ``HOOK_SHY``): compiled so, it rounded
otherwise than the compiled resident layer on torch 2.14, so it is compiled
before ``offload_model`` or not at all. A unit compiled again after
``offload_model`` (a new compiled call) is wrapped again. A compiled model
root is refused: its whole forward would be one graph over parameters that are
fetched module by module.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from tierstore import Tier, TierStore, TierTypeError, TierValueError
from tierstore.memory import PAGE_BYTES, TierPool

from ._budget import HostBudget
from ._contract import NotCopyable, OffloadedParameterError, note_interrupt
from ._param import ComputeSite, OffloadedParameter, StoredParam, leaves

if TYPE_CHECKING:
    from ._placing import UnitSchedule

DEFAULT_UNITS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, nn.TransformerEncoderLayer,
                                               nn.TransformerDecoderLayer)
# Modules whose forward takes its fused inference path only when no forward hook is attached to it or to any module
# inside it: as units, their forward is wrapped instead of hooked (see [Note: A held parameter is an ordinary one]).
HOOK_SHY: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer,)


class UnitPass(Protocol):
    """What a unit uses of its model's passes (``_pass.PassState``, see [Note: Pass phases])."""

    running: list[tuple[Unit, bool]]
    held_for_outputs: list[StoredParam]
    backward_used: set[str]
    storage_owner: dict[int, StoredParam]

    def enter_forward(self, unit: Unit) -> bool: ...

    def exit_forward(self, unit: Unit) -> None: ...

    def in_backward(self) -> bool: ...

    def queue_end_backward(self) -> None: ...

    def hold_in_backward(self, sp: StoredParam, unit: Unit) -> None: ...

    def backward_hold(self, sp: StoredParam, unit: Unit) -> None: ...

    def viewed_by(self, output: Any) -> list[StoredParam]: ...

    def stopped_by_interrupt(self) -> None: ...


@dataclass(eq=False)
class Unit(NotCopyable):
    """A unit (see [Note: Units]): the parameters its forward holds, its own and those it was seen to read. It is
    given where it computes (``site``), its model's passes and the units' schedule, not the offload they belong
    to."""

    name: str
    params: list[StoredParam]
    nbytes: int
    site: ComputeSite
    passes: UnitPass
    schedule: UnitSchedule
    module: nn.Module | None = None  # whose forward it hooks
    forward_started: list[float] = field(default_factory=list)  # a stack: a module may be re-entered
    backward_started: float | None = None
    hooks: list[Any] = field(default_factory=list)  # handles of its hooks
    shy: bool = False  # its module's forward is wrapped, not hooked (``HOOK_SHY``)

    def hook(self, module: nn.Module, *, shy: bool) -> None:
        """The forward pre- and post-hook on ``module`` (around its forward with ``shy``, around its compiled
        call where it was compiled in place: see [Note: Compiled units])."""
        self.module, self.shy = module, shy
        if compiled(module) == "in place":
            self.hooks = [CompiledCall(module, self.pre_forward, self.post_forward)]
        elif shy:
            self.hooks = [WrappedForward(module, self.passes, self.site.store, self.pre_forward, self.post_forward)]
        else:
            self.hooks = [module.register_forward_pre_hook(self.pre_forward, with_kwargs=True),
                          module.register_forward_hook(self.post_forward, always_call=True)]

    def around_compiled_call(self) -> bool:
        """Whether its hooks are around its module's compiled call as it is now."""
        return any(isinstance(h, CompiledCall) and h.current() for h in self.hooks)

    def unhook(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def learn(self, sp: StoredParam) -> bool:
        """``sp`` was read in this unit's forward: its pre-hook fetches it from now on."""
        if any(q is sp for q in self.params):
            return False
        self.params.append(sp)
        self.nbytes += sp.nbytes
        return True

    def _use(self) -> None:
        if self.params:
            self.schedule.prefetch_after(self, self.site.tier)

    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        passes = self.passes
        in_backward = passes.enter_forward(self)
        self._use()
        for sp in self.params:
            if in_backward:
                passes.hold_in_backward(sp, self)
            else:
                sp.hold(self)
            if in_backward and not sp.backward_hold and torch.is_grad_enabled():
                passes.backward_hold(sp, self)  # a forward rerun inside backward (checkpointing)
        if torch.is_grad_enabled() and any(not sp.param.requires_grad for sp in self.params):
            self._let_frozen_go_after_backward((args, kwargs))
        if self.site.store.timeline is not None:
            self.forward_started.append(time.perf_counter())

    def _let_frozen_go_after_backward(self, inputs: Any) -> None:
        """See [Note: Frozen parameters in backward]: once the gradients of this call's inputs are computed, its
        backward is done with the frozen parameters it holds."""
        needing = list({id(t): t for t in leaves(inputs, torch.Tensor) if t.requires_grad}.values())
        if len(needing) == 1:
            GradArrival.on(needing[0]).done_with.append(self)
        elif needing:
            torch.autograd.graph.register_multi_grad_hook(needing, self.backward_done_with_frozen)

    def backward_done_with_frozen(self, *_: Any) -> None:
        for sp in self.params:
            if sp.backward_hold and not sp.param.requires_grad:
                sp.backward_hold = False
                sp.unhold()
        self.backward_done()

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        passes = self.passes
        viewed = passes.viewed_by(output) if passes.storage_owner and not passes.in_backward() else []
        outermost = bool(passes.running) and passes.running[0][0] is self
        for sp in self.params:
            if sp.holds:
                if sp in viewed and not outermost:
                    passes.held_for_outputs.append(sp)
                else:
                    sp.unhold()
        if self.params and torch.is_grad_enabled() and not passes.in_backward():
            for t in leaves(output, torch.Tensor):
                if t.requires_grad:
                    GradArrival.on(t).starting.append(self)
        passes.exit_forward(self)
        timeline = self.site.store.timeline
        if timeline is not None and self.forward_started:
            timeline.add(f"forward {self.name or '<root>'}", "compute", self.forward_started.pop(),
                         time.perf_counter())
        if viewed and outermost:  # its holds are let go above: nothing is left held by the raise
            name = self.name or "the model"
            raise OffloadedParameterError(
                f"the forward of {name} returned a view of the offloaded parameter {viewed[0].name!r}; its memory is "
                f"reused once that forward returns, so the view would read other values. Return a copy "
                f"(.clone()), or call {name} inside the forward of a module that computes with its output")

    def pre_backward(self, grad: torch.Tensor) -> None:
        """A hook on a forward output of this unit: its gradient is about to be computed, so the unit's
        backward is next (see [Note: Backward without module backward hooks])."""
        passes = self.passes
        if self.name in passes.backward_used:
            return
        passes.queue_end_backward()
        if not passes.backward_used:
            self.schedule.backward_starts()
        passes.backward_used.add(self.name)
        self._use()
        for sp in self.params:
            if not sp.backward_hold:
                passes.backward_hold(sp, self)
        if self.site.store.timeline is not None:
            self.backward_started = time.perf_counter()

    def backward_done(self) -> None:
        """A gradient of this unit is complete: its backward ends with its last one (on the timeline)."""
        timeline = self.site.store.timeline
        if (timeline is not None and self.backward_started is not None
                and not any(p.backward_hold for p in self.params)):
            timeline.add(f"backward {self.name or '<root>'}", "compute", self.backward_started,
                         time.perf_counter())
            self.backward_started = None


class GradArrival:
    """The one hook on a tensor that units' forwards gave or were given: when its gradient arrives, the units
    that took it as their input are done with their frozen parameters, then the units that returned it start their
    backward (see [Note: Frozen parameters in backward])."""

    def __init__(self) -> None:
        self.done_with: list[Unit] = []
        self.starting: list[Unit] = []

    @staticmethod
    def on(t: torch.Tensor) -> GradArrival:
        """The hook of ``t``, registered at the first ask (an activation's is new each forward; a leaf that a
        forward returns or takes lives on, and gets a hook each time)."""
        arrival = getattr(t, "_tierstore_arrival", None) if t.grad_fn is not None else None
        if arrival is None:
            arrival = GradArrival()
            t.register_hook(arrival)
            if t.grad_fn is not None:
                setattr(t, "_tierstore_arrival", arrival)  # an attribute of our own on torch's tensor
        return arrival

    def __call__(self, grad: torch.Tensor) -> None:
        for unit in self.done_with:
            unit.backward_done_with_frozen()
        for unit in self.starting:
            unit.pre_backward(grad)


class WrappedForward(NotCopyable):
    """A unit's pre- and post-forward around its module's ``forward`` instead of as hooks (for ``HOOK_SHY``
    modules), or without them the model's forward, which clears a pass stopped by Ctrl-C (see [Note: A forward
    stopped by Ctrl-C]); ``remove()`` undoes it, as a hook's handle does."""

    def __init__(self, module: nn.Module, passes: UnitPass, store: TierStore, pre: Callable[..., Any] | None = None,
                 post: Callable[..., Any] | None = None) -> None:
        self.module, self.previous = module, module.__dict__.get("forward")
        forward = module.forward

        @functools.wraps(forward)
        def held_forward(*args: Any, **kwargs: Any) -> Any:
            if pre is not None:
                pre(module, args, kwargs)
            output = None
            try:
                output = forward(*args, **kwargs)
            except BaseException as e:
                if pre is None and not isinstance(e, Exception):  # the model's own: a unit's ends in finally
                    passes.stopped_by_interrupt()
                    note_interrupt(e, "the offloaded model's forward was stopped; what it held was let go, and the "
                                      "next forward trains on (call opt.zero_grad() first to drop this step's part)",
                                   store)
                raise
            finally:
                if post is not None:
                    post(module, args, output)
            return output

        module.forward = held_forward

    def remove(self) -> None:
        if self.previous is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.previous


class CompiledCall:
    """A unit's pre- and post-forward around its module's compiled call (``module.compile()`` makes one, which
    runs the module's hooks inside compiled code): they run outside it, as a hook on a ``torch.compile`` wrapper
    does (see [Note: Compiled units]); ``remove()`` undoes it, as a hook's handle does."""

    def __init__(self, module: nn.Module, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self.module, self.compiled = module, module._compiled_call_impl
        compiled_call = self.compiled

        def held_call(*args: Any, **kwargs: Any) -> Any:
            pre(module, args, kwargs)
            output = None
            try:
                output = compiled_call(*args, **kwargs)
            finally:
                post(module, args, output)
            return output

        self.held_call = module._compiled_call_impl = held_call

    def current(self) -> bool:
        """Whether the module's compiled call is still the one this wraps (``compile()`` again replaces it)."""
        return self.module._compiled_call_impl is self.held_call

    def remove(self) -> None:
        if self.current():
            self.module._compiled_call_impl = self.compiled


def present_ordinary(params: list[StoredParam], start: bool, module: nn.Module, *_: Any) -> None:
    """A forward pre-hook (``start``) and post-hook of an ``nn.TransformerEncoder`` whose first layer is a wrapped
    unit (see [Note: A held parameter is an ordinary one])."""
    for sp in params:
        if not sp.holds:
            sp.param.__class__ = sp.original_class if start else OffloadedParameter


def unit_modules(model: nn.Module, units: Sequence[type[nn.Module] | nn.Module | str]) -> dict[str, bool]:
    """Module name -> True for a unit's root, False for a module inside a unit (see [Note: Units])."""
    classes, ids, names = [], set(), set()
    modules = dict(model.named_modules())
    for u in units:
        if isinstance(u, type) and issubclass(u, nn.Module):
            classes.append(u)
        elif isinstance(u, nn.Module):
            if not any(m is u for m in modules.values()):
                raise TierValueError(f"units: the {type(u).__name__} given is not a module of this model")
            ids.add(id(u))
        elif isinstance(u, str):
            if u not in modules:
                raise TierValueError(f"units: the model has no module named {u!r} (names as in model.named_modules())")
            names.add(u)
        else:
            raise TierTypeError(f"units: each unit is an nn.Module class, a module of the model or a module name, "
                                f"not {type(u).__name__}")
    out: dict[str, bool] = {}
    inside: list[str] = []
    for mname, module in modules.items():
        if any(p == "" or mname.startswith(p + ".") for p in inside):
            out[mname] = False
        elif isinstance(module, tuple(classes)) or id(module) in ids or mname in names or compiled(module):
            out[mname] = True  # a compiled module is a unit: see [Note: Compiled units]
            inside.append(mname)
    return out


def compiled(module: nn.Module) -> str | None:
    """How ``module`` was compiled: ``"in place"`` (``module.compile()``: its hooks run inside the compiled
    code), ``"wrapped"`` (``torch.compile(module)``: an ``OptimizedModule``, whose own hooks run outside), or
    None."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "in place"
    frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded by any torch.compile: nothing is imported here
    if frame is not None and isinstance(module, frame.OptimizedModule):
        return "wrapped"
    return None


def eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, called from inside compiled code, run eagerly by dynamo (see [Note: Compiled units])."""
    return torch._dynamo.disable(hook, recursive=True)


def refuse_whole_model(model: nn.Module) -> None:
    """A compiled root: every parameter of the model would be fetched at once, and traced unheld (see [Note:
    Compiled units])."""
    if compiled(model):
        raise OffloadedParameterError(WHOLE_MODEL)


WHOLE_MODEL = ("torch.compile of a whole offloaded model is not supported: its parameters are fetched unit by unit "
               "as its modules run, outside any compiled code. Compile its units instead, as FSDP2 users compile "
               "each block: block.compile() (or torch.compile(block)) for each transformer block, before or after "
               "offload_model; a compiled module is fetched as one unit")


def plan_units(model: nn.Module, units: Sequence[type[nn.Module] | nn.Module | str], resident_threshold_bytes: int,
               store: TierStore, compute_tier: Tier) -> tuple[dict[int, tuple[str, int]], dict[str, tuple]]:
    """(id -> (name, bytes) of each parameter to offload, unit name -> (module, ids it holds)); a unit that
    cannot fit the compute tier is an error here, before anything is written."""
    offloaded: dict[int, tuple[str, int]] = {}
    for name, p in model.named_parameters():  # shared parameters appear once
        nbytes = p.numel() * p.element_size()
        if nbytes >= resident_threshold_bytes:
            offloaded[id(p)] = (name, nbytes)
    roots = unit_modules(model, units)
    owned_by = {}
    for mname, module in model.named_modules():
        if roots.get(mname) is False:
            continue  # inside a unit: its unit holds its parameters
        tensors = module.parameters() if roots.get(mname) else module._parameters.values()
        ids = dict.fromkeys(id(p) for p in tensors if p is not None and id(p) in offloaded)
        owned_by[mname] = (module, list(ids))
    budget = HostBudget(store).compute_tier_bytes(compute_tier)
    for mname, (_, ids) in owned_by.items():
        need = sum(TierPool.capacity_for(offloaded[i][1]) for i in ids)  # whole pages, as the pool hands out
        if need > budget:
            raise TierValueError(
                f"unit {mname or '<root>'!r} holds {need} bytes ({need / 2**20:.2f} MiB, each parameter in whole "
                f"{PAGE_BYTES // 1024} KiB pages) of parameters at once, "
                f"more than the {compute_tier.label} budget ({budget} bytes) it computes in: raise "
                f"{compute_tier.label}_budget_bytes, or split the unit (units=... names the modules whose "
                f"whole subtree is fetched at once)")
    return offloaded, owned_by
