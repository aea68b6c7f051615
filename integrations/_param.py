"""One offloaded parameter: the class it has while offloaded, what its reads and writes do, and its holds.

[Note: Reads of an offloaded parameter] An offloaded parameter is an
``OffloadedParameter`` (an ``nn.Parameter`` subclass, so ``isinstance`` and
names are unchanged) whose ``.data`` is its store copy while anyone holds it
and a placeholder with no storage otherwise: shape, dtype and device are true
and it holds no memory. No value can be read from it: a torch function that
reads it is intercepted (below); ``.data`` and ``detach()``, which would alias
it, fetch it on demand as any read does inside the model's forward and
backward, and elsewhere give a meta tensor instead, whose computations yield
meta tensors, never values; one that would mix it with a real tensor
(``ema.add_(p.data)``, which torch alone computes as a silent no-op), copy
it off the meta device, or clone it (``p.detach().clone()``, the idiom for a
copy of the values) raises.
So no stand-in value can ever reach compute.
Nor can a write be lost: one into that meta tensor or a view of it
(``p.data.normal_()``, ``p.data[0] = 1``, as initialization code does), an
in-place op on the parameter, or ``p.data = x`` raises, saying how to write
values (``load_state_dict``).
Every torch function called on such a parameter passes through its
``__torch_function__``: one that reads values while the parameter is not
held fetches it on demand when a forward of the model is running (the
innermost running unit holds it, and learns it: from then on that unit's
pre-hook fetches it, and the prefetch scheduler counts it in the unit's
bytes), and in backward; anywhere else it raises
:class:`OffloadedParameterError`, which names the parameter and says what to
do. So ``nn.MultiheadAttention`` reading ``out_proj.weight`` without calling
``out_proj``, a model reading ``self.embed.weight`` for a tied projection, or a
table shared across layers all compute with the real values.

[Note: A held parameter is an ordinary one] While held, a parameter is of
its own class again (``nn.Parameter``) and only unheld is it an
``OffloadedParameter``: torch's fused inference paths
(``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` in eval under
``no_grad``) refuse any argument with a ``__torch_function__``, and their
kernels round differently from the standard path (``nn.TransformerEncoder``'s
also gives zeros at padding), so a subclass would make the offloaded model's
eval outputs differ from the resident model's. The layer also refuses any
forward hook on itself or a module inside it: as a unit (by default) its
forward is wrapped instead of hooked. ``nn.TransformerEncoder`` asks the same
of its first layer's parameters before that layer runs: its hooks show them
as ordinary from its start until the layer holds them (their placeholders
still hold no values, so a read there raises; only the question sees them).
Off the hot path too: a held parameter's ops no longer pass through a
Python ``__torch_function__``.

[Note: A write while held] A forward may write its parameter in place
(``with torch.no_grad(): self.weight.clamp_(-c, c)``: weight clipping,
renormalization); the resident model keeps the write, so the offloaded one
must too: a held parameter whose version counter moved is marked dirty in
the store when its last hold ends, and so written home before its copy is
dropped; one whose ``.data`` was assigned another tensor
(``self.weight.data = w.clamp(...)``) has those values copied into the
store's copy first. A write in place through ``self.weight.data``
(``self.weight.data.clamp_(...)``) moves no version counter (torch gives
``.data`` a counter of its own) and is not seen: write the parameter itself
under ``torch.no_grad()``.

[Note: A write through .data] A forward may also take ``.data`` of a
parameter that no running unit holds and write through it: a momentum
encoder updated inside the forward (``pk.data.mul_(m).add_(pq.data, alpha=1
- m)``, as MoCo's and BYOL's code does). Taking it fetches the parameter on
demand (see [Note: Reads of an offloaded parameter]), and since a write
through ``.data`` moves no version counter, such a parameter is marked
changed at the end of every hold from then on: a write never made costs a
write home of it after each hold, a write lost would change the model
silently.

[Note: Holding a parameter] Holds are counted: one per forward of a unit that
holds it (released by the forward post-hook) and at most one for backward
(taken when the gradient of one of the unit's forward outputs is about to be
computed, released when the parameter's gradient has been accumulated, or at
the end of the backward pass for parameters that get no gradient). Counting
makes a module called twice, tied parameters and activation checkpointing
(which reruns forward inside backward) all work with no special cases.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierstore import Tier, TierStore, TierStoreError, TierValueError
from tierstore.memory import contiguous_strides, dense_strides

from ._contract import NotCopyable, OffloadedParameterError
from ._grads import StoredGrad

if TYPE_CHECKING:
    from ._contract import Consumers, KeptGradients
    from ._placing import UnitSchedule

# ---- the parameter class ----------------------------------------------------------------
_T = torch.Tensor
# Functions that read no values of a tensor (metadata, hooks, storage identity): an unheld parameter passes
# them through. Not ``untyped_storage()``: its placeholder's storage has a size and no memory, so a write into
# it, or a tensor made on it with ``set_()``, would crash the process; it is fetched or refused as a read is.
_NO_READ = frozenset({
    _T.size, _T.dim, _T.numel, _T.nelement, _T.stride, _T.element_size, _T.is_floating_point, _T.is_complex,
    _T.is_signed, _T.is_contiguous, _T.storage_offset, _T.data_ptr,
    _T.requires_grad_, _T.register_hook, _T.register_post_accumulate_grad_hook, _T.is_shared, _T.get_device,
    _T._is_view, _T.__len__, _T.__hash__, _T.__dir__, _T.__setstate__, torch._has_compatible_shallow_copy_type,
    # A parameter among the ``inputs`` of a backward is the leaf to differentiate for, not a value read.
    torch.autograd.backward, torch.autograd.grad,
})
# Attributes whose getter makes a view or a copy of values (every other attribute is metadata).
_VALUE_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
# What gives an alias of an unheld parameter's placeholder: a meta tensor is given instead, so that
# computing with it yields meta tensors or device errors, never values (and never reads unallocated memory).
_ALIASES = frozenset({"data", "detach"})
# Conversions that are no-ops when the target is what the parameter already is (``model.to(device)``).
_CONVERSIONS = frozenset({_T.to, _T.cpu, _T.cuda, _T.float, _T.double, _T.half, _T.bfloat16, _T.type_as})


def leaves(obj: Any, cls: type) -> Iterator[Any]:
    """The instances of ``cls`` in nested tuples, lists and mappings (a forward's output, a ModelOutput, the
    arguments of a torch function)."""
    if isinstance(obj, cls):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from leaves(o, cls)
    elif isinstance(obj, Mapping):
        for o in obj.values():
            yield from leaves(o, cls)


class OffloadedParameter(nn.Parameter):
    """The class of an offloaded parameter while it is offloaded (see [Note: Reads of an offloaded parameter])."""

    _tierstore: StoredParam

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _NO_READ:
            how = getattr(func, "__name__", None)  # "__get__"/"__set__" for an attribute's getter/setter
            attribute = _attribute_of(func, how)
            if (attribute or how) in _ALIASES and how != "__set__":
                p = args[0]
                if isinstance(p, OffloadedParameter) and not p._tierstore.holds:
                    sp = p._tierstore
                    if not sp.passes.fetch_on_demand(sp):  # outside the model's forward and backward
                        return _Alias.of(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta"), sp)
                    # See [Note: A write through .data].
                    sp.written_through_data = sp.written_through_data or attribute == "data"
            elif attribute == "data" and how == "__set__" and isinstance(args[0], OffloadedParameter):
                if args[1] is args[0]:  # ``param.data = param``: what nn.Module._apply does after a no-op .to()
                    return None
                raise OffloadedParameterError(write_message("assigning .data", args[0]._tierstore))
            elif attribute is None or attribute in _VALUE_ATTRIBUTES:
                unheld = [p for p in leaves((args, kwargs), OffloadedParameter) if not p._tierstore.holds]
                if unheld:
                    fetched = _on_read(unheld, func, args, kwargs)
                    if fetched is not None:
                        return fetched[0]
            elif attribute == "grad" and isinstance(args[0], OffloadedParameter):
                return kept_grad(args[0]._tierstore, how, args[1:])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        """A copy of its values, fetched on demand in the model's forward or backward; elsewhere refused (torch's
        would clone the meta tensor ``.data`` gives there: a copy with no values)."""
        sp = self._tierstore  # unheld: a held parameter is of its own class, and never reaches here
        if sp.passes.fetch_on_demand(sp):  # held now, and of its own class again
            return sp.original_class.__deepcopy__(self, memo)
        raise OffloadedParameterError(read_message("copy.deepcopy", sp))

    def __repr__(self) -> str:
        sp = self._tierstore
        if sp.holds:
            with torch._C.DisableTorchFunctionSubclass():
                return nn.Parameter.__repr__(self)
        return (f"Parameter(offloaded {sp.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}; read its value with read_param({sp.name!r}))")


def kept_grad(sp: StoredParam, how: str, value: Any) -> torch.Tensor | None:
    """``param.grad`` of an offloaded parameter is the gradient its model keeps for it in the store (see [Note: A
    stored gradient read from outside]): torch's ``clip_grad_norm_``, ``model.zero_grad()`` and the like act on
    it."""
    grads = sp.passes.grads
    if how == "__get__":
        why = sp.passes.consumers.grads_taken()
        if why is not None:
            raise TierStoreError(f"{sp.name}.grad: {why}")
        return grads.get(sp.key)
    if how == "__set__" and value[0] is not None:
        grad = value[0]
        if isinstance(grad, StoredGrad) and grads.get(sp.key) is grad:  # ``p.grad = p.grad``: nothing changes
            return None
        if grad.shape != sp.param.shape or grad.dtype not in (sp.param.dtype, grads.dtype_of(sp.param)):
            raise TierValueError(f"a gradient of shape {tuple(grad.shape)} and dtype {grad.dtype} for {sp.name!r} of "
                                 f"shape {tuple(sp.param.shape)} and dtype {sp.param.dtype}")
        if isinstance(grad, StoredGrad):
            grad = grad.clone()
        grads[sp.key] = grad.detach().to(dtype=grads.dtype_of(sp.param))
    else:
        grads.pop(sp.key, None)
    return None


def _attribute_of(func: Any, how: str | None) -> str | None:
    """The attribute name when ``func`` (named ``how``) is a tensor attribute's getter or setter, else None."""
    if how in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", "?")
    return None


