"""Single-process model offload: parameters live in a TierStore and are fetched
just in time for the forward and the backward of each submodule.

[Note: Holding a parameter] A parameter's ``.data`` is its store copy in the
device tier while anyone holds it and a placeholder otherwise (one NaN with
the parameter's shape and zero strides: see :func:`_placeholder`). Holds
are counted: one per forward of a module that owns it (released by the
forward post-hook) and at most one for backward (taken by the module's
backward pre-hook, released when its gradient has been accumulated, or at the
end of the backward pass for parameters that get no gradient). Counting makes
a module called twice, tied parameters and activation checkpointing (which
reruns forward inside backward) all work with no special cases.

[Note: Saved views of parameters] Autograd saves some tensors that alias a
parameter's storage -- ``F.linear`` saves ``weight.t()``, a view -- and a
view keeps the storage the parameter had in forward, not the one it gets back
for backward. Since the store reuses device buffers, such a view would read
another tensor's bytes in backward. So while the wrapped module runs forward,
saved-tensor hooks replace every saved tensor that aliases a held parameter
by (parameter, size, stride, offset), rebuilt in backward from the
parameter's current copy (held on demand). Inside backward (a checkpointed
forward rerun) the saved views are kept by checkpointing itself, so a module
rerun there keeps its parameters held until their gradients are accumulated.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tierstore import Tier, TierStore
from tierstore._schedule import LaterUses, PrefetchPolicy, group_victim_order

_STATE_KEY = "_tierstore_offload"
_NOT_COPYABLE = ("an offloaded model cannot be copied or pickled: its parameters live in the store and its module "
                 "holds placeholders. Copy it before offload_model, call .remove() first, or save it with "
                 "state_dict() (which reads the real values) or save_checkpoint()")

# Our backward pre-hooks need only the gradient of a module's output, so this
# notice (the first module's input never requires grad) says nothing to act on.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                        "respect to module outputs", category=UserWarning)


@dataclass(eq=False)
class _Param:
    name: str
    key: str
    param: nn.Parameter
    placeholder: torch.Tensor
    nbytes: int
    holds: int = 0
    backward_hold: bool = False


@dataclass(frozen=True, eq=False)
class _SavedView:
    """A saved tensor that aliased a held parameter, as its geometry (see [Note: Saved views of parameters])."""

    param: _Param
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset relative to the parameter's own


@dataclass(eq=False)
class _Group:
    name: str
    params: list[_Param]
    nbytes: int
    forward_started: list[float] = field(default_factory=list)  # a stack: a module may be re-entered
    backward_started: float | None = None


@dataclass
class OffloadStats:
    """Per-step figures of the hooks (the store keeps its own counters)."""

    stall_seconds_by_group: dict[str, float] = field(default_factory=dict)
    prefetches_issued: int = 0


class OffloadedModel:
    """The offload state of one module; returned by :func:`offload_model` and kept on the module."""

    def __init__(self, model: nn.Module, store: TierStore, *, prefetch_depth: int, prefetch_bytes: int | None,
                 resident_threshold_bytes: int, home: Tier, compute_tier: Tier) -> None:
        self.model = model
        self.store = store
        self.home = home
        self.compute_tier = compute_tier
        self.compute_device = store.device if compute_tier is Tier.DEVICE else torch.device("cpu")
        self.params: dict[int, _Param] = {}
        self.resident: dict[str, nn.Parameter] = {}
        self.groups: dict[str, _Group] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.stats = OffloadStats()
        self._handles: list[Any] = []
        self._callback_queued = False
        # Called with a store key once that parameter's gradient for this backward is complete.
        self.grad_ready_callbacks: list[Callable[[str], None]] = []
        # An optimizer's uses of store keys, which eviction weighs with the trace's.
        self.later_uses = LaterUses()
        self._storage_owner: dict[int, _Param] = {}  # data_ptr of a held copy's storage -> its parameter
        self._saved_hooks: Any = None
        handles = []
        for name, p in model.named_parameters():  # shared parameters appear once
            nbytes = p.numel() * p.element_size()
            if nbytes < resident_threshold_bytes:
                self.resident[name] = p
                continue
            key = f"param/{name}"
            handles.append(store.put(key, p.detach().contiguous(), home=home))
            self.params[id(p)] = _Param(name, key, p, _placeholder(p, self.compute_device), nbytes)
        for h in handles:
            h.wait()
        for sp in self.params.values():
            sp.param.data = sp.placeholder
        for mname, module in model.named_modules():
            owned = [self.params[id(p)] for p in module._parameters.values()
                     if p is not None and id(p) in self.params]
            if not owned:
                continue
            group = _Group(mname, owned, sum(sp.nbytes for sp in owned))
            self.groups[mname] = group
            self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(group)))
            self._handles.append(module.register_forward_hook(self._make_post_forward(group)))
            self._handles.append(module.register_full_backward_pre_hook(self._make_pre_backward(group)))
        self._handles.append(model.register_forward_pre_hook(self._start_step, prepend=True))
        self._handles.append(model.register_forward_hook(self._end_forward, always_call=True))
        for sp in self.params.values():
            if sp.param.requires_grad:
                self._handles.append(sp.param.register_post_accumulate_grad_hook(self._make_grad_hook(sp)))
        def state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            self._fill_state_dict(state_dict, prefix)

        self._handles.append(model.register_state_dict_post_hook(state_dict_hook))
        # Until a step has been recorded, guess that forward uses the modules in definition order.
        self.policy = PrefetchPolicy(depth=prefetch_depth, max_bytes=prefetch_bytes,
                                     group_bytes={g.name: g.nbytes for g in self.groups.values()},
                                     trace=list(self.groups))
        self._key_group = {}
        for g in self.groups.values():
            for sp in g.params:
                self._key_group.setdefault(sp.key, g.name)
        store.set_victim_order(group_victim_order(self.policy, self._key_group, self.later_uses))

    # ---- hooks -------------------------------------------------------------------------
    def _start_step(self, module: nn.Module, args: Any) -> None:
        if not self._callback_queued:  # not a forward rerun inside backward (checkpointing)
            self._release_all()  # holds left by a forward that raised
            self.policy.start_step()
        if torch.is_grad_enabled() and self._saved_hooks is None:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()

    def _end_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._storage_owner or t.layout is not torch.strided:
            return t
        sp = self._storage_owner.get(t.untyped_storage().data_ptr())
        if sp is None:
            return t
        if t.dtype != sp.param.dtype:
            return t.clone()  # a reinterpreting view: keep its bytes
        return _SavedView(sp, tuple(t.size()), tuple(t.stride()), t.storage_offset() - sp.param.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedView):
            return saved
        sp = saved.param
        if not sp.backward_hold:  # used in backward before its module's backward pre-hook
            sp.backward_hold = True
            self._hold(sp, self.groups[self._key_group[sp.key]])
        data = sp.param.data
        return data.as_strided(saved.size, saved.stride, data.storage_offset() + saved.offset)

    def _use(self, group: _Group) -> None:
        for name in self.policy.on_use(group.name):
            for sp in self.groups[name].params:
                self.store.prefetch(sp.key, self.compute_tier)
                self.stats.prefetches_issued += 1

    def _hold(self, sp: _Param, group: _Group) -> None:
        sp.holds += 1
        if sp.holds == 1:
            t0 = time.perf_counter()
            sp.param.data = self.store.get(sp.key, self.compute_tier)
            if sp.param.numel():
                self._storage_owner[sp.param.untyped_storage().data_ptr()] = sp
            by_group = self.stats.stall_seconds_by_group
            by_group[group.name] = by_group.get(group.name, 0.0) + time.perf_counter() - t0

    def _unhold(self, sp: _Param) -> None:
        sp.holds -= 1
        if sp.holds == 0:
            self._storage_owner.pop(sp.param.untyped_storage().data_ptr(), None)
            sp.param.data = sp.placeholder
            self.store.release(sp.key, self.compute_tier)

    def _make_pre_forward(self, group: _Group):
        def hook(module: nn.Module, args: Any) -> None:
            self._use(group)
            for sp in group.params:
                self._hold(sp, group)
                if self._callback_queued and not sp.backward_hold and torch.is_grad_enabled():
                    sp.backward_hold = True  # a forward rerun inside backward (checkpointing)
                    self._hold(sp, group)
            if self.store.timeline is not None:
                group.forward_started.append(time.perf_counter())
        return hook

    def _make_post_forward(self, group: _Group):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for sp in group.params:
                self._unhold(sp)
            timeline = self.store.timeline
            if timeline is not None and group.forward_started:
                timeline.add(f"forward {group.name or '<root>'}", "compute", group.forward_started.pop(),
                             time.perf_counter())
        return hook

    def _make_pre_backward(self, group: _Group):
        def hook(module: nn.Module, grad_output: Any) -> None:
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._use(group)
            for sp in group.params:
                if not sp.backward_hold:
                    sp.backward_hold = True
                    self._hold(sp, group)
            if self.store.timeline is not None:
                group.backward_started = time.perf_counter()
        return hook

    def _make_grad_hook(self, sp: _Param):
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            param.grad = None
            if grad is not None:
                # Gradients leave the device tier as soon as they are complete.
                host = grad.detach().to("cpu", copy=grad.device.type != "cpu")
                prev = self.grads.get(sp.key)
                self.grads[sp.key] = host if prev is None else prev.add_(host)
            if sp.backward_hold:
                sp.backward_hold = False
                self._unhold(sp)
            group = self.groups.get(self._key_group.get(sp.key))  # type: ignore[arg-type]
            timeline = self.store.timeline
            if (timeline is not None and group is not None and group.backward_started is not None
                    and not any(p.backward_hold for p in group.params)):
                timeline.add(f"backward {group.name or '<root>'}", "compute", group.backward_started,
                             time.perf_counter())
                group.backward_started = None
            if grad is not None:
                for callback in self.grad_ready_callbacks:
                    callback(sp.key)
        return hook

    def _end_backward(self) -> None:
        """Release every hold left at the end of backward.

        Besides parameters that got no gradient, non-reentrant checkpointing
        stops its forward rerun as soon as the tensors backward needs exist, so
        the forward post-hooks of the last modules of a rerun never fire.
        """
        self._callback_queued = False
        self._release_all()

    def _release_all(self) -> None:
        for sp in self.params.values():
            sp.backward_hold = False
            if sp.holds:
                sp.holds = 1
                self._unhold(sp)

    def _fill_state_dict(self, state_dict: dict, prefix: str) -> None:
        for name, p in self.model.named_parameters(remove_duplicate=False):  # tied names too
            sp = self.params.get(id(p))
            if sp is not None and prefix + name in state_dict:
                state_dict[prefix + name] = self.store.read(sp.key)

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

    def zero_grad(self) -> None:
        self.grads.clear()
        for p in self.resident.values():
            p.grad = None

    def remove(self) -> None:
        """Detach from the module: parameters get their current values back as ordinary tensors."""
        self.grad_ready_callbacks.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.store.set_victim_order(None)
        for sp in self.params.values():
            if sp.holds:
                raise RuntimeError(f"cannot remove offload while {sp.name!r} is in use (inside forward/backward)")
            sp.param.data = self.store.read(sp.key).to(self.compute_device)
            self.store.drop(sp.key)
        self.params.clear()
        delattr(self.model, _STATE_KEY)


def _placeholder(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What a parameter's ``.data`` is while nobody holds it: one NaN seen through the parameter's shape (strides
    0), so ``p.shape``, ``p.ndim`` and ``p.numel()`` stay true at no memory cost and a stray read gives NaN."""
    fill = float("nan") if p.dtype.is_floating_point or p.dtype.is_complex else 0
    return torch.full((), fill, dtype=p.dtype, device=device).expand(p.shape)


