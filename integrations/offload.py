"""Single-process model offload: parameters live in a TierStore and are fetched
just in time for the forward and the backward of each unit of the model.

[Note: Units] A unit is what one forward pre-hook fetches and one forward
post-hook releases. By default every module is a unit of the parameters it
owns directly, except instances of ``units`` (``nn.MultiheadAttention`` by
default), which own their whole subtree, as FSDP2's ``fully_shard`` of a
module does. What a forward *reads* is learned on top of that: see
[Note: Reads of an offloaded parameter].

[Note: Reads of an offloaded parameter] An offloaded parameter is an
``_OffloadedParameter`` (an ``nn.Parameter`` subclass, so ``isinstance`` and
names are unchanged) whose ``.data`` is its store copy while anyone holds it
and a placeholder with no storage otherwise: shape, dtype and device are true
and it holds no memory. No value can be read from it: a torch function that
reads it is intercepted (below); ``.data`` and ``detach()``, which would alias
it, fetch it on demand as any read does inside the model's forward and
backward, and elsewhere give a meta tensor instead, whose computations yield
meta tensors, never values; one that would mix it with a real tensor
(``ema.add_(p.data)``, which torch alone computes as a silent no-op) or copy
it off the meta device raises.
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
``_OffloadedParameter``: torch's fused inference paths
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

[Note: Backward without module backward hooks] A module full-backward hook
makes torch wrap the module's inputs and outputs in a ``BackwardHookFunction``,
so tensors that were the same object (query, key and value of self-attention)
arrive as distinct tensors: ``nn.MultiheadAttention`` then leaves its packed
in-projection path and its gradients round differently. As FSDP2 does, the
backward fetch is a hook on the forward's output tensors (``register_hook``),
which adds nothing to the graph torch builds.

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

[Note: A forward output that is a view of a parameter] A module may return a
view of its own parameter (``self.latents.expand(batch, -1, -1)``, as
Perceiver's latent embeddings do) for a later module to compute with. Once the
module's hold ends, the store reuses that memory, so the later module would
read another tensor's bytes. Such a parameter stays held until the model's
forward returns (the later modules run inside it); a view of a parameter
returned from the model's forward itself (or from a module called on its own)
would outlive every hold, so it raises instead.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierstore import Tier, TierBudgetError, TierStore
from tierstore._copies import contiguous_strides, dense_strides
from tierstore._memory import PAGE_BYTES, TierPool
from tierstore._placement import Placement
from tierstore._schedule import LaterUses, PrefetchPolicy, group_victim_order

from ._contract import OffloadedParameters, zero_grads
from ._grads import GradientStore, StoredGrad, check_grad_dtype, grad_key
from ._meta import check_meta, materialize, unmaterialize
from ._placing import AUTO_START_DEPTH, Placer, StepStarts, check_options

_STATE_KEY = "_tierstore_offload"
_NOT_COPYABLE = ("an offloaded model cannot be copied or pickled: its parameters live in the store and its module "
                 "holds placeholders. Copy it before offload_model, call .remove() first, or save it with "
                 "state_dict() (which reads the real values) or save_checkpoint()")
DEFAULT_UNITS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, nn.TransformerEncoderLayer,
                                               nn.TransformerDecoderLayer)
# Modules whose forward takes its fused inference path only when no forward hook is attached to it or to any module
# inside it: as units, their forward is wrapped instead of hooked (see [Note: A held parameter is an ordinary one]).
_HOOK_SHY: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer,)


class OffloadedParameterError(RuntimeError):
    """An offloaded parameter's values were needed where tierstore cannot fetch them."""


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


def _leaves(obj: Any, cls: type) -> Iterator[Any]:
    """The instances of ``cls`` in nested tuples, lists and mappings (a forward's output, a ModelOutput, the
    arguments of a torch function)."""
    if isinstance(obj, cls):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _leaves(o, cls)
    elif isinstance(obj, Mapping):
        for o in obj.values():
            yield from _leaves(o, cls)