def _on_read(unheld: list[OffloadedParameter], func: Any, args: Any, kwargs: Any) -> tuple[Any] | None:
    """Unheld parameters are about to be read by ``func``: fetch them, or return ``(result,)`` of a
    conversion that needs no values, or raise."""
    for p in unheld:
        sp = p._tierstore
        if sp.passes.fetch_on_demand(sp):
            continue
        if func in _CONVERSIONS and args and args[0] is p:  # a no-op conversion returns its input, reading nothing
            probe = torch.empty(0, dtype=p.dtype, device=sp.site.device)
            with torch._C.DisableTorchFunctionSubclass():
                if func(probe, *args[1:], **kwargs) is probe:
                    return (p,)
        what = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        if what.endswith("_") and not what.endswith("__") and args and args[0] is p:  # an in-place write
            raise OffloadedParameterError(write_message(what, sp))
        raise OffloadedParameterError(read_message(what, sp))
    return None


# Callers whose reads and writes of every parameter mean they wrap the model: what to use instead.
_WRAPPERS = {
    ("torch", "nn", "parallel", "distributed.py"): "DistributedDataParallel",
    ("torch", "nn", "parallel", "data_parallel.py"): "DataParallel",
}


def _wrapper_hint() -> str:
    """Said first when a data-parallel wrapper (which broadcasts or replicates every parameter) or peft's merge
    of adapters read or wrote an offloaded parameter, found on the stack at the error (never on the hot path)."""
    frame = sys._getframe(1)
    while frame is not None:
        parts = tuple(os.path.normpath(frame.f_code.co_filename).split(os.sep)[-4:])
        if parts in _WRAPPERS:
            return (f"{_WRAPPERS[parts]} cannot wrap a model offloaded with offload_model: it broadcasts and "
                    f"replicates parameters that live in the store. Shard the model with FSDP2 (fully_shard) and "
                    f"offload it with tierstore.integrations.offload_fsdp instead. ")
        if "peft" in parts and frame.f_code.co_name in ("merge", "merge_and_unload", "merge_adapter"):
            return ("peft's merge writes every base weight in memory. Save the merged model one weight at a time "
                    "with tierstore.integrations.save_merged(model, directory) instead (from_pretrained loads it). ")
        frame = frame.f_back
    return ""