def offload_model(model: nn.Module, store: TierStore, *, prefetch_depth: int | None = None,
                  prefetch_bytes: int | None = None, resident_threshold_bytes: int | None = None,
                  home: Tier | str | None = None, compute_tier: Tier | str | None = None) -> OffloadedModel:
    """Move ``model``'s parameters into ``store`` and fetch them just in time.

    Defaults come from ``store.config`` (prefetch_depth, prefetch_bytes,
    resident_threshold_bytes, param_tier). ``compute_tier`` is where
    parameters are held while their module runs: the device tier with CUDA;
    without it the host tier, since both would be CPU memory and a second copy
    would only cost bandwidth and budget (pass "device" to use it anyway).
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
    state = OffloadedModel(
        model, store,
        prefetch_depth=cfg.prefetch_depth if prefetch_depth is None else prefetch_depth,
        prefetch_bytes=cfg.prefetch_bytes if prefetch_bytes is None else prefetch_bytes,
        resident_threshold_bytes=(cfg.resident_threshold_bytes if resident_threshold_bytes is None
                                  else resident_threshold_bytes),
        home=Tier.parse(home if home is not None else cfg.param_tier),
        compute_tier=(Tier.parse(compute_tier) if compute_tier is not None
                      else Tier.DEVICE if store.device.type != "cpu" else Tier.HOST),
    )
    setattr(model, _STATE_KEY, state)
    return state