class _OffloadedParameter(nn.Parameter):
    """The class of an offloaded parameter while it is offloaded (see [Note: Reads of an offloaded parameter])."""

    _tierstore: _Param

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _NO_READ:
            how = getattr(func, "__name__", None)  # "__get__"/"__set__" for an attribute's getter/setter
            attribute = _attribute_of(func, how)
            if (attribute or how) in _ALIASES and how != "__set__":
                p = args[0]
                if isinstance(p, _OffloadedParameter) and not p._tierstore.holds:
                    sp = p._tierstore
                    if not sp.owner.fetch_on_demand(sp):  # outside the model's forward and backward
                        return _Alias.of(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta"), sp)
                    # See [Note: A write through .data].
                    sp.written_through_data = sp.written_through_data or attribute == "data"
            elif attribute == "data" and how == "__set__" and isinstance(args[0], _OffloadedParameter):
                if args[1] is args[0]:  # ``param.data = param``: what nn.Module._apply does after a no-op .to()
                    return None
                raise OffloadedParameterError(_write_message("assigning .data", args[0]._tierstore))
            elif attribute is None or attribute in _VALUE_ATTRIBUTES:
                unheld = [p for p in _leaves((args, kwargs), _OffloadedParameter) if not p._tierstore.holds]
                if unheld:
                    fetched = _on_read(unheld, func, args, kwargs)
                    if fetched is not None:
                        return fetched[0]
            elif attribute == "grad" and isinstance(args[0], _OffloadedParameter):
                return _kept_grad(args[0]._tierstore, how, args[1:])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        """A copy of its values, fetched on demand in the model's forward or backward; elsewhere refused (torch's
        would clone the meta tensor ``.data`` gives there: a copy with no values)."""
        sp = self._tierstore  # unheld: a held parameter is of its own class, and never reaches here
        if sp.owner.fetch_on_demand(sp):  # held now, and of its own class again
            return sp.original_class.__deepcopy__(self, memo)
        raise OffloadedParameterError(_read_message("copy.deepcopy", sp))

    def __repr__(self) -> str:
        sp = self._tierstore
        if sp.holds:
            with torch._C.DisableTorchFunctionSubclass():
                return nn.Parameter.__repr__(self)
        return (f"Parameter(offloaded {sp.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}; read its value with read_param({sp.name!r}))")


def _kept_grad(sp: _Param, how: str, value: Any) -> torch.Tensor | None:
    """``param.grad`` of an offloaded parameter is the gradient its model keeps for it in the store (see [Note: A
    stored gradient read from outside]): torch's ``clip_grad_norm_``, ``model.zero_grad()`` and the like act on
    it."""
    grads = sp.owner.grads
    if how == "__get__":
        for guard in sp.owner.grad_read_guards:
            why = guard()
            if why is not None:
                raise RuntimeError(f"{sp.name}.grad: {why}")
        return grads.get(sp.key)
    if how == "__set__" and value[0] is not None:
        grad = value[0]
        if isinstance(grad, StoredGrad) and grads.get(sp.key) is grad:  # ``p.grad = p.grad``: nothing changes
            return None
        if grad.shape != sp.param.shape or grad.dtype not in (sp.param.dtype, grads.dtype_of(sp.param)):
            raise ValueError(f"a gradient of shape {tuple(grad.shape)} and dtype {grad.dtype} for {sp.name!r} of "
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


def _on_read(unheld: list[_OffloadedParameter], func: Any, args: Any, kwargs: Any) -> tuple[Any] | None:
    """Unheld parameters are about to be read by ``func``: fetch them, or return ``(result,)`` of a
    conversion that needs no values, or raise."""
    for p in unheld:
        sp = p._tierstore
        if sp.owner.fetch_on_demand(sp):
            continue
        if func in _CONVERSIONS and args and args[0] is p:  # a no-op conversion returns its input, reading nothing
            probe = torch.empty(0, dtype=p.dtype, device=sp.owner.compute_device)
            with torch._C.DisableTorchFunctionSubclass():
                if func(probe, *args[1:], **kwargs) is probe:
                    return (p,)
        what = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        if what.endswith("_") and not what.endswith("__") and args and args[0] is p:  # an in-place write
            raise OffloadedParameterError(_write_message(what, sp))
        raise OffloadedParameterError(_read_message(what, sp))
    return None


# Callers whose reads and writes of every parameter mean they wrap the model: what to use instead.
_WRAPPERS = {
    ("torch", "nn", "parallel", "distributed.py"): "DistributedDataParallel",
    ("torch", "nn", "parallel", "data_parallel.py"): "DataParallel",
}


def _wrapper_hint() -> str:
    """Said first when a data-parallel wrapper (which broadcasts or replicates every parameter) read or wrote an
    offloaded parameter, found on the stack at the error (never on the hot path)."""
    frame = sys._getframe(1)
    while frame is not None:
        parts = tuple(os.path.normpath(frame.f_code.co_filename).split(os.sep)[-4:])
        if parts in _WRAPPERS:
            return (f"{_WRAPPERS[parts]} cannot wrap a model offloaded with offload_model: it broadcasts and "
                    f"replicates parameters that live in the store. Shard the model with FSDP2 (fully_shard) and "
                    f"offload it with tierstore.integrations.offload_fsdp instead. ")
        frame = frame.f_back
    return ""


def _read_message(what: str, sp: _Param, through: str = "") -> str:
    module = sp.name.rpartition(".")[0] or "the model"
    return _wrapper_hint() + (
        f"{what} read the offloaded parameter {sp.name!r} (of {module}){through} outside the forward and backward "
        f"of the model it was offloaded with; its values live in the store, so no value is there to read. Read it "
        f"with off.read_param({sp.name!r}) or model.state_dict(); compute with it inside the model's forward (any "
        f"module of the model may read any of its parameters there); convert dtype or device before "
        f"offload_model; or call off.remove() to make the parameters ordinary tensors again")


def _call_weakly(method: weakref.WeakMethod, sp: weakref.ref, param: torch.Tensor) -> None:
    """A parameter's post-accumulate-grad hook: torch keeps it where the garbage collector cannot see it, so a
    hook holding its model strongly would keep a dropped model, its store and the swap files alive until exit."""
    bound, target = method(), sp()
    if bound is not None and target is not None:
        bound(target, param)


def _same_memory(p: torch.Tensor, held: torch.Tensor) -> bool:
    """Whether ``p`` still computes with ``held``'s memory (its ``.data`` was not assigned another tensor)."""
    return p.untyped_storage().data_ptr() == held.untyped_storage().data_ptr() and \
        p.storage_offset() == held.storage_offset()


def _write_message(what: str, sp: _Param) -> str:
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
    _tierstore: _Param

    @staticmethod
    def of(meta: torch.Tensor, sp: _Param) -> _Alias:
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
                raise OffloadedParameterError(_write_message(func.overloadpacket.__name__, value._tierstore))
        aliases = list(_leaves((args, kwargs), _Alias))
        real = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and not isinstance(t, _Alias) and not t.is_meta]
        to_real = func is torch.ops.aten._to_copy.default and kwargs.get("device") not in (None, torch.device("meta"))
        if aliases and (to_real or real and (func._schema.is_mutable or any(t.dim() > 0 for t in real))):
            # torch computes some ops of a real tensor and a meta one (``ema.add_(p.data)``, ``torch._foreach_
            # add_``) as a silent no-op: a value would come out that the parameter's values never went into.
            raise OffloadedParameterError(_read_message(func.overloadpacket.__name__, aliases[0]._tierstore,
                                                        through=" through its .data or .detach()"))
        unwrap = functools.partial(torch.utils._pytree.tree_map_only, _Alias, lambda a: a._meta)
        out = func(*unwrap(args), **unwrap(kwargs))
        if aliases and any(r.alias_info is not None for r in schema.returns):  # a view: a write into it is one too
            return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: _Alias.of(t, aliases[0]._tierstore), out)
        return out