def read_message(what: str, sp: StoredParam, through: str = "") -> str:
    module = sp.name.rpartition(".")[0] or "the model"
    return _wrapper_hint() + (
        f"{what} read the offloaded parameter {sp.name!r} (of {module}){through} outside the forward and backward "
        f"of the model it was offloaded with; its values live in the store, so no value is there to read. Read it "
        f"with off.read_param({sp.name!r}) or model.state_dict(); compute with it inside the model's forward (any "
        f"module of the model may read any of its parameters there); convert dtype or device before "
        f"offload_model; or call off.remove() to make the parameters ordinary tensors again")


def call_weakly(method: weakref.WeakMethod, sp: weakref.ref, param: torch.Tensor) -> None:
    """A parameter's post-accumulate-grad hook: torch keeps it where the garbage collector cannot see it, so a
    hook holding its model strongly would keep a dropped model, its store and the swap files alive until exit."""
    bound, target = method(), sp()
    if bound is not None and target is not None:
        bound(target, param)


def _same_memory(p: torch.Tensor, held: torch.Tensor) -> bool:
    """Whether ``p`` still computes with ``held``'s memory (its ``.data`` was not assigned another tensor)."""
    return p.untyped_storage().data_ptr() == held.untyped_storage().data_ptr() and \
        p.storage_offset() == held.storage_offset()


