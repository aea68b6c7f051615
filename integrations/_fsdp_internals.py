"""Every private detail of FSDP2 (``torch.distributed.fsdp.fully_shard``) tierstore relies on, in one place.

FSDP2's public API has ``unshard()`` and the prefetch setters, but no hook
that runs before an all-gather reads a parameter group's local shards,
whichever of forward, backward or a prefetch asked for it. So we wrap two
methods of each ``FSDPParamGroup`` object (not the class): ``unshard``
(before it, the shards are made resident), ``wait_for_unshard`` (after
it, the all-gather has consumed them and they are freed again) and
``post_backward`` (after it, the group's sharded gradients exist, so the
optimizer may step them while backward goes on). Tested with
the torch versions in ``TESTED_TORCH``; others fail with a clear message
unless ``allow_untested_torch=True``.

What is used, all present and exercised by the suite on torch 2.13.0,
2.14.1 and 2.15.0 (``bash .ci/run newest`` runs it on the newest release):
- ``FSDPModule._get_fsdp_state()._fsdp_param_group``: a module's param group;
- ``FSDPParamGroup``: ``fsdp_params``, ``unshard``, ``wait_for_unshard``,
  ``post_backward`` (wrapped per object), ``_all_gather_result``,
  ``is_unsharded``, ``_use_post_forward_mesh``, ``_post_reduce_event``,
  ``reduce_grads`` (``set_requires_gradient_sync``'s flag, read only);
- ``FSDPParam``: ``sharded_param``, ``offload_to_cpu``, and for a model built
  on the meta device ``reset_sharded_param()``, ``_sharded_param_data``,
  ``_sharding_spec``;
- ``DTensor._local_tensor``: the view of the padded shard that is freed and
  restored by resizing its storage (see [Note: Freeing a shard]);
- for a layer-major step (``HeldGathers``, see [Note: Layer by layer on FSDP2
  ranks]): ``FSDPState._lazy_init``, ``_state_ctx`` (``all_states``,
  ``is_last_backward``), ``_fsdp_param_groups``,
  ``_states_to_forward_prefetch`` / ``_states_to_backward_prefetch``,
  ``_root_post_backward_final_callback``, ``_reset_iter_state`` (where the
  public ``reset_iter_state`` is missing); ``FSDPParamGroup``:
  ``reduce_grads``, ``all_reduce_grads``, ``reshard_after_backward``,
  ``post_forward_mesh_info``, ``post_forward`` and ``_backward_prefetch``
  (replaced per object for the step), ``reshard``, ``_training_state``,
  ``modules``; ``FSDPParam``: ``unsharded_param``,
  ``unsharded_accumulated_grad``, ``_param_fqn``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from tierstore import TierStoreError, TierValueError

TESTED_TORCH = ("2.13", "2.14", "2.15")


def check_torch_version(allow_untested: bool) -> None:
    version = torch.__version__.split("+")[0]
    if not allow_untested and not any(version == v or version.startswith(v + ".") for v in TESTED_TORCH):
        raise TierStoreError(
            f"tierstore's FSDP2 integration uses FSDP2 internals tested with torch {', '.join(TESTED_TORCH)}; "
            f"this is torch {torch.__version__}. Pass allow_untested_torch=True to try it anyway "
            "(and compare against a run without offload)."
        )


def fsdp_groups(model: nn.Module) -> Iterator[tuple[str, nn.Module, Any]]:
    """(module name, FSDP module, its FSDPParamGroup) for every fully_shard-ed module that has parameters."""
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                yield name, module, group


def group_params(group: Any) -> list[nn.Parameter]:
    """The sharded parameters (DTensors) of a param group."""
    return [fp.sharded_param for fp in group.fsdp_params]


def check_group_supported(name: str, group: Any) -> None:
    for fp in group.fsdp_params:
        if fp.offload_to_cpu:
            raise TierValueError(f"FSDP module {name or '<root>'!r} uses CPUOffloadPolicy; tierstore replaces it "
                                 "(host and NVMe tiers): apply fully_shard without offload_policy")
    if group._use_post_forward_mesh:
        raise TierValueError(f"FSDP module {name or '<root>'!r} reshards after forward to a smaller mesh "
                             "(reshard_after_forward=int), which tierstore does not support; use True or False")


def local_shard(param: nn.Parameter) -> torch.Tensor:
    """The rank's local shard of a sharded parameter; its storage is the padded shard FSDP all-gathers from."""
    return getattr(param, "_local_tensor")  # DTensor's, private: checked against torch's version here


