"""Single-process model offload: parameters live in a TierStore and are fetched
just in time for the forward and the backward of each unit of the model.

The offloaded model is split by level, as FSDP2 splits itself:

- ``_param.py``: one parameter (``StoredParam``): the class an offloaded
  parameter has, what its reads and writes do, its holds;
- ``_unit.py``: one unit (``Unit``): its forward pre- and post-hook, its
  backward fetch, and how a model is split into units;
- ``_pass.py``: the state of a pass (``PassState``): one pass at a time,
  threads, Ctrl-C, saved-tensor hooks, fetch on demand, the end of backward,
  gradients as they complete;
- ``_build.py``: construction: the parameters given to the store, a meta
  model materialized on the way;
- here: :class:`OffloadedModel` (the public API) and :func:`offload_model`.

What it shares with ``FSDPOffload`` (the schedule, the placement, the
contract an optimizer and a checkpoint use) is ``_base.OffloadBase``.

[Note: Loading a state dict] ``model.load_state_dict()`` copies each value into its parameter with
``param.copy_(value)``. Before a module's own parameters are loaded, those that are offloaded and named in
the state dict are held, so the copy writes the held copy; after the module's subtree is loaded they are
marked changed and let go (``_after_load``, also when a submodule alone is loaded), to be written home.
An ``OffloadedAdamW`` of the model then remakes the fp32 masters of those whose values changed from the
loaded values (its consumer's ``loaded``), as a new optimizer would; its moments stay, as a torch optimizer's do
when the model it steps loads a state dict (transformers' Trainer, resuming, loads the model, then the
optimizer's state). A parameter given the value it has keeps its master: torch.distributed.checkpoint's
``set_state_dict`` loads the optimizer's state (masters included) first and the model's after it, and a master
remade then would lose what the weight's rounding dropped. Not with ``assign=True``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tierstore import Tier, TierStore, TierStoreError, TierTypeError, TierValueError
from tierstore.memory import TierPool, give_back_pages

from ._base import STATE_KEY, OffloadBase, OffloadedParameterError, UnitStats, check_not_offloaded, same_values
from ._build import ParamBuilder, to_compute_device
from ._contract import zero_grads
from ._grads import GradientStore, check_grad_dtype, grad_key
from ._layer_major import run_layer_major
from ._meta import check_meta
from ._param import ComputeSite, OffloadedParameter, StoredParam, placeholder_of, refuse_other_optimizers_from_now
from ._pass import PassState
from ._placing import check_options
from .policies import ParamOffloadPolicy
from ._unit import (
    DEFAULT_UNITS,
    HOOK_SHY,
    WHOLE_MODEL,
    Unit,
    WrappedForward,
    compiled,
    plan_units,
    present_ordinary,
    refuse_whole_model,
    unit_modules,
)


@dataclass
class OffloadStats(UnitStats):
    """What the hooks did since the offload began (the store keeps its own counters)."""

    reads_learned: int = 0  # parameters a unit was seen to read that it does not own (see [Note: Units])
    layer_major_steps: int = 0
    """Steps ``off.accumulate`` ran layer by layer (see [Note: A layer-major step])."""
    loop_steps: int = 0
    """Steps ``off.accumulate`` ran as the loop, one micro-batch after another (``off.layer_major_refused`` says
    why)."""


def _kept_grads_of(params: dict[int, StoredParam], grads: GradientStore) -> Callable[[str], tuple[str, int] | None]:
    """What the placement asks of the gradients (see [Note: Gradients in the tiers]): the store key and bytes of the
    gradient kept for a parameter's store key, or None for a key that is no parameter's. A function of these two
    alone, so that the placement holds no level above it."""
    by_key = {sp.key: sp for sp in params.values()}

    def grad_of(param_key: str) -> tuple[str, int] | None:
        sp = by_key.get(param_key)
        if sp is None:
            return None
        return grad_key(param_key), TierPool.capacity_for(sp.param.numel() * grads.dtype_of(sp.param).itemsize)

    return grad_of


class OffloadedModel(OffloadBase):
    """The offload state of one module; returned by :func:`offload_model` and kept on the module."""

    prefix = "param/"
    streams_updates = True
    speculates = True  # see [Note: Speculated updates]

    def __init__(self, model: nn.Module, store: TierStore, *, prefetch_depth: int | str, prefetch_bytes: int | None,
                 resident_threshold_bytes: int, home: Tier, compute_tier: Tier,
                 units: Sequence[type[nn.Module] | nn.Module | str],
                 init_fn: Callable[[nn.Module], None] | None = None, placement: bool = True,
                 real_parameters: str | None = None, grad_tier: Tier | None = None,
                 grad_dtype: str = "float32") -> None:
        super().__init__(model, store, home, OffloadStats())
        self.compute_tier = compute_tier
        self.compute_device = store.device if compute_tier is Tier.DEVICE else torch.device("cpu")
        self.resident_ids: set[int] = set()
        self.grads = GradientStore(store, grad_tier, grad_dtype)  # see [Note: Gradients in the tiers]
        self._handles: list[Any] = []
        # held by a load_state_dict(), each with the value it is given and whether that changes it (see [Note:
        # Loading a state dict])
        self._loading: list[tuple[StoredParam, Any, bool]] = []
        self._installed: dict[str, Any] = {}  # methods made ours by the adapters (see add_model_methods)
        self._unread = False  # state_dict() leaves offloaded values unread (see state_dict_unread)
        # Why off.accumulate runs the micro-batches as the loop (None: layer by layer, or not asked yet).
        self.layer_major_refused: str | None = None
        # The levels below are each given what they use (see docs/code-map.md), never this front.
        self.site = ComputeSite(store, compute_tier, self.compute_device)
        self.pass_state = PassState(self.params, self.site, self.schedule, self.pass_consumers, self.grads,
                                    self._handles, self._steps)
        meta = check_meta(model, init_fn, real_parameters)
        plan = partial(plan_units, model, units, resident_threshold_bytes, store, compute_tier)
        offloaded, owned_by = plan()  # checked before any write
        builder = ParamBuilder(store, home, self.prefix, self._record, resident_threshold_bytes, params=self.params,
                               resident=self.resident, resident_ids=self.resident_ids)
        builder.check_names_free(offloaded)
        builder.room_for(offloaded)
        builder.put_parameters(model, meta, init_fn, real_parameters)
        if meta:  # the parameters are new objects: what the units hold is known by them now
            offloaded, owned_by = plan()
        for sp in self.params.values():
            sp.param.data = sp.placeholder
            sp.param.__class__ = OffloadedParameter
            setattr(sp.param, "_tierstore", sp)  # read by OffloadedParameter's handlers (see _param.py)
        to_compute_device(model, self.resident.values(), self.compute_device)
        self._hook_units(units, owned_by)
        self.pass_state.hook_gradients()
        self._hook_state_dicts()
        self._installed = {name: method for provider in _MODEL_METHODS
                           for name, method in provider(model, self).items()}
        for name, method in self._installed.items():
            setattr(model, name, method)
        # Until a step has been recorded, guess that forward uses the units in definition order and backward in
        # the reverse (a wrong guess departs from the trace: the rest of that step fetches on demand).
        forward = [u.name for u in self._units.values() if u.params]
        self._schedule(prefetch_depth=prefetch_depth, prefetch_bytes=prefetch_bytes, placement=placement,
                       trace=forward + forward[::-1], forward_uses=len(forward),
                       grad_of=_kept_grads_of(self.params, self.grads))
        refuse_other_optimizers_from_now()

    # ---- construction ------------------------------------------------------------------
    def _hook_units(self, units: Sequence[type[nn.Module] | nn.Module | str], owned_by: dict[str, tuple]) -> None:
        """Each unit's forward pre- and post-hook (or its wrapped forward), and the model's own."""
        wrapped = set()
        roots = unit_modules(self.model, units)
        # The modules given as units, in definition order: a layer-major step's segments (see [Note: A layer-major
        # step]).
        self.unit_roots = [m for n, m in self.model.named_modules() if roots.get(n) and n]
        for mname, (module, ids) in owned_by.items():
            owned = [self.params[i] for i in ids]
            unit = self._units[mname] = Unit(mname, owned, sum(sp.nbytes for sp in owned), self.site,
                                             self.pass_state, self.schedule)
            unit.hook(module, shy=bool(isinstance(module, HOOK_SHY) and mname and roots.get(mname)))
            if unit.shy:
                wrapped.add(id(module))
        for module in self.model.modules():
            if isinstance(module, nn.TransformerEncoder) and len(module.layers) and id(module.layers[0]) in wrapped:
                first = [self.params[id(p)] for p in module.layers[0].parameters() if id(p) in self.params]
                self._handles.append(module.register_forward_pre_hook(partial(present_ordinary, first, True)))
                self._handles.append(module.register_forward_hook(partial(present_ordinary, first, False),
                                                                  always_call=True))
        self._handles.append(self.model.register_forward_pre_hook(self._start_step, prepend=True))
        self._handles.append(self.model.register_forward_hook(self.pass_state.end_pass, always_call=True))
        # see [Note: A forward stopped by Ctrl-C]
        self._handles.append(WrappedForward(self.model, self.pass_state, self.store))
        # See [Note: Compiled units]: the modules compiled as offload_model found them.
        self._unit_of_module = {id(u.module): u for u in self._units.values()}
        self._compiled = {id(m): _compiled_call(m) for m in self.model.modules() if compiled(m)}

    def _hook_state_dicts(self) -> None:
        """model.load_state_dict() writes each offloaded parameter's held copy (see [Note: Loading a state dict]);
        state_dict() of the model or of any of its modules reads the real values."""
        for module in self.model.modules():
            if any(self._owned(module)):
                self._handles.append(module.register_state_dict_post_hook(partial(self._fill_state_dict)))
                self._handles.append(module.register_load_state_dict_pre_hook(self._before_load))
                self._handles.append(module.register_load_state_dict_post_hook(self._after_load))

    def _adopt_compiled(self) -> None:
        """Modules compiled, or compiled again, since ``offload_model`` (see [Note: Compiled units])."""
        for mname, module in self.model.named_modules():
            how = compiled(module)
            unit = self._unit_of_module.get(id(module))
            if how is None or (unit.around_compiled_call() if unit is not None and how == "in place" else
                               self._compiled.get(id(module)) is _compiled_call(module)):
                continue
            if not mname:
                raise OffloadedParameterError(WHOLE_MODEL)
            below = {id(m) for m in module.modules()} - {id(module)}
            inner = [u for u in self._units.values() if u.hooks and id(u.module) in below]
            self._check_compiled_after(mname, module, how, unit, inner)
            for u in inner:  # no parameters of their own: what they hooked was the running stack
                u.unhook()
            if unit is not None:
                unit.unhook()
                unit.hook(module, shy=unit.shy)
            self._compiled[id(module)] = _compiled_call(module)

    def _check_compiled_after(self, mname: str, module: nn.Module, how: str, unit: Unit | None,
                              inner: list[Unit]) -> None:
        """Refuse a module compiled after ``offload_model`` whose units' hooks would run inside compiled code."""
        if how == "wrapped" and inner:
            raise OffloadedParameterError(
                f"torch.compile({mname}) after offload_model: the wrapper it made runs the hooks that fetch the "
                f"parameters of {inner[0].name or 'the root'} inside the compiled code. Compile the module in "
                f"place ({mname}.compile()), or before offload_model")
        held = [u for u in inner if u.params]
        if held:
            raise OffloadedParameterError(
                f"{mname} was compiled after offload_model, and its parameters are fetched by units inside it "
                f"({held[0].name}, ...), whose hooks cannot run inside compiled code. Make it one unit: "
                f"offload_model(model, store, units=[{type(module).__name__}]) (a module compiled before "
                f"offload_model is made one by itself)")
        if unit is not None and any(isinstance(h, WrappedForward) for h in unit.hooks):
            raise OffloadedParameterError(
                f"{mname} ({type(module).__name__}) was compiled after offload_model, which wrapped its forward "
                f"(its fused inference path refuses hooks); compiled so, it does not compute exactly as the "
                f"compiled resident layer. Compile it before offload_model")

    def _record(self, name: str, key: str, p: nn.Parameter, nbytes: int) -> StoredParam:
        """The record of an offloaded parameter, given what it uses (see ``StoredParam``)."""
        return StoredParam(name, key, p, self.site, self.pass_state, self.schedule,
                           placeholder_of(p, self.compute_device), nbytes, type(p))

    # ---- what the units and the pass ask ------------------------------------------------------
    def _start_step(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # the whole model compiled after offload_model
            raise OffloadedParameterError(WHOLE_MODEL)
        self._check_usable()
        if "torch._dynamo" in sys.modules:  # something was compiled: this model's modules, maybe
            self._adopt_compiled()  # before the pass counts this forward: a refusal here leaves nothing behind
        passes = self.pass_state
        passes.one_pass_at_a_time()
        if passes.joined():  # one more micro-batch of a layer-major step: the step has begun
            return
        passes.settle_failed_backward()
        if not passes.in_backward():  # not a forward rerun inside backward (checkpointing)
            passes.clear()  # what a forward that raised (or a load_state_dict, or Ctrl-C) left
            self._loading.clear()
            passes.hook_gradients()
            self._begin_step()

    @property
    def backwards_failed(self) -> int:
        return self.pass_state.backwards_failed

    # ---- state dicts -------------------------------------------------------------------
    def _before_load(self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict,
                     *_: Any) -> None:
        """Hold the offloaded parameters a load names, each noted with whether the value it is given differs from
        its own: see [Note: Loading a state dict]."""
        for sp, value in self._named_by_load(module, state_dict, prefix, local_metadata):
            sp.hold(self.schedule.unit_of(sp))
            self._loading.append((sp, value, not same_values(sp.held, value)))

    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        """Every parameter held for loading has been copied by now (a module loads its own before its
        children's): mark them changed and let them go."""
        loading, self._loading = self._loading, []
        for sp, _, _ in loading:
            self.store.mark_dirty(sp.key, self.compute_tier)
            sp.unhold()
        give_back_pages([value for _, value, _ in loading])  # copied: see [Note: Loaded pages given back]
        changed = [sp.name for sp, _, differs in loading if differs]
        if changed:
            self.loaded(changed)

    def _fill_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        """A module's state_dict post-hook: its own offloaded parameters' values (in place of placeholders)."""
        if self._unread:
            return
        for pname, sp in self._owned(module):
            if prefix + pname in state_dict:
                state_dict[prefix + pname] = self._state_dict_value(sp)


    # ---- public ------------------------------------------------------------------------
    @contextmanager
    def state_dict_unread(self) -> Iterator[None]:
        """Within it, ``model.state_dict()`` gives each offloaded parameter as a meta tensor of its shape and dtype
        instead of reading its value: for code that takes a state dict for its keys and shapes only (peft's
        ``load_adapter``), which would otherwise read the whole model into memory."""
        self._unread, before = True, self._unread
        try:
            yield
        finally:
            self._unread = before

    def _forward_runs(self) -> bool:
        return self.pass_state.forward_depth > 0  # ends as the forward returns or raises (an always-called hook)

    def in_forward_or_backward(self) -> bool:
        """Whether a forward or backward of the model holds parameters now (a checkpoint waits for the step)."""
        return any(sp.holds for sp in self.params.values())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the model's gradients, where they are kept.

        An offloaded parameter's gradient is kept here, not in ``param.grad``, so
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` would see none
        of them: call this between ``backward()`` and ``opt.step()`` instead. The
        norm and the scaled gradients are those torch computes for the resident
        model, bit for bit (tested). Returns the total norm.
        """
        if self.pass_consumers.consumes_grads():
            raise TierStoreError("clip_grad_norm_ needs every gradient before any is stepped, but an optimizer steps "
                                 "them during backward: use OffloadedAdamW(..., step_in_backward=False)")
        grads = self.grads_in_order()
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        holders = [SimpleNamespace(grad=g) for g in grads]  # what clip_grads_with_norm_ reads of a parameter
        torch.nn.utils.clip_grads_with_norm_(holders, max_norm, total, foreach)  # type: ignore[arg-type]
        return total

    def held_beside_updates(self) -> dict[str, int]:
        """Offloaded parameter name -> host-tier bytes backward may hold while its update runs in backward:
        computing in the host tier, the largest other unit and the root's own parameters (held throughout)."""
        if self.compute_tier is not Tier.HOST:
            return {}
        units = sorted(((sum(TierPool.capacity_for(sp.nbytes) for sp in u.params), {sp.name for sp in u.params})
                        for name, u in self._units.items() if name and u.params), key=lambda u: -u[0])
        root = {sp.name: TierPool.capacity_for(sp.nbytes) for sp in self._units[""].params} if "" in self._units \
            else {}
        root_bytes = sum(root.values())
        return {sp.name: next((nbytes for nbytes, names in units if sp.name not in names), 0)
                + root_bytes - root.get(sp.name, 0) for sp in self.params.values()}

    def accumulate(self, step_fn: Callable[[Any], Any], micro_batches: Sequence[Any]) -> list[Any]:
        """``[step_fn(mb) for mb in micro_batches]``, run layer by layer: ``step_fn`` runs one micro-batch's forward
        and backward (``lambda mb: loss_fn(model(mb.x), mb.y).backward()``, or ``Trainer.training_step``); all
        micro-batches pass through each unit given to ``offload_model`` as ``units`` (a decoder layer each)
        before the next, so each weight is read about once forward and once backward a step, whatever their
        number, and the activations between units are kept in the store (spilled to the drive when the host tier
        is full). The gradients are those of the loop, bit for bit (the same sums in the same order); a model
        whose units do not run as a chain runs as the loop, with a warning once. See [Note: A layer-major
        step]."""
        return run_layer_major(self, step_fn, micro_batches, self.unit_roots)

    def follow_optimizer(self, home: Tier) -> None:
        self.grads.follow(home)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient, or with ``set_to_none=False`` zero them in place as torch does: a parameter
        that then gets no gradient from the next backward is stepped with zeros (its moments decay, weight decay
        applies), as a resident model's would be."""
        self.pass_state.settle_failed_backward()
        if set_to_none:
            self.grads.clear()
        else:
            self.grads.zero()
        zero_grads(self.resident.values(), set_to_none)


    def give_back_device(self) -> torch.device:
        return self.compute_device

    def running_pass(self) -> bool:
        passes = self.pass_state
        if passes.backward_thread == threading.get_ident():  # this thread's backward, not running now: it raised
            passes.settle_failed_backward()  # what it held goes, as the next forward would let it go
        return passes.forward_thread is not None or passes.in_backward()

    def store_closing(self) -> None:
        self.pass_state.clear()  # what a pass that raised left (the next forward would clear it)
        self.remove()

    def remove(self, *, keep_values: bool = True) -> None:
        """Detach from the module: parameters get their current values back as ordinary tensors, and the state of
        an optimizer of it leaves the store. ``store.close()`` calls it for a model still offloaded.

        ``keep_values=False`` reads nothing back: each offloaded parameter becomes an ordinary parameter on the
        meta device (its shape and dtype, no values; the small ones kept in memory keep theirs), for a model
        larger than memory whose values were saved (``save_checkpoint``) and are to be dropped;
        ``model.to_empty(device=...)`` and a load bring it back.

        The values come back one parameter at a time, before anything else lets go (the hooks, an optimizer's
        state): a remove that fails part-way (memory ran out) leaves the rest in the store, and calling it
        again goes on from there.
        """
        if self.removed:  # removed already (by store.close(), say): nothing more to give back
            return
        for sp in self.params.values():
            if sp.holds:
                raise TierStoreError(f"cannot remove offload while {sp.name!r} is in use (inside forward/backward)")
        for consumer in self.consumers:
            consumer.finish()
        dropped: set[int] = set()
        for pid, sp in list(self.params.items()):
            value = self.store.read(sp.key).to(self.compute_device) if keep_values else sp.placeholder
            sp.param.__class__ = sp.original_class
            del sp.param._tierstore
            sp.param.data = value
            self.store.drop(sp.key)
            del self.params[pid]
            dropped.add(pid)
        if not keep_values:  # a tensor cannot become a meta tensor in place: new parameters (tied ones stay tied)
            on_meta: dict[int, nn.Parameter] = {}
            for module in self.model.modules():
                for pname, p in module._parameters.items():
                    if p is not None and id(p) in dropped:
                        if id(p) not in on_meta:
                            on_meta[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                        module._parameters[pname] = on_meta[id(p)]
        self._detach([*self._handles, *(h for u in self._units.values() for h in u.hooks)])
        self._handles.clear()
        for name, method in self._installed.items():
            if self.model.__dict__.get(name) is method:
                delattr(self.model, name)
        self.grads.clear()
        self._forget()


ModelMethods = Callable[[nn.Module, OffloadedModel], dict[str, Any]]
"""Given a model and its offload: the methods to install on that model instance while it is offloaded (name ->
method), or none."""
_MODEL_METHODS: list[ModelMethods] = []


def add_model_methods(provider: ModelMethods) -> None:
    """Have ``offload_model`` install the methods ``provider`` gives on each model it offloads (``remove()`` takes
    them off): how an adapter of a library's models makes their methods work on an offloaded one (the
    transformers adapter, ``hf.py``, installs ``save_pretrained`` so: see [Note: Saving the transformers way,
    tensor by tensor]). The generic offload imports no adapter."""
    if provider not in _MODEL_METHODS:
        _MODEL_METHODS.append(provider)


def _compiled_call(module: nn.Module) -> Any:
    """What a compiled module runs when called: its compiled call (in place), or the module (a wrapper)."""
    return module.__dict__.get("_compiled_call_impl", module)


def offload_model(model: nn.Module, store: TierStore, *, prefetch_depth: int | str | None = None,
                  prefetch_bytes: int | None = None, resident_threshold_bytes: int | None = None,
                  home: Tier | str | None = None, compute_tier: Tier | str | None = None,
                  units: Sequence[type[nn.Module] | nn.Module | str] = DEFAULT_UNITS,
                  init_fn: Callable[[nn.Module], None] | None = None, placement: bool = True,
                  real_parameters: str | None = None, grad_tier: Tier | str | None = None,
                  grad_dtype: str = "float32", policy: ParamOffloadPolicy | None = None) -> OffloadedModel:
    """Move ``model``'s parameters into ``store`` and fetch them just in time.

    ``prefetch_depth``, ``prefetch_bytes``, ``resident_threshold_bytes``,
    ``home`` and ``grad_tier`` are a :class:`ParamOffloadPolicy`'s choices:
    each keyword given overrides ``policy`` (the defaults when none is given;
    a settings file's with ``load_settings``). ``compute_tier`` is where
    parameters are held while their module runs: the device tier with CUDA;
    without it the host tier, since both would be CPU memory and a second copy
    would only cost bandwidth and budget (pass "device" to use it anyway).
    ``units`` names modules (by class, instance or name) whose whole subtree is
    fetched at once, like a module given to FSDP2's ``fully_shard``; every
    other module fetches the parameters it owns, and what its forward was seen
    to read of others (see [Note: Units]). A model built on the meta device
    (``with torch.device("meta"): model = Net()``) is materialized module by
    module straight into the store, each initialized by its
    ``reset_parameters()`` or by ``init_fn(module)`` (see [Note: Building on the
    meta device]), so the whole model never exists in memory; the drive's room
    for the parameters is checked before anything is written. Parameters such
    a model has off the meta device are an error unless ``real_parameters``
    says to ``"initialize"`` them with their modules or to ``"keep"`` them (see
    [Note: Real parameters in a model built on meta]).
    ``prefetch_depth="auto"`` (the default) chooses the depth
    each step from the measured drive rate and compute time per unit. With
    ``placement`` (the default), once a step has been recorded the parameters
    and optimizer state that save the most drive traffic stay in the host
    tier for the whole run and the rest stream (see ``off.placement``).
    Gradients kept from backward to the optimizer's step are tensors of the
    store (see [Note: Gradients in the tiers]): their home is ``grad_tier``
    (else the home of the state of the optimizer that steps them), and a
    bf16/fp16 parameter's is kept in fp32 unless ``grad_dtype="param"``.
    Parameter names and state_dict keys are unchanged;
    :meth:`OffloadedModel.remove` undoes it.
    """
    check_not_offloaded(model, "offload_model")
    chosen = (policy or ParamOffloadPolicy()).overridden(
        prefetch_depth=prefetch_depth, prefetch_bytes=prefetch_bytes, home=home,
        resident_threshold_bytes=resident_threshold_bytes, grad_tier=grad_tier)
    if compute_tier is not None and Tier.parse(compute_tier) is Tier.NVME:
        raise TierValueError("compute_tier='nvme': modules run on memory; choose 'device' or 'host'")
    check_options(prefetch_depth, placement)
    check_grad_dtype(grad_dtype)  # before anything is written
    refuse_whole_model(model)  # see [Note: Compiled units]
    scripted = [name or "the model" for name, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        raise TierTypeError(
            f"{scripted[0]!r} is a TorchScript module (torch.jit.script or torch.jit.trace): its forward runs in "
            "TorchScript, where no hook runs to fetch an offloaded parameter. Offload the eager module, and script "
            "it for inference after training")
    state = OffloadedModel(
        model, store,
        prefetch_depth=chosen.prefetch_depth,
        prefetch_bytes=chosen.prefetch_bytes,
        resident_threshold_bytes=chosen.resident_threshold_bytes,
        home=chosen.home,
        compute_tier=(Tier.parse(compute_tier) if compute_tier is not None
                      else Tier.DEVICE if store.device.type != "cpu" else Tier.HOST),
        units=units,
        init_fn=init_fn,
        placement=placement,
        real_parameters=real_parameters,
        grad_tier=chosen.grad_tier,
        grad_dtype=grad_dtype,
    )
    setattr(model, STATE_KEY, state)
    store.attach_user(state)  # store.close() gives the values back first (see TierStore.close)
    return state


__all__ = ["DEFAULT_UNITS", "ModelMethods", "OffloadStats", "OffloadedModel", "OffloadedParameterError",
           "add_model_methods", "offload_model"]