def write_message(what: str, sp: StoredParam) -> str:
    module = sp.name.rpartition(".")[0] or "the model"
    return _wrapper_hint() + (
        f"{what} would write the offloaded parameter {sp.name!r} (of {module}) outside the forward and backward "
        f"of its model, and be lost: its values live in the store. Write new values with "
        f"model.load_state_dict(state_dict) or tierstore.integrations.load_safetensors, before creating the "
        f"model's OffloadedAdamW; initialize parameters before offload_model (or build the model on the meta "
        f"device and pass init_fn)")


class _Alias(torch.Tensor):
    """What ``.data`` or ``detach()`` of an unheld offloaded parameter gives, and any view of it: a meta tensor of
    its shape and dtype, so computing with it yields meta tensors, never values; a write into it (``p.data.normal_()``,
    ``p.data[0] = 1``: initialization code does both) raises, since it would change nothing the model computes with
    (see [Note: Reads of an offloaded parameter])."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    _meta: torch.Tensor
    _tierstore: StoredParam

    @staticmethod
    def of(meta: torch.Tensor, sp: StoredParam) -> _Alias:
        alias = torch.Tensor._make_wrapper_subclass(_Alias, meta.shape, strides=meta.stride(),
                                                    storage_offset=meta.storage_offset(), dtype=meta.dtype,
                                                    device="meta")
        alias._meta, alias._tierstore = meta, sp
        return alias

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, _Alias) and arg.alias_info is not None and arg.alias_info.is_write:
                raise OffloadedParameterError(write_message(func.overloadpacket.__name__, value._tierstore))
        aliases = list(leaves((args, kwargs), _Alias))
        real = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and not isinstance(t, _Alias) and not t.is_meta]
        to_real = func is torch.ops.aten._to_copy.default and kwargs.get("device") not in (None, torch.device("meta"))
        if aliases and (to_real or func is torch.ops.aten.clone.default
                        or real and (func._schema.is_mutable or any(t.dim() > 0 for t in real))):
            # torch computes some ops of a real tensor and a meta one (``ema.add_(p.data)``, ``torch._foreach_
            # add_``) as a silent no-op: a value would come out that the parameter's values never went into. And
            # ``p.detach().clone()`` is how a copy of the values is taken (an EMA's start): a meta one is none.
            raise OffloadedParameterError(read_message(func.overloadpacket.__name__, aliases[0]._tierstore,
                                                        through=" through its .data or .detach()"))
        unwrap = functools.partial(torch.utils._pytree.tree_map_only, _Alias, lambda a: a._meta)
        out = func(*unwrap(args), **unwrap(kwargs))
        if aliases and any(r.alias_info is not None for r in schema.returns):  # a view: a write into it is one too
            return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: _Alias.of(t, aliases[0]._tierstore), out)
        return out


def refuse_other_optimizers(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A torch optimizer stepping offloaded parameters would update their placeholders between uses, not the
    values in the store: refuse it at its first step, before it touches anything."""
    if getattr(optimizer, "steps_offloaded_parameters", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, OffloadedParameter):
                raise OffloadedParameterError(
                    f"{type(optimizer).__name__} is stepping the offloaded parameter {p._tierstore.name!r}, whose "
                    f"values and optimizer state belong in the store; this optimizer cannot update them there. "
                    f"Use tierstore.integrations.OffloadedAdamW(off, ...) for offloaded models")


_optimizer_hook: Any = None


def refuse_other_optimizers_from_now() -> None:
    """Install :func:`refuse_other_optimizers` as torch's global optimizer step pre-hook (once a process)."""
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(refuse_other_optimizers)


@dataclass(frozen=True)
class ComputeSite:
    """Where a model's held parameters live and compute: its ``store``, the compute ``tier`` of their held copies
    and its ``device``. What every level of an offload below its front is given of the store."""

    store: TierStore
    tier: Tier
    device: torch.device


class ParamPass(Protocol):
    """What a parameter uses of its model's passes (``_pass.PassState``): a read no hook foresaw fetches it on
    demand; its held copy's storage is known by it; its kept gradient, and whether consumers let it be read."""

    storage_owner: dict[int, StoredParam]
    grads: KeptGradients
    consumers: Consumers

    def fetch_on_demand(self, sp: StoredParam) -> bool: ...


