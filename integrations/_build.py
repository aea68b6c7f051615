"""Building an ``OffloadedModel``: its parameters given to the store, a meta model materialized on the way.

See [Note: Building on the meta device] (``_meta.py``) for how a model built on the meta device is given
memory one module at a time; here each parameter goes to the store as its module is done, so the whole model
never exists in memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tierstore import Tier, TierValueError
from tierstore.memory import dense_strides

from ._meta import materialize
from ._param import StoredParam, placeholder_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._contract import ModelOffload


def check_names_free(off: ModelOffload, offloaded: dict[int, tuple[str, int]]) -> None:
    """Refuse a model whose parameter names another model already keeps in the store."""
    taken = [name for name, _ in offloaded.values() if f"{off.prefix}{name}" in off.store]
    if taken:
        raise TierValueError(
            f"the store already holds an offloaded parameter named {taken[0]!r} ({len(taken)} of this model's "
            f"names are taken): a store keeps a model's parameters and optimizer state under their names, so "
            f"another model offloaded into it must not share them. Give each model its own TierStore, or "
            f"call .remove() on the other model's offload first")


def put_parameters(off: ModelOffload, meta: bool, init_fn: Callable[[nn.Module], None] | None,
                   real_parameters: str | None, threshold: int) -> None:
    """Give every parameter of ``off.model`` of ``threshold`` bytes or more to the store (the rest stay resident),
    materializing a meta model module by module; all or nothing (see ``OffloadBase.putting``)."""
    model = off.model
    with off.putting() as (handles, undo):
        if meta:  # materialized module by module: one module's tensors in memory at a time
            done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
            for mname, module in model.named_modules():
                materialize(module, init_fn, done, undo, mname=mname, initialize_real=real_parameters == "initialize")
                for pname, p in module._parameters.items():
                    name = f"{mname}.{pname}" if mname else pname
                    if p is not None and id(p) not in off.params and id(p) not in off.resident_ids:
                        _put(off, name, p, handles, threshold, wait=True)
        else:
            for name, p in model.named_parameters():
                _put(off, name, p, handles, threshold, wait=False)


def _put(off: ModelOffload, name: str, p: nn.Parameter, handles: list[Any], threshold: int, *, wait: bool) -> None:
    """Give ``p``'s bytes to the store (or keep it resident when small)."""
    nbytes = p.numel() * p.element_size()
    if nbytes < threshold:
        off.resident[name] = p
        off.resident_ids.add(id(p))
        return
    value = p.detach()
    key = f"{off.prefix}{name}"
    handles.append(off.store.put(key, value if dense_strides(value) else value.contiguous(), home=off.home))
    sp = off.params[id(p)] = StoredParam(name, key, p, off, placeholder_of(p, off.compute_device), nbytes, type(p))
    if wait:  # its memory goes now
        handles[-1].wait()
        sp.param.data = sp.placeholder


def to_compute_device(off: ModelOffload) -> None:
    """What stays in memory (parameters under the threshold, buffers) computes beside the fetched parameters,
    so it goes to their device: a model built on the CPU (or on meta) then runs on the GPU."""
    if off.compute_device.type == "cpu":
        return
    with torch.no_grad():
        for p in off.resident.values():
            if p.device != off.compute_device:
                p.data = p.data.to(off.compute_device)
        for module in off.model.modules():
            for name, b in module._buffers.items():
                if b is not None and b.device != off.compute_device:
                    module._buffers[name] = b.to(off.compute_device)


def room_for(off: ModelOffload, offloaded: dict[int, tuple[str, int]]) -> None:
    """With the drive as the parameters' home, check its room for them before anything is written."""
    if off.home is Tier.NVME:
        off.store.require_nvme_room(sum(nbytes for _, nbytes in offloaded.values()), "offloading {size} of parameters")