def _refuse_other_optimizers(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A torch optimizer stepping offloaded parameters would update their placeholders between uses, not the
    values in the store: refuse it at its first step, before it touches anything."""
    if getattr(optimizer, "steps_offloaded_parameters", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, _OffloadedParameter):
                raise OffloadedParameterError(
                    f"{type(optimizer).__name__} is stepping the offloaded parameter {p._tierstore.name!r}, whose "
                    f"values and optimizer state belong in the store; this optimizer cannot update them there. "
                    f"Use tierstore.integrations.OffloadedAdamW(off, ...) for offloaded models")


_optimizer_hook: Any = None


@dataclass(eq=False)
class _Param:
    name: str
    key: str
    param: nn.Parameter
    owner: OffloadedModel
    placeholder: torch.Tensor
    nbytes: int
    original_class: type
    holds: int = 0
    backward_hold: bool = False
    version: int = 0  # the parameter's version counter when held (see [Note: A write while held])
    written_through_data: bool = False  # its .data was taken in a forward, unheld (see [Note: A write through .data])
    held: torch.Tensor | None = None  # the store's copy while held


@dataclass(frozen=True, eq=False)
class _SavedView:
    """A saved tensor that aliased a held parameter, as its geometry (see [Note: Saved views of parameters])."""

    param: _Param
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset relative to the parameter's own


@dataclass(eq=False)
class _Group:
    """A unit (see [Note: Units]): the parameters its forward holds, its own and those it was seen to read."""

    name: str
    params: list[_Param]
    nbytes: int
    forward_started: list[float] = field(default_factory=list)  # a stack: a module may be re-entered
    backward_started: float | None = None

    def learn(self, sp: _Param) -> bool:
        if any(q is sp for q in self.params):
            return False
        self.params.append(sp)
        self.nbytes += sp.nbytes
        return True


@dataclass
class OffloadStats:
    """Per-step figures of the hooks (the store keeps its own counters)."""

    stall_seconds_by_group: dict[str, float] = field(default_factory=dict)
    prefetches_issued: int = 0
    reads_learned: int = 0
    prefetch_depth: int = 0
    """The prefetch depth of this step (chosen each step with ``prefetch_depth="auto"``)."""


class OffloadedModel(OffloadedParameters):
    """The offload state of one module; returned by :func:`offload_model` and kept on the module."""

    def __init__(self, model: nn.Module, store: TierStore, *, prefetch_depth: int | str, prefetch_bytes: int | None,
                 resident_threshold_bytes: int, home: Tier, compute_tier: Tier,
                 units: Sequence[type[nn.Module] | nn.Module | str],
                 init_fn: Callable[[nn.Module], None] | None = None, placement: bool = True,
                 real_parameters: str | None = None, grad_tier: Tier | None = None,
                 grad_dtype: str = "float32") -> None:
        self.model = model
        self.store = store
        self.home = home
        self.compute_tier = compute_tier
        self.compute_device = store.device if compute_tier is Tier.DEVICE else torch.device("cpu")
        self.params: dict[int, _Param] = {}
        self.resident: dict[str, nn.Parameter] = {}
        self.resident_ids: set[int] = set()
        self.groups: dict[str, _Group] = {}
        # See [Note: Gradients in the tiers]; without a drive they stay in the host tier.
        grad_home = grad_tier or store.config.grad_tier or store.config.optimizer_tier
        if grad_home is Tier.NVME and store.swap_directory is None:
            grad_home = Tier.HOST
        self.grads = GradientStore(store, grad_home, grad_dtype)
        self.stats = OffloadStats()
        self._handles: list[Any] = []
        self._callback_queued = False
        self._steps = StepStarts()
        self._backward_used: set[str] = set()
        # Units whose forward is running, innermost last, each with whether it started inside backward.
        self._running: list[tuple[_Group, bool]] = []
        # Parameters a unit's forward output is a view of, held until the model's forward returns (see [Note: A
        # forward output that is a view of a parameter]).
        self._held_for_outputs: list[_Param] = []
        # Called with a store key once that parameter's gradient for this backward is complete.
        self.grad_ready_callbacks: list[Callable[[str], None]] = []
        # Each says why no gradient may be read now, or None (an optimizer stepping in backward consumes them).
        self.grad_read_guards: list[Callable[[], str | None]] = []
        # An optimizer's uses of store keys, which eviction weighs with the trace's.
        self.later_uses = LaterUses()
        self.on_remove: list[Callable[[], None]] = []  # called by remove(): optimizers drop their state
        # called with the names of the parameters a load_state_dict() wrote: an optimizer remakes their masters
        self.on_load: list[Callable[[list[str]], None]] = []
        self.broken: str | None = None  # why the values can no longer be trusted (see OffloadedParameters)
        self.backwards_failed = 0  # backward passes that raised (an optimizer stepping in backward asks)
        self._storage_owner: dict[int, _Param] = {}  # data_ptr of a held copy's storage -> its parameter
        self._saved_hooks: Any = None
        self._saved_hooks_thread = 0
        self._stale_hooks: dict[int, Any] = {}  # thread -> hooks a stopped pass left pushed there (see _clear_pass)
        # The thread in the model's forward (how deep), and the one whose backward runs: see [Note: One pass at
        # a time].
        self._forward_thread: int | None = None
        self._forward_depth = 0
        self._backward_thread: int | None = None
        meta = check_meta(model, init_fn, real_parameters)
        offloaded, owned_by = self._plan_units(model, units, resident_threshold_bytes)  # checked before any write
        taken = [name for name, _ in offloaded.values() if f"param/{name}" in store]
        if taken:
            raise ValueError(
                f"the store already holds an offloaded parameter named {taken[0]!r} ({len(taken)} of this model's "
                f"names are taken): a store keeps a model's parameters and optimizer state under their names, so "
                f"another model offloaded into it must not share them. Give each model its own TierStore, or "
                f"call .remove() on the other model's offload first")
        if home is Tier.NVME:
            store.require_nvme_room(sum(nbytes for _, nbytes in offloaded.values()), "offloading {size} of parameters")
        handles: list = []
        done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        undo: list[Callable[[], None]] = []
        try:
            if meta:  # materialized module by module: one module's tensors in memory at a time
                for mname, module in model.named_modules():
                    materialize(module, init_fn, done, undo, mname=mname,
                                initialize_real=real_parameters == "initialize")
                    for pname, p in module._parameters.items():
                        name = f"{mname}.{pname}" if mname else pname
                        if p is not None and id(p) not in self.params and id(p) not in self.resident_ids:
                            self._put(name, p, home, store, handles, resident_threshold_bytes, wait=True)
            else:
                for name, p in model.named_parameters():
                    self._put(name, p, home, store, handles, resident_threshold_bytes, wait=False)
            for h in handles:
                h.wait()
        except BaseException:  # the store holds nothing of the model, and the model is as it was given
            store.undo_puts(handles)
            unmaterialize(undo)
            self.params.clear()
            raise
        if meta:  # the parameters are new objects: what the units hold is known by them now
            offloaded, owned_by = self._plan_units(model, units, resident_threshold_bytes)
        for sp in self.params.values():
            sp.param.data = sp.placeholder
            sp.param.__class__ = _OffloadedParameter
            sp.param._tierstore = sp  # type: ignore[attr-defined]
        self._to_compute_device(model)
        wrapped = set()
        roots = _unit_modules(model, units)
        for mname, (module, ids) in owned_by.items():
            owned = [self.params[i] for i in ids]
            group = _Group(mname, owned, sum(sp.nbytes for sp in owned))
            self.groups[mname] = group
            if isinstance(module, _HOOK_SHY) and mname and roots.get(mname):
                self._handles.append(_WrappedForward(module, self, group))
                wrapped.add(id(module))
                continue
            self._handles.append(module.register_forward_pre_hook(partial(self._pre_forward, group)))
            self._handles.append(module.register_forward_hook(partial(self._post_forward, group), always_call=True))
        for module in model.modules():
            if isinstance(module, nn.TransformerEncoder) and len(module.layers) and id(module.layers[0]) in wrapped:
                first = [self.params[id(p)] for p in module.layers[0].parameters() if id(p) in self.params]
                self._handles.append(module.register_forward_pre_hook(partial(_present_ordinary, first, True)))
                self._handles.append(module.register_forward_hook(partial(_present_ordinary, first, False),
                                                                  always_call=True))
        self._handles.append(model.register_forward_pre_hook(self._start_step, prepend=True))
        self._handles.append(model.register_forward_hook(self._end_pass, always_call=True))
        self._handles.append(_WrappedForward(model, self, None))  # see [Note: A forward stopped by Ctrl-C]
        self._unhooked = list(self.params.values())  # gradients not yet taken as they complete (frozen ones)
        self._hook_gradients()

        # model.load_state_dict() writes each offloaded parameter's held copy (see [Note: Loading a state dict]);
        # state_dict() of the model or of any of its modules reads the real values.
        self._loading: list[_Param] = []
        for module in model.modules():
            if any(id(p) in self.params for p in module._parameters.values() if p is not None):
                self._handles.append(module.register_state_dict_post_hook(partial(self._fill_state_dict)))
                self._handles.append(module.register_load_state_dict_pre_hook(self._before_load))
                self._handles.append(module.register_load_state_dict_post_hook(self._after_load))
        # Until a step has been recorded, guess that forward uses the units in definition order.
        auto = prefetch_depth == "auto"
        self.policy = PrefetchPolicy(depth=AUTO_START_DEPTH if auto else int(prefetch_depth), max_bytes=prefetch_bytes,
                                     group_bytes={g.name: g.nbytes for g in self.groups.values()},
                                     trace=[g.name for g in self.groups.values() if g.params])
        self.stats.prefetch_depth = self.policy.depth
        self._param_of_key = {sp.key: sp for sp in self.params.values()}
        self._key_groups: dict[str, tuple[str, ...]] = {}
        for g in self.groups.values():
            for sp in g.params:
                self._key_groups[sp.key] = (*self._key_groups.get(sp.key, ()), g.name)
        # Which of its copies eviction should drop first (Belady over its trace and its optimizer's queue).
        self.victim_order = group_victim_order(self.policy, self._key_groups, self.later_uses)
        self._victim_token = store.add_victim_order(
            self.victim_order, owns=lambda k: k in self._key_groups or k in self.later_uses.after)
        # What stays in the host tier for the whole run, and the depth with "auto" (see integrations/_placing.py).
        self.placer = Placer(store, self.policy, self.later_uses, group_keys=self._group_keys,
                             place=placement, auto_depth=auto, grad_of=self._grad_of)
        global _optimizer_hook
        if _optimizer_hook is None:
            _optimizer_hook = register_optimizer_step_pre_hook(_refuse_other_optimizers)

    # ---- construction ------------------------------------------------------------------
    def _to_compute_device(self, model: nn.Module) -> None:
        """What stays in memory (parameters under the threshold, buffers) computes beside the fetched parameters,
        so it goes to their device: a model built on the CPU (or on meta) then runs on the GPU."""
        if self.compute_device.type == "cpu":
            return
        with torch.no_grad():
            for p in self.resident.values():
                if p.device != self.compute_device:
                    p.data = p.data.to(self.compute_device)
            for module in model.modules():
                for name, b in module._buffers.items():
                    if b is not None and b.device != self.compute_device:
                        module._buffers[name] = b.to(self.compute_device)

    def _plan_units(self, model: nn.Module, units: Sequence[type[nn.Module] | nn.Module | str],
                    resident_threshold_bytes: int) -> tuple[dict[int, tuple[str, int]], dict[str, tuple]]:
        """(id -> (name, bytes) of each parameter to offload, unit name -> (module, ids it holds)); a unit that
        cannot fit the compute tier is an error here, before anything is written."""
        offloaded: dict[int, tuple[str, int]] = {}
        for name, p in model.named_parameters():  # shared parameters appear once
            nbytes = p.numel() * p.element_size()
            if nbytes >= resident_threshold_bytes:
                offloaded[id(p)] = (name, nbytes)
        unit_modules = _unit_modules(model, units)
        owned_by = {}
        for mname, module in model.named_modules():
            if unit_modules.get(mname) is False:
                continue  # inside a unit: its unit holds its parameters
            tensors = module.parameters() if unit_modules.get(mname) else module._parameters.values()
            ids = dict.fromkeys(id(p) for p in tensors if p is not None and id(p) in offloaded)
            owned_by[mname] = (module, list(ids))
        budget = (self.store.config.device_budget_bytes if self.compute_tier is Tier.DEVICE
                  else self.store.config.host_budget_bytes)
        for mname, (_, ids) in owned_by.items():
            need = sum(TierPool.capacity_for(offloaded[i][1]) for i in ids)  # whole pages, as the pool hands out
            if need > budget:
                raise ValueError(
                    f"unit {mname or '<root>'!r} holds {need} bytes ({need / 2**20:.2f} MiB, each parameter in whole "
                    f"{PAGE_BYTES // 1024} KiB pages) of parameters at once, "
                    f"more than the {self.compute_tier.label} budget ({budget} bytes) it computes in: raise "
                    f"{self.compute_tier.label}_budget_bytes, or split the unit (units=... names the modules whose "
                    f"whole subtree is fetched at once)")
        return offloaded, owned_by

    def _put(self, name: str, p: nn.Parameter, home: Tier, store: TierStore, handles: list, threshold: int, *,
             wait: bool) -> None:
        """Give ``p``'s bytes to the store (or keep it resident when small)."""
        nbytes = p.numel() * p.element_size()
        if nbytes < threshold:
            self.resident[name] = p
            self.resident_ids.add(id(p))
            return
        key = f"param/{name}"
        value = p.detach()
        handles.append(store.put(key, value if dense_strides(value) else value.contiguous(), home=home))
        sp = self.params[id(p)] = _Param(name, key, p, self, _placeholder(p, self.compute_device), nbytes, type(p))
        if wait:  # its memory goes now
            handles[-1].wait()
            sp.param.data = sp.placeholder

    # ---- hooks -------------------------------------------------------------------------
    def _in_backward(self) -> bool:
        return self._callback_queued or torch._C._current_graph_task_id() != -1

    def _queue_end_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self._backward_thread = threading.get_ident()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _hook_gradients(self) -> None:
        """Take each trainable parameter's gradient as it completes; also of one unfrozen since the last step
        (a frozen parameter cannot have the hook, and its gradient would otherwise stay unseen in ``.grad``)."""
        still = []
        for sp in self._unhooked:
            if sp.param.requires_grad:
                self._handles.append(sp.param.register_post_accumulate_grad_hook(
                    partial(_call_weakly, weakref.WeakMethod(self._grad_accumulated), weakref.ref(sp))))
            else:
                still.append(sp)
        self._unhooked = still

    def _start_step(self, module: nn.Module, args: Any) -> None:
        if self.broken:
            raise OffloadedParameterError(self.broken)
        self._one_pass_at_a_time()
        self._settle_failed_backward()
        if not self._in_backward():  # not a forward rerun inside backward (checkpointing)
            self._clear_pass()  # what a forward that raised (or a load_state_dict, or Ctrl-C) left
            self._loading.clear()
            self._hook_gradients()
            if not self._steps.forward():  # see [Note: Several forwards, one backward]
                return
            self.policy.start_step()
            self.placer.start_step()
            self.stats.prefetch_depth = self.policy.depth

    def _stopped_by_interrupt(self) -> None:
        """[Note: A forward stopped by Ctrl-C] torch runs a module's always-call
        forward hooks when its forward raises an Exception, not a BaseException
        that is none (KeyboardInterrupt: Ctrl-C in a notebook, SystemExit), so
        such a forward would leave its units on the running stack (reads after
        it would be taken for reads inside a forward), its saved-tensor hooks
        pushed, its parameters held and its pass counted (other threads refused
        for good). The model's forward is wrapped to clear all of that as it
        propagates; a forward rerun inside backward is left to the backward's
        own settling."""
        if torch._C._current_graph_task_id() != -1:
            return
        self._settle_failed_backward()
        self._clear_pass()
        if self._forward_thread == threading.get_ident():
            self._forward_thread, self._forward_depth = None, 0

    def _clear_pass(self) -> None:
        """Let go of what a pass left that no hook ended: its running units (a module called on its own and
        stopped by Ctrl-C leaves them too: the model's next forward clears them), its saved-tensor hooks (popped
        from their thread's stack when that thread next runs the model: the interrupted one is the main thread,
        and the next forward may come from another), its holds."""
        self._running.clear()
        hooks, self._saved_hooks = self._saved_hooks, None
        if hooks is not None:  # pushed on its thread's stack of hooks: only that thread can pop them
            self._stale_hooks[self._saved_hooks_thread] = hooks
        me = threading.get_ident()
        if me in self._stale_hooks:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is not None and top[0] == self._pack:  # another context may have popped it on its way out
                self._stale_hooks[me].__exit__(None, None, None)
            del self._stale_hooks[me]
        self._release_all()

    def _one_pass_at_a_time(self) -> None:
        """[Note: One pass at a time] Forward and backward share the holds, the
        running units and the step's trace: two threads running the model at
        once would release each other's parameters (a crash, or values from
        another tensor's memory). A forward started while another thread is in
        the model's forward, or in its backward, raises instead. A forward run
        by a backward (checkpointing, on autograd's own threads) is part of
        that pass. (A thread whose backward raised counts as in backward until
        it runs the model again.)"""
        if torch._C._current_graph_task_id() != -1:
            return
        me = threading.get_ident()
        if self._forward_thread not in (None, me):
            other, doing = self._forward_thread, "forward"
        elif self._callback_queued and self._backward_thread not in (None, me):
            other, doing = self._backward_thread, "backward"
        else:
            self._forward_thread = me
            self._forward_depth += 1
            return
        names = {t.ident: t.name for t in threading.enumerate()}
        raise OffloadedParameterError(
            f"the offloaded model was called from thread {names.get(me, me)!r} while thread "
            f"{names.get(other, other)!r} is in its {doing}: an offloaded model runs one forward or backward at a "
            f"time (its parameters are fetched into memory the running pass holds). Serialize the calls (a "
            f"threading.Lock around the forward and backward), or give each thread its own model")

    def _end_pass(self, module: nn.Module, args: Any, output: Any) -> None:
        """The model's forward returned (or raised): see [Note: One pass at a time]."""
        if self._forward_thread == threading.get_ident() and torch._C._current_graph_task_id() == -1:
            self._forward_depth -= 1
            if not self._forward_depth:
                self._forward_thread = None

    def _enter_forward(self, group: _Group) -> bool:
        """Push ``group`` on the running units; True when the forward runs inside backward."""
        # Traced by dynamo, or run eagerly inside a compiled region (where dynamo falls back to eager on this
        # hook's raise): either way parameters would be traced as graph constants or inputs, not fetched.
        if torch.compiler.is_compiling() or torch._C._dynamo.eval_frame.get_eval_frame_callback():
            raise OffloadedParameterError(
                f"torch.compile of an offloaded model, or of any of its modules ({group.name or 'the root'} "
                f"here), is not supported: its parameters are fetched by hooks as its modules run. Run it "
                f"eagerly; compile only code that takes no offloaded parameter (a loss function, say)")
        in_backward = self._in_backward()
        if not self._running and not in_backward and torch.is_grad_enabled() and self._saved_hooks is None:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
            self._saved_hooks_thread = threading.get_ident()
        self._running.append((group, in_backward))
        return in_backward

    def _viewed_by(self, output: Any) -> list[_Param]:
        """The held parameters that a tensor of ``output`` is a view of (see [Note: A forward output that is a
        view of a parameter])."""
        viewed = []
        for t in _leaves(output, torch.Tensor):
            sp = self._held_param_of(t)
            if sp is not None and t is not sp.param and sp not in viewed:
                viewed.append(sp)
        return viewed

    def _exit_forward(self, group: _Group) -> None:
        at = next((i for i in range(len(self._running) - 1, -1, -1) if self._running[i][0] is group), None)
        if at is not None:  # not at the top when a forward that raised inside an inner module left it there
            del self._running[at:]
        if not self._running:
            held, self._held_for_outputs = self._held_for_outputs, []
            for sp in held:
                if sp.holds:
                    self._unhold(sp)
        if not self._running and self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)

    def _held_param_of(self, t: torch.Tensor) -> _Param | None:
        """The held parameter whose memory ``t`` is (a view of), or None."""
        if not self._storage_owner or t.layout is not torch.strided:
            return None
        return self._storage_owner.get(t.untyped_storage().data_ptr())

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
            self._backward_hold(sp, self._unit_of(sp))
        data = sp.param.data
        return data.as_strided(saved.size, saved.stride, data.storage_offset() + saved.offset)

    def _group_keys(self) -> dict[str, list[tuple[str, int]]]:
        return {g.name: [(sp.key, TierPool.capacity_for(sp.nbytes)) for sp in g.params]
                for g in self.groups.values() if g.params}

    def _grad_of(self, param_key: str) -> tuple[str, int] | None:
        """The store key and bytes of the gradient kept for ``param_key`` (see [Note: Gradients in the tiers])."""
        sp = self._param_of_key.get(param_key)
        if sp is None:
            return None
        nbytes = sp.param.numel() * self.grads.dtype_of(sp.param).itemsize
        return grad_key(param_key), TierPool.capacity_for(nbytes)

    def _unit_of(self, sp: _Param) -> _Group:
        return self.groups[self._key_groups[sp.key][0]]

    def _use(self, group: _Group) -> None:
        if not group.params:
            return
        for name in self.policy.on_use(group.name, self.placer.clock()):
            for sp in self.groups[name].params:
                self.store.prefetch(sp.key, self.compute_tier)
                self.stats.prefetches_issued += 1

    def _hold(self, sp: _Param, group: _Group) -> None:
        sp.holds += 1
        if sp.holds == 1:
            t0 = time.perf_counter()
            # Under torch.inference_mode() the copy would be an inference tensor, and torch computes with one
            # differently (its eval outputs would round otherwise than the resident model's): it is made outside.
            try:
                with torch.inference_mode(False), torch._C.DisableTorchFunctionSubclass():
                    sp.param.data = sp.held = self.store.get(sp.key, self.compute_tier, sync_views=True)
            except BaseException:
                sp.holds -= 1  # not held: it still has no values
                raise
            sp.param.__class__ = sp.original_class  # see [Note: A held parameter is an ordinary one]
            sp.version = sp.param._version
            if sp.param.numel():
                self._storage_owner[sp.param.untyped_storage().data_ptr()] = sp
            by_group = self.stats.stall_seconds_by_group
            by_group[group.name] = by_group.get(group.name, 0.0) + time.perf_counter() - t0

    def _unhold(self, sp: _Param) -> None:
        sp.holds -= 1
        if sp.holds == 0:
            held, sp.held = sp.held, None
            assert held is not None
            assigned = not _same_memory(sp.param, held)
            # See [Note: A write while held] and [Note: A write through .data].
            if assigned or sp.param._version != sp.version or sp.written_through_data:
                self._keep_write(sp, held, assigned)
            self._storage_owner.pop(held.untyped_storage().data_ptr(), None)
            sp.param.data = sp.placeholder
            sp.param.__class__ = _OffloadedParameter
            # A view of it kept past the hold (see [Note: A freed buffer still viewed]) keeps its memory.
            self.store.release(sp.key, self.compute_tier, guard_views=True)

    def _keep_write(self, sp: _Param, held: torch.Tensor, assigned: bool) -> None:
        """The parameter was written while held, in place or (``assigned``) by assigning ``.data``: the store's
        copy gets the values, and is marked changed."""
        if assigned:
            value = sp.param.detach()
            if value.shape != held.shape or value.dtype != held.dtype:
                raise OffloadedParameterError(
                    f"{sp.name}.data was assigned a tensor of shape {tuple(value.shape)} and dtype {value.dtype} "
                    f"while its module ran; an offloaded parameter keeps its shape {tuple(held.shape)} and dtype "
                    f"{held.dtype} (write values of those in place, under torch.no_grad())")
            with torch.no_grad():
                held.copy_(value)
        self.store.mark_dirty(sp.key, self.compute_tier)

    def _backward_hold(self, sp: _Param, group: _Group) -> None:
        self._queue_end_backward()
        self._hold_in_backward(sp, group)
        sp.backward_hold = True

    def _hold_in_backward(self, sp: _Param, group: _Group) -> None:
        """A hold in backward, whose budget error says why backward holds what it does."""
        try:
            self._hold(sp, group)
        except TierBudgetError as e:
            total = sum(q.nbytes for q in self.params.values())
            raise TierBudgetError(
                f"{e}. In backward each offloaded parameter is held from its unit's backward until its gradient is "
                f"complete; a forward rerun there (activation checkpointing) holds its whole segment's parameters "
                f"until their gradients are complete, beside what backward holds (checkpoint smaller segments: "
                f"a layer each); when one loss sums several forwards of the model (two views of a batch, a siamese "
                f"pair), or a forward calls one module several times (a layer shared across depth, as ALBERT's), "
                f"a gradient is complete only when the backward of the earliest use reaches it, a "
                f"gradient differentiated again (create_graph=True: a gradient penalty) uses every parameter in "
                f"the second backward, and torch.autograd.grad(loss, parameters) accumulates no .grad, so each "
                f"parameter is held until that backward ends: up to every parameter ({total / 2**20:.1f} MiB) is "
                f"held at once. Call backward() on each forward's loss instead (gradients accumulate; step once), "
                f"or raise the {self.compute_tier.label} budget above that") from e

    def fetch_on_demand(self, sp: _Param) -> bool:
        """Hold ``sp`` for a read that its units' hooks did not foresee (see [Note: Reads of an offloaded
        parameter]); False when no forward or backward of the model is running to hold it for."""
        if self._running:
            group = self._running[-1][0]
            if group.learn(sp):  # held from now on by this unit's pre-hook, released by its post-hook
                self._key_groups[sp.key] = (*self._key_groups.get(sp.key, ()), group.name)
                self.policy.group_bytes[group.name] = group.nbytes
                self.stats.reads_learned += 1
            self._hold(sp, group)  # the unit's post-hook releases it, as it does its own
            if self._in_backward() and torch.is_grad_enabled() and not sp.backward_hold:
                self._backward_hold(sp, group)
            return True
        if self._in_backward():
            self._backward_hold(sp, self._unit_of(sp))
            return True
        return False

    def _pre_forward(self, group: _Group, module: nn.Module, args: Any) -> None:
        in_backward = self._enter_forward(group)
        self._use(group)
        for sp in group.params:
            if in_backward:
                self._hold_in_backward(sp, group)
            else:
                self._hold(sp, group)
            if in_backward and not sp.backward_hold and torch.is_grad_enabled():
                self._backward_hold(sp, group)  # a forward rerun inside backward (checkpointing)
        if self.store.timeline is not None:
            group.forward_started.append(time.perf_counter())

    def _post_forward(self, group: _Group, module: nn.Module, args: Any, output: Any) -> None:
        viewed = self._viewed_by(output) if self._storage_owner and not self._in_backward() else []
        outermost = bool(self._running) and self._running[0][0] is group
        for sp in group.params:
            if sp.holds:
                if sp in viewed and not outermost:
                    self._held_for_outputs.append(sp)
                else:
                    self._unhold(sp)
        if group.params and torch.is_grad_enabled() and not self._in_backward():
            for t in _leaves(output, torch.Tensor):
                if t.requires_grad:
                    t.register_hook(partial(self._pre_backward, group))
        self._exit_forward(group)
        timeline = self.store.timeline
        if timeline is not None and group.forward_started:
            timeline.add(f"forward {group.name or '<root>'}", "compute", group.forward_started.pop(),
                         time.perf_counter())
        if viewed and outermost:  # its holds are let go above: nothing is left held by the raise
            name = group.name or "the model"
            raise OffloadedParameterError(
                f"the forward of {name} returned a view of the offloaded parameter {viewed[0].name!r}; its memory is "
                f"reused once that forward returns, so the view would read other values. Return a copy "
                f"(.clone()), or call {name} inside the forward of a module that computes with its output")

    def _pre_backward(self, group: _Group, grad: torch.Tensor) -> None:
        """A hook on a forward output of ``group``: its gradient is about to be computed, so the unit's
        backward is next (see [Note: Backward without module backward hooks])."""
        if group.name in self._backward_used:
            return
        self._queue_end_backward()
        if not self._backward_used:
            self.policy.backward_starts()
        self._backward_used.add(group.name)
        self._use(group)
        for sp in group.params:
            if not sp.backward_hold:
                self._backward_hold(sp, group)
        if self.store.timeline is not None:
            group.backward_started = time.perf_counter()

    def _grad_accumulated(self, sp: _Param, param: torch.Tensor) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            grad = param.grad
            param.grad = None
        had = grad is not None
        if grad is not None:  # it leaves the compute tier as soon as it is complete
            if self.grad_ready_callbacks:  # an optimizer steps it now (see [Note: Stepping in backward])
                self.grads.hand_over(sp.key, grad)
            else:  # see [Note: Gradients in the tiers]
                self.grads.accumulate(sp.key, grad, sp.param.dtype)
            del grad
        if sp.backward_hold:
            sp.backward_hold = False
            self._unhold(sp)
        group = self._unit_of(sp)
        timeline = self.store.timeline
        if (timeline is not None and group.backward_started is not None
                and not any(p.backward_hold for p in group.params)):
            timeline.add(f"backward {group.name or '<root>'}", "compute", group.backward_started,
                         time.perf_counter())
            group.backward_started = None
        if had:
            for callback in self.grad_ready_callbacks:
                callback(sp.key)

    def _settle_failed_backward(self) -> None:
        """Release what a backward that raised still holds (the callback that ends a backward runs only when
        it completes)."""
        if self._callback_queued and torch._C._current_graph_task_id() == -1:
            self.backwards_failed += 1
            self._end_backward()

    def _end_backward(self) -> None:
        """Release every hold backward left.

        Besides parameters that got no gradient, non-reentrant checkpointing
        stops its forward rerun as soon as the tensors backward needs exist, so
        the forward post-hooks of the last modules of a rerun never fire. A
        backward may also run inside a forward (``torch.autograd.grad`` of a
        gradient penalty): the units whose forward runs on around it keep
        holding their parameters, one hold each, as their pre-hooks took them.
        """
        self._callback_queued = False
        self._steps.backward()
        self._backward_used.clear()
        self._running = [(group, rerun) for group, rerun in self._running if not rerun]
        outer = Counter(id(sp) for group, _ in self._running for sp in group.params)
        outer.update(id(sp) for sp in self._held_for_outputs)
        for sp in self.params.values():
            sp.backward_hold = False
            keep = outer[id(sp)]
            if sp.holds > keep:
                sp.holds = keep + 1
                self._unhold(sp)

    def _release_all(self) -> None:
        self._held_for_outputs.clear()
        for sp in self.params.values():
            sp.backward_hold = False
            if sp.holds:
                sp.holds = 1
                self._unhold(sp)

    def _before_load(self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict,
                     *_: Any) -> None:
        """[Note: Loading a state dict] ``model.load_state_dict()`` copies each value into its parameter with
        ``param.copy_(value)``. Before a module's own parameters are loaded, those that are offloaded and named in
        the state dict are held, so the copy writes the held copy; after the module's subtree is loaded they are
        marked changed and let go (``_after_load``, also when a submodule alone is loaded), to be written home.
        An ``OffloadedAdamW`` of the model then remakes the fp32 masters of those parameters from the loaded
        values (``on_load``), as a new optimizer would; its moments stay, as a torch optimizer's do when the model
        it steps loads a state dict (transformers' Trainer, resuming, loads the model, then the optimizer's
        state). Not with ``assign=True``."""
        mine = [self.params[id(p)] for name, p in module._parameters.items()
                if p is not None and id(p) in self.params and prefix + name in state_dict]
        if not mine:
            return
        if local_metadata.get("assign_to_params_buffers"):
            raise OffloadedParameterError("load_state_dict(assign=True) would replace offloaded parameters by "
                                          "new tensors; load with assign=False, or before offload_model")
        for sp in mine:
            self._hold(sp, self._unit_of(sp))
            self._loading.append(sp)

    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        """Every parameter held for loading has been copied by now (a module loads its own before its
        children's): mark them changed and let them go."""
        loading, self._loading = self._loading, []
        for sp in loading:
            self.store.mark_dirty(sp.key, self.compute_tier)
            self._unhold(sp)
        if loading:
            for loaded in self.on_load:
                loaded([sp.name for sp in loading])

    def _fill_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        """A module's state_dict post-hook: its own offloaded parameters' values (in place of placeholders)."""
        for pname, p in module._parameters.items():
            sp = self.params.get(id(p)) if p is not None else None
            if sp is not None and prefix + pname in state_dict:
                state_dict[prefix + pname] = self.store.read(sp.key)

    def __deepcopy__(self, memo: dict) -> OffloadedModel:
        raise TypeError(_NOT_COPYABLE)

    def __reduce_ex__(self, protocol: object) -> Any:
        raise TypeError(_NOT_COPYABLE)

    # ---- public ------------------------------------------------------------------------
    def read_param(self, name: str) -> torch.Tensor:
        """A copy (on CPU) of the parameter's current value, read from wherever it lives."""
        sp = next((sp for sp in self.params.values() if sp.name == name), None)
        if sp is None:
            if name in self.resident:
                return self.resident[name].detach().cpu().clone()
            raise KeyError(f"no parameter named {name!r}")
        return self.store.read(sp.key)

    def named_offloaded(self) -> Iterator[tuple[str, str, nn.Parameter]]:
        """(name, store key, parameter) of every offloaded parameter."""
        for sp in self.params.values():
            yield sp.name, sp.key, sp.param

    def units(self) -> dict[str, list[str]]:
        """Each unit that holds parameters (module name, ``""`` for the root) with the names of what its
        forward holds: its own parameters and those it was seen to read (see [Note: Units])."""
        return {g.name: [sp.name for sp in g.params] for g in self.groups.values() if g.params}

    def grads_in_order(self) -> list[torch.Tensor]:
        """The gradient of every parameter that has one, in ``model.parameters()`` order (tied ones once)."""
        out = []
        for p in self.model.parameters():
            sp = self.params.get(id(p))
            grad = p.grad if sp is None else self.grads.get(sp.key)
            if grad is not None:
                out.append(grad)
        return out

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
        if self.grad_ready_callbacks:
            raise RuntimeError("clip_grad_norm_ needs every gradient before any is stepped, but an optimizer steps "
                               "them during backward: use OffloadedAdamW(..., step_in_backward=False)")
        grads = self.grads_in_order()
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        holders = [SimpleNamespace(grad=g) for g in grads]  # what clip_grads_with_norm_ reads of a parameter
        torch.nn.utils.clip_grads_with_norm_(holders, max_norm, total, foreach)  # type: ignore[arg-type]
        return total

    @property
    def placement(self) -> Placement | None:
        """What stays in the host tier for the whole run and the bytes a step is predicted to move
        (``print(off.placement.summary())``): planned from a recorded step and kept where a measured step moved
        fewer bytes with it than without (``placement_verdict``); None before, when dropped, or with
        ``placement=False``."""
        return self.placer.placement

    @property
    def placement_verdict(self) -> str | None:
        """What the placement's trial measured and decided (None until it has)."""
        return self.placer.verdict

    def readahead_room(self) -> int | None:
        return self.placer.readahead_room()

    def in_forward_or_backward(self) -> bool:
        """Whether a forward or backward of the model holds parameters now (a checkpoint waits for the step)."""
        return any(sp.holds for sp in self.params.values())

    def held_beside_updates(self) -> dict[str, int]:
        """Offloaded parameter name -> host-tier bytes backward may hold while its update runs in backward:
        computing in the host tier, the largest other unit and the root's own parameters (held throughout)."""
        if self.compute_tier is not Tier.HOST:
            return {}
        units = sorted(((sum(TierPool.capacity_for(sp.nbytes) for sp in g.params), {sp.name for sp in g.params})
                        for gname, g in self.groups.items() if gname and g.params), key=lambda u: -u[0])
        root = {sp.name: TierPool.capacity_for(sp.nbytes) for sp in self.groups[""].params} if "" in self.groups \
            else {}
        root_bytes = sum(root.values())
        return {sp.name: next((nbytes for nbytes, names in units if sp.name not in names), 0)
                + root_bytes - root.get(sp.name, 0) for sp in self.params.values()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient, or with ``set_to_none=False`` zero them in place as torch does: a parameter
        that then gets no gradient from the next backward is stepped with zeros (its moments decay, weight decay
        applies), as a resident model's would be."""
        self._settle_failed_backward()
        if set_to_none:
            self.grads.clear()
        else:
            self.grads.zero()
        zero_grads(self.resident.values(), set_to_none)

    def remove(self) -> None:
        """Detach from the module: parameters get their current values back as ordinary tensors, and the state of
        an optimizer of it leaves the store."""
        for sp in self.params.values():
            if sp.holds:
                raise RuntimeError(f"cannot remove offload while {sp.name!r} is in use (inside forward/backward)")
        for drop in self.on_remove:  # an optimizer of this model drops its state
            drop()
        self.on_remove.clear()
        self.grad_ready_callbacks.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.grads.clear()
        self.store.remove_victim_order(self._victim_token)
        self.placer.close()
        for sp in self.params.values():
            value = self.store.read(sp.key).to(self.compute_device)
            sp.param.__class__ = sp.original_class
            del sp.param._tierstore
            sp.param.data = value
            self.store.drop(sp.key)
        self.params.clear()
        delattr(self.model, _STATE_KEY)


class _WrappedForward:
    """A unit's pre- and post-forward around its module's ``forward`` instead of as hooks (for ``_HOOK_SHY``
    modules), or with no unit the model's forward, which clears a pass stopped by Ctrl-C (see [Note: A forward
    stopped by Ctrl-C]); ``remove()`` undoes it, as a hook's handle does."""

    def __init__(self, module: nn.Module, owner: OffloadedModel, group: _Group | None) -> None:
        self.module, self.previous = module, module.__dict__.get("forward")
        forward = module.forward

        @functools.wraps(forward)
        def held_forward(*args: Any, **kwargs: Any) -> Any:
            if group is not None:
                owner._pre_forward(group, module, args)
            output = None
            try:
                output = forward(*args, **kwargs)
            except BaseException as e:
                if group is None and not isinstance(e, Exception):  # the model's own: a unit's ends in finally
                    owner._stopped_by_interrupt()
                raise
            finally:
                if group is not None:
                    owner._post_forward(group, module, args, output)
            return output

        module.forward = held_forward

    def remove(self) -> None:
        if self.previous is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.previous


def _present_ordinary(params: list[_Param], start: bool, module: nn.Module, *_: Any) -> None:
    """A forward pre-hook (``start``) and post-hook of an ``nn.TransformerEncoder`` whose first layer is a wrapped
    unit (see [Note: A held parameter is an ordinary one])."""
    for sp in params:
        if not sp.holds:
            sp.param.__class__ = sp.original_class if start else _OffloadedParameter


def _unit_modules(model: nn.Module, units: Sequence[type[nn.Module] | nn.Module | str]) -> dict[str, bool]:
    """Module name -> True for a unit's root, False for a module inside a unit (see [Note: Units])."""
    classes, ids, names = [], set(), set()
    modules = dict(model.named_modules())
    for u in units:
        if isinstance(u, type) and issubclass(u, nn.Module):
            classes.append(u)
        elif isinstance(u, nn.Module):
            if not any(m is u for m in modules.values()):
                raise ValueError(f"units: the {type(u).__name__} given is not a module of this model")
            ids.add(id(u))
        elif isinstance(u, str):
            if u not in modules:
                raise ValueError(f"units: the model has no module named {u!r} (names as in model.named_modules())")
            names.add(u)
        else:
            raise TypeError(f"units: each unit is an nn.Module class, a module of the model or a module name, "
                            f"not {type(u).__name__}")
    out: dict[str, bool] = {}
    inside: list[str] = []
    for mname, module in modules.items():
        if any(p == "" or mname.startswith(p + ".") for p in inside):
            out[mname] = False
        elif isinstance(module, tuple(classes)) or id(module) in ids or mname in names:
            out[mname] = True
            inside.append(mname)
    return out


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


def _placeholder(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What a parameter's ``.data`` is while nobody holds it: its shape, dtype and device with no storage
    (see [Note: Reads of an offloaded parameter])."""
    strides = dense_strides(p) or contiguous_strides(p.shape)  # those of the store's copy
    return torch.Tensor._make_wrapper_subclass(_NoStorage, p.shape, strides=strides, dtype=p.dtype, device=device)


def offload_model(model: nn.Module, store: TierStore, *, prefetch_depth: int | str | None = None,
                  prefetch_bytes: int | None = None, resident_threshold_bytes: int | None = None,
                  home: Tier | str | None = None, compute_tier: Tier | str | None = None,
                  units: Sequence[type[nn.Module] | nn.Module | str] = DEFAULT_UNITS,
                  init_fn: Callable[[nn.Module], None] | None = None, placement: bool = True,
                  real_parameters: str | None = None, grad_tier: Tier | str | None = None,
                  grad_dtype: str = "float32") -> OffloadedModel:
    """Move ``model``'s parameters into ``store`` and fetch them just in time.

    Defaults come from ``store.config`` (prefetch_depth, prefetch_bytes,
    resident_threshold_bytes, param_tier). ``compute_tier`` is where
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
    ``prefetch_depth="auto"`` (the store config's default) chooses the depth
    each step from the measured drive rate and compute time per unit. With
    ``placement`` (the default), once a step has been recorded the parameters
    and optimizer state that save the most drive traffic stay in the host
    tier for the whole run and the rest stream (see ``off.placement``).
    Gradients kept from backward to the optimizer's step are tensors of the
    store (see [Note: Gradients in the tiers]): their home is ``grad_tier``
    (the store config's ``grad_tier``, else its ``optimizer_tier``), and a
    bf16/fp16 parameter's is kept in fp32 unless ``grad_dtype="param"``.
    Parameter names and state_dict keys are unchanged;
    :meth:`OffloadedModel.remove` undoes it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload_model needs an nn.Module, not {type(model).__name__}")
    if hasattr(model, _STATE_KEY):
        raise ValueError("this module is already offloaded; call .remove() on its OffloadedModel first")
    cfg = store.config
    if compute_tier is not None and Tier.parse(compute_tier) is Tier.NVME:
        raise ValueError("compute_tier='nvme': modules run on memory; choose 'device' or 'host'")
    check_options(prefetch_depth, placement)
    check_grad_dtype(grad_dtype)  # before anything is written
    scripted = [name or "the model" for name, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        raise TypeError(
            f"{scripted[0]!r} is a TorchScript module (torch.jit.script or torch.jit.trace): its forward runs in "
            "TorchScript, where no hook runs to fetch an offloaded parameter. Offload the eager module, and script "
            "it for inference after training")
    state = OffloadedModel(
        model, store,
        prefetch_depth=cfg.prefetch_depth if prefetch_depth is None else prefetch_depth,
        prefetch_bytes=cfg.prefetch_bytes if prefetch_bytes is None else prefetch_bytes,
        resident_threshold_bytes=(cfg.resident_threshold_bytes if resident_threshold_bytes is None
                                  else resident_threshold_bytes),
        home=Tier.parse(home if home is not None else cfg.param_tier),
        compute_tier=(Tier.parse(compute_tier) if compute_tier is not None
                      else Tier.DEVICE if store.device.type != "cpu" else Tier.HOST),
        units=units,
        init_fn=init_fn,
        placement=placement,
        real_parameters=real_parameters,
        grad_tier=Tier.parse(grad_tier) if grad_tier is not None else None,
        grad_dtype=grad_dtype,
    )
    setattr(model, _STATE_KEY, state)
    return state