@dataclass(eq=False)
class StoredParam(NotCopyable):
    """One offloaded parameter of an ``OffloadedModel``: its name and store key, and its holds (see [Note:
    Holding a parameter]). It is given where it computes (``site``), its model's passes and the units' schedule
    (whose stall counts its fetch), not the offload they belong to."""

    name: str
    key: str
    param: nn.Parameter
    site: ComputeSite
    passes: ParamPass
    schedule: UnitSchedule
    placeholder: torch.Tensor
    nbytes: int
    original_class: type
    holds: int = 0
    backward_hold: bool = False
    version: int = 0  # the parameter's version counter when held (see [Note: A write while held])
    written_through_data: bool = False  # its .data was taken in a forward, unheld (see [Note: A write through .data])
    held: torch.Tensor | None = None  # the store's copy while held

    def hold(self, unit: Any) -> None:
        """One more hold, for ``unit``; the first fetches the store's copy into the compute tier (the wait is
        ``unit``'s stall)."""
        self.holds += 1
        if self.holds > 1:
            return
        site = self.site
        t0 = time.perf_counter()
        # Under torch.inference_mode() the copy would be an inference tensor, and torch computes with one
        # differently (its eval outputs would round otherwise than the resident model's): it is made outside.
        try:
            with torch.inference_mode(False), torch._C.DisableTorchFunctionSubclass():
                self.param.data = self.held = site.store.get(self.key, site.tier, sync_views=True)
        except BaseException:
            self.holds -= 1  # not held: it still has no values
            raise
        self.param.__class__ = self.original_class  # see [Note: A held parameter is an ordinary one]
        self.version = self.param._version
        if self.param.numel():
            self.passes.storage_owner[self.param.untyped_storage().data_ptr()] = self
        self.schedule.add_stall(unit, t0)

    def unhold(self) -> None:
        """One hold fewer; the last writes home what a forward wrote and gives the copy back to the store."""
        self.holds -= 1
        if self.holds:
            return
        held, self.held = self.held, None
        assert held is not None
        assigned = not _same_memory(self.param, held)
        # See [Note: A write while held] and [Note: A write through .data].
        if assigned or self.param._version != self.version or self.written_through_data:
            self._keep_write(held, assigned)
        self.passes.storage_owner.pop(held.untyped_storage().data_ptr(), None)
        self.param.data = self.placeholder
        self.param.__class__ = OffloadedParameter
        # A view of it kept past the hold (see [Note: A freed buffer still viewed]) keeps its memory.
        self.site.store.release(self.key, self.site.tier, guard_views=True)

    def release(self) -> None:
        """Let go of every hold (what a pass left when it stopped)."""
        self.backward_hold = False
        if self.holds:
            self.holds = 1
            self.unhold()

    def _keep_write(self, held: torch.Tensor, assigned: bool) -> None:
        """The parameter was written while held, in place or (``assigned``) by assigning ``.data``: the store's
        copy gets the values, and is marked changed."""
        if assigned:
            value = self.param.detach()
            if value.shape != held.shape or value.dtype != held.dtype:
                raise OffloadedParameterError(
                    f"{self.name}.data was assigned a tensor of shape {tuple(value.shape)} and dtype {value.dtype} "
                    f"while its module ran; an offloaded parameter keeps its shape {tuple(held.shape)} and dtype "
                    f"{held.dtype} (write values of those in place, under torch.no_grad())")
            with torch.no_grad():
                held.copy_(value)
        self.site.store.mark_dirty(self.key, self.site.tier)


class _NoStorage(torch.Tensor):
    """A tensor with a shape and no storage (see [Note: Reads of an offloaded parameter])."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._has_compatible_shallow_copy_type.default:
            # Asked by ``param.data = placeholder`` under torch.inference_mode() (elsewhere it never reaches
            # here): a dense tensor of the parameter's device, as the placeholder is.
            return True
        raise OffloadedParameterError(f"{func} on the placeholder of an offloaded parameter, which holds no values")


def placeholder_of(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What a parameter's ``.data`` is while nobody holds it: its shape, dtype and device with no storage
    (see [Note: Reads of an offloaded parameter])."""
    strides = dense_strides(p) or contiguous_strides(p.shape)  # those of the store's copy
    return torch.Tensor._make_wrapper_subclass(_NoStorage, p.shape, strides=strides, dtype=p.dtype, device=device)