def with_local(dtensor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor like ``dtensor`` (mesh, placements, global shape) whose local tensor is ``local``."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, getattr(dtensor, "_spec"), requires_grad=False)  # DTensor's own, private


def shard_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor placed as sharded ``param`` is (mesh, placements, global shape), whose local tensor is ``local``
    (of the parameter's local shape, any dtype): a piece of its optimizer state."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def dim0_shards(param: torch.Tensor) -> tuple[int, int, int] | None:
    """(ranks, this rank's place, rows a rank holds at most) of a parameter sharded on dim 0 alone, as FSDP2
    shards (``Shard(0)`` on one mesh dimension, ``Replicate`` on any other); None otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    dims = [i for i, pl in enumerate(param.placements) if isinstance(pl, Shard)]
    if len(dims) != 1 or param.placements[dims[0]] != Shard(0) or not all(
            isinstance(pl, Replicate) for i, pl in enumerate(param.placements) if i != dims[0]) or param.dim() == 0:
        return None
    ranks = param.device_mesh.size(dims[0])
    return ranks, param.device_mesh.get_local_rank(dims[0]), -(-param.shape[0] // ranks)


def rows_of_ranks(param: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """``row`` (this rank's, of shape (1, length)) as row r of a (ranks, length) DTensor placed as ``param``'s
    dim-0 shards (see :func:`dim0_shards`): a piece of a shard's state with no shape of the parameter's, saved so
    that each rank's row is its own."""
    from torch.distributed.tensor import DTensor

    ranks, length = dim0_shards(param)[0], row.shape[1]
    return DTensor.from_local(row, param.device_mesh, param.placements, run_check=False, shape=(ranks, length),
                              stride=(length, 1))


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (what FSDP2's state dicts hold). Imports nothing: where torch's DTensor module
    was never imported (tens of MiB), no tensor is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def fsdp_params_by_id(model: nn.Module) -> dict[int, Any]:
    """id of each sharded parameter (DTensor) -> its ``FSDPParam``, over every fully_shard-ed module."""
    return {id(fp.sharded_param): fp for _, _, group in fsdp_groups(model) for fp in group.fsdp_params}


def adopt_local_tensor(fsdp_param: Any) -> Callable[[], None]:
    """After the sharded parameter's local tensor was replaced (a meta shard given memory, as ``to_empty``
    does), have FSDP2 pad it and read from it; returns a function that puts back what FSDP2 held before."""
    before = fsdp_param._sharded_param_data, fsdp_param._sharding_spec

    def undo() -> None:
        fsdp_param._sharded_param_data, fsdp_param._sharding_spec = before

    fsdp_param.reset_sharded_param()
    return undo


def wrap_group(group: Any, before_unshard: Callable[[], None], after_wait: Callable[[], None],
               after_post_backward: Callable[[bool], None]) -> Callable[[], None]:
    """Run ``before_unshard`` before the group's all-gather reads its shards, ``after_wait`` once it
    has, and ``after_post_backward(reduced)`` once its post-backward has run: ``reduced`` when it reduce-scattered
    gradients, whose shards are then assigned (see :func:`wait_for_gradients`); returns a function that removes the
    wrappers."""
    unshard, wait, post_backward = group.unshard, group.wait_for_unshard, group.post_backward

    def wrapped_unshard(async_op: bool = False) -> None:
        if group._all_gather_result is None and not group.is_unsharded:
            before_unshard()
        return unshard(async_op)

    def wrapped_wait() -> None:
        wait()
        after_wait()

    def wrapped_post_backward(*args: Any) -> None:
        reduces = will_reduce(group)
        post_backward(*args)
        after_post_backward(reduces)

    group.unshard, group.wait_for_unshard, group.post_backward = wrapped_unshard, wrapped_wait, wrapped_post_backward

    def remove() -> None:
        del group.unshard, group.wait_for_unshard, group.post_backward  # back to the class's methods

    return remove


def syncs_gradients(group: Any) -> bool:
    """Whether the group's post-backward reduce-scatters its gradients (``set_requires_gradient_sync``'s flag:
    False keeps the unsharded gradients, accumulated, until a backward that syncs)."""
    return bool(getattr(group, "reduce_grads", True))


def will_reduce(group: Any) -> bool:
    """Whether the group's post-backward, run now, reduce-scatters: gradient sync is on and an unsharded gradient
    is there to reduce (FSDP2 calls it again, with nothing to reduce, for a group whose hook did not run)."""
    if not syncs_gradients(group):
        return False
    if getattr(group, "reduce_scatter_unused_params", False):
        return True
    return any(fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None
               for fp in group.fsdp_params if hasattr(fp, "_unsharded_param"))


def wait_for_gradients(group: Any) -> None:
    """Block until the reduce-scatter that produced the group's sharded gradients has finished (on CUDA it
    runs on FSDP2's own stream; on the CPU it already has)."""
    event = getattr(group, "_post_reduce_event", None)
    if event is not None:
        event.synchronize()


def _no_prefetch(*args: Any) -> None:
    return None


def _held_post_forward(group: Any, module: nn.Module, args: Any, output: Any) -> Any:
    """A group's post-forward that keeps it unsharded: as in forward, whatever the group's state (a micro-batch's
    backward between another's pre- and post-forward left it idle, where post-forward would reshard)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    group._training_state = TrainingState.FORWARD
    return type(group).post_forward(group, module, args, output)


def _unsharded_grad_mark(fp: Any) -> tuple[int, int] | None:
    """What changes as a part is added to an FSDP parameter's unsharded gradient (None: it has none)."""
    grad = fp.unsharded_param.grad if hasattr(fp, "_unsharded_param") else None
    grad = fp.unsharded_accumulated_grad if grad is None else grad
    return None if grad is None else (id(grad), grad._version)


class _UnshardedGrads:
    """A tied parameter's gradient as a layer-major step sums its parts on FSDP2 (see [Note: Tied parameters on
    FSDP2 ranks] in fsdp.py): FSDP2's unsharded gradient, by store key. Autograd accumulates each part the hook
    returns, so ``accumulate`` adds nothing itself."""

    def __init__(self, by_key: dict[str, Any]) -> None:
        self.by_key = by_key

    def get(self, key: str) -> torch.Tensor | None:
        fp = self.by_key[key]
        return fp.unsharded_param.grad if hasattr(fp, "_unsharded_param") else None

    def accumulate(self, key: str, grad: torch.Tensor, dtype: torch.dtype) -> None:
        pass

    def dtype_of(self, param: torch.Tensor) -> torch.dtype:
        """The dtype of ``param``'s (a sharded parameter's) unsharded gradient: its unsharded parameter's."""
        return next(fp for fp in self.by_key.values() if fp.sharded_param is param).unsharded_param.dtype


@dataclass
class _UserLevers:
    """A group's levers as the user left them (``set_requires_gradient_sync``, ``set_reshard_after_backward``,
    ``reshard_after_forward``'s mesh)."""

    reduce: bool
    all_reduce: bool
    reshard: bool
    mesh: Any

    @classmethod
    def of(cls, g: Any) -> _UserLevers:
        return cls(g.reduce_grads, g.all_reduce_grads, g.reshard_after_backward, g.post_forward_mesh_info)

    def put_back(self, g: Any) -> None:
        """Sync and resharding after backward as the user left them (the mesh goes back at the step's end)."""
        g.reduce_grads, g.all_reduce_grads, g.reshard_after_backward = self.reduce, self.all_reduce, self.reshard


class HeldGathers:
    """FSDP2's levers set for one layer-major step of ``model`` (the root ``fully_shard``-ed module) through
    ``segments`` (each a ``fully_shard``-ed module of one group), and set back after it (see [Note: Layer by layer
    on FSDP2 ranks]). The root's unsharded gradient holds the glue's parts, which the kept gradients do not show:
    glue between segments is not ordered (``orders_glue_between``), and the root's parts are checked
    (``mixed``)."""

    orders_glue_between = False

    def __init__(self, model: nn.Module, segments: list[nn.Module], tied: dict[int, str] | None = None,
                 on_part: Callable[[str, torch.Tensor], bool] | None = None) -> None:
        """``tied``: id of each tied sharded parameter -> its store key, whose parts ``on_part(key, grad)`` takes
        (the step's ``takes_part``) from a hook on its unsharded parameter."""
        self.model = model
        self.root = model._get_fsdp_state()
        self.root._lazy_init()  # as the first forward does: which state is the root, its group held after forward
        self.states = list(self.root._state_ctx.all_states)
        self.groups = [g for s in self.states for g in s._fsdp_param_groups]
        self.of_segment = [m._get_fsdp_state()._fsdp_param_group for m in segments]
        self.saved: dict[int, _UserLevers] = {}  # id of each group -> its levers as the user left them
        self.prefetches: list[tuple[Any, list, list]] = []
        self.last_backward = True
        self.before_glue: list[tuple[Any, tuple[int, int] | None]] = []
        tied = tied or {}
        self.tied = {tied[id(fp.sharded_param)]: fp for g in self.groups for fp in g.fsdp_params
                     if id(fp.sharded_param) in tied}
        self.tied_grads = _UnshardedGrads(self.tied) if self.tied else None
        self.on_part = on_part
        self.part_hooks: list[Any] = []

    def begin(self) -> None:
        """No group reshards after forward or backward, reduce-scatters or prefetches, and no backward is the
        step's last, until told."""
        self.saved = {id(g): _UserLevers.of(g) for g in self.groups}
        self.prefetches = [(s, s._states_to_forward_prefetch, s._states_to_backward_prefetch) for s in self.states]
        self.last_backward = self.root._state_ctx.is_last_backward
        for g in self.groups:
            g.reduce_grads = g.all_reduce_grads = g.reshard_after_backward = False
            g.post_forward_mesh_info = None
            g._backward_prefetch = _no_prefetch  # it would all-gather the group the forward order put before
            g.post_forward = partial(_held_post_forward, g)
        for s in self.states:
            s._states_to_forward_prefetch, s._states_to_backward_prefetch = [], []
        self.root._state_ctx.is_last_backward = False

    def forward_passed(self, k: int) -> None:
        """Every micro-batch's forward has passed segment ``k``: its parameters resharded, unless the user's
        ``reshard_after_forward=False`` keeps them for its backward. After the first, before any backward, each
        tied parameter's parts are watched on its unsharded parameter (gathered by now, with the root)."""
        if k == 0 and self.on_part is not None:
            self.part_hooks = [fp.unsharded_param.register_hook(partial(self._part, key))
                               for key, fp in self.tied.items()]
        g = self.of_segment[k]
        if self.saved[id(g)].mesh is not None:
            g.reshard()

    def before_rerun(self, k: int, last: bool) -> None:
        """Segment ``k``'s backward for one micro-batch runs next; ``last``: the step's last for it, whose
        post-backward reduce-scatters the sum and reshards (as the user's settings have it)."""
        g = self.of_segment[k]
        if last:
            self.saved[id(g)].put_back(g)
        else:
            g.reduce_grads = g.all_reduce_grads = g.reshard_after_backward = False

    def _part(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """A part of a tied parameter's gradient, before autograd adds it: the step keeps its rows of the step's
        tokens (an embedding's part comes back with them zeroed: see [Note: Tied parameters layer by layer])."""
        grad = grad.clone()
        assert self.on_part is not None
        self.on_part(key, grad)
        return grad

    def glue_starts(self) -> None:
        """The glue before the first segment runs its backward next: which unsharded gradients it finds."""
        tied = set(map(id, self.tied.values()))  # summed in the loop's order by the step
        self.before_glue = [(fp, _unsharded_grad_mark(fp)) for g in self.groups for fp in g.fsdp_params
                            if id(fp) not in tied]

    def mixed(self) -> str | None:
        """A parameter with gradient parts from the forward's stretch (the head's) and from the glue before the
        segments: each part summed in another order than the loop's, micro-batch after micro-batch."""
        for fp, before in self.before_glue:
            if before is not None and _unsharded_grad_mark(fp) != before:
                name = getattr(fp, "_param_fqn", None) or "a parameter of the root"
                return (f"{name} gets gradient parts both before the first segment and after the last: they would "
                        f"be summed in another order than the loop's")
        return None

    def end(self, ok: bool) -> None:
        """The user's settings back. ``ok``: what FSDP2's last backward ends with runs now (every group with an
        unsharded gradient left, the root's, reduce-scatters it and reshards; then FSDP2 finalizes the backward);
        else the step's gathers and unsharded gradients are let go (``reset_iter_state``)."""
        for h in self.part_hooks:
            h.remove()
        self.part_hooks = []
        for g in self.groups:
            if id(g) in self.saved:
                self.saved[id(g)].put_back(g)
            g.__dict__.pop("_backward_prefetch", None)
            g.__dict__.pop("post_forward", None)
        for s, fwd, bwd in self.prefetches:
            s._states_to_forward_prefetch, s._states_to_backward_prefetch = fwd, bwd
        self.root._state_ctx.is_last_backward = self.last_backward
        try:
            if ok:
                self.root._root_post_backward_final_callback()
            else:
                for g in self.groups:
                    for fp in g.fsdp_params:
                        if hasattr(fp, "_unsharded_param"):
                            fp.unsharded_param.grad = None
                        if not isinstance(getattr(type(fp), "unsharded_accumulated_grad", None), property):
                            fp.unsharded_accumulated_grad = None  # torch 2.15 keeps none apart from the above
                reset = getattr(self.model, "reset_iter_state", None) or self.root._reset_iter_state
                reset()
        finally:
            for g in self.groups:
                if id(g) in self.saved:
                    g.post_forward_mesh_info = self.saved[id(g)].mesh


__all__ = ["TESTED_TORCH", "HeldGathers", "adopt_local_tensor", "check_group_supported", "check_torch_version",
           "fsdp_groups", "fsdp_params_by_id", "group_params", "local_shard", "syncs_gradients", "wait_for_gradients",
           "will_reduce", "with_local", "wrap_group"]
