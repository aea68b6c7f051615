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

What is used, all present and exercised by the suite on torch 2.13.0 and
2.14.1 (``bash .ci/run newest`` runs it on the newest release):
- ``FSDPModule._get_fsdp_state()._fsdp_param_group``: a module's param group;
- ``FSDPParamGroup``: ``fsdp_params``, ``unshard``, ``wait_for_unshard``,
  ``post_backward`` (wrapped per object), ``_all_gather_result``,
  ``is_unsharded``, ``_use_post_forward_mesh``, ``_post_reduce_event``,
  ``reduce_grads`` (``set_requires_gradient_sync``'s flag, read only);
- ``FSDPParam``: ``sharded_param``, ``offload_to_cpu``, and for a model built
  on the meta device ``reset_sharded_param()``, ``_sharded_param_data``,
  ``_sharding_spec``;
- ``DTensor._local_tensor``: the view of the padded shard that is freed and
  restored by resizing its storage (see [Note: Freeing a shard]).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from tierstore import TierStoreError, TierValueError

TESTED_TORCH = ("2.13", "2.14")


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
               after_post_backward: Callable[[], None]) -> Callable[[], None]:
    """Run ``before_unshard`` before the group's all-gather reads its shards, ``after_wait`` once it
    has, and ``after_post_backward`` once its sharded gradients are assigned (see
    :func:`wait_for_gradients`); returns a function that removes the wrappers."""
    unshard, wait, post_backward = group.unshard, group.wait_for_unshard, group.post_backward

    def wrapped_unshard(async_op: bool = False) -> None:
        if group._all_gather_result is None and not group.is_unsharded:
            before_unshard()
        return unshard(async_op)

    def wrapped_wait() -> None:
        wait()
        after_wait()

    def wrapped_post_backward(*args: Any) -> None:
        post_backward(*args)
        after_post_backward()

    group.unshard, group.wait_for_unshard, group.post_backward = wrapped_unshard, wrapped_wait, wrapped_post_backward

    def remove() -> None:
        del group.unshard, group.wait_for_unshard, group.post_backward  # back to the class's methods

    return remove


def syncs_gradients(group: Any) -> bool:
    """Whether the group's post-backward reduce-scatters its gradients (``set_requires_gradient_sync``'s flag:
    False keeps the unsharded gradients, accumulated, until a backward that syncs)."""
    return bool(getattr(group, "reduce_grads", True))


def wait_for_gradients(group: Any) -> None:
    """Block until the reduce-scatter that produced the group's sharded gradients has finished (on CUDA it
    runs on FSDP2's own stream; on the CPU it already has)."""
    event = getattr(group, "_post_reduce_event", None)
    if event is not None:
        event.synchronize()


__all__ = ["TESTED_TORCH", "adopt_local_tensor", "check_group_supported", "check_torch_version", "fsdp_groups",
           "fsdp_params_by_id", "group_params", "local_shard", "syncs_gradients", "wait_for_gradients", "with_local",
           "wrap_group"]
