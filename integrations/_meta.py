"""Models built on the meta device, given memory and values one module at a time.

[Note: Building on the meta device] A model built under ``torch.device("meta")``
has shapes and no memory. ``offload_model`` and ``offload_fsdp`` walk its
modules in ``named_modules()`` order; each module's own meta parameters and
buffers get CPU memory and are initialized by the module's
``reset_parameters()`` (or ``init_fn(module)``), its parameters go to the store
and their memory goes, before the next module: peak memory is one module's
tensors. A parameter tied across modules is one object, initialized where it is
met first. With a fixed seed this gives the parameters eager construction gives
when each module's constructor draws its random numbers in
``reset_parameters()`` and modules are constructed in the order they are
registered (nn.Linear, nn.Embedding, nn.LayerNorm, convolutions...); parameters
a parent initializes in its own ``__init__`` (a class token drawn with
``normal_``) need ``init_fn``, and the random draws then differ from eager
construction. Under FSDP2 a parameter is this rank's shard (a DTensor), given
memory in place as ``to_empty`` does, so FSDP2's own references stay right; it
gets the values FSDP2's recipe (``to_empty``, then each module's
``reset_parameters()``) gives it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def check_meta(model: nn.Module, init_fn: Callable[[nn.Module], None] | None) -> bool:
    """Whether ``model`` is (partly) on the meta device; if so, that every module with meta tensors of its own can
    be initialized (its ``reset_parameters()``, or ``init_fn``), else an error naming them."""
    on_meta = [(mname, m) for mname, m in model.named_modules()
               if any(t is not None and t.is_meta for t in (*m._parameters.values(), *m._buffers.values()))]
    if not on_meta:
        return False
    if init_fn is None:
        cannot = [mname or "<root>" for mname, m in on_meta if not callable(getattr(m, "reset_parameters", None))]
        if cannot:
            raise ValueError(f"the model is on the meta device and {len(cannot)} module(s) with tensors of their own "
                             f"have no reset_parameters() to initialize them: {', '.join(cannot[:5])}"
                             f"{'...' if len(cannot) > 5 else ''}. Pass init_fn=f, f(module) initializing a "
                             f"module's own parameters and buffers (transformers: init_fn=model._init_weights)")
    return True


def materialize(module: nn.Module, init_fn: Callable[[nn.Module], None] | None,
                done: dict[int, tuple[nn.Parameter, nn.Parameter]], undo: list[Callable[[], None]], *,
                in_place: bool = False,
                adopt: Callable[[nn.Parameter], Callable[[], None]] | None = None) -> list[nn.Parameter]:
    """Give ``module``'s own meta parameters and buffers CPU memory and initialize them, as its constructor would
    have (see [Note: Building on the meta device]); returns the parameters given memory here.

    ``done``: id of a parameter met before -> (the meta one, the one with memory), so that a tied one stays one
    object; ``undo``: functions that put the model back as it was given, run last first by :func:`unmaterialize`.
    ``in_place``: the parameter object keeps its identity (its contents are swapped, as ``to_empty`` does), for
    owners that hold references to it (FSDP2); ``adopt(param)`` is then called before the init, and returns what
    undoes it."""
    fresh: list[nn.Parameter] = []
    tied: dict[str, nn.Parameter] = {}
    for name, p in list(module._parameters.items()):
        if p is None:
            continue
        if id(p) in done:  # tied: given memory and values where it was met first
            tied[name] = done[id(p)][1]
            if not in_place:
                undo.append(_putter(module._parameters, name, p))
                module._parameters[name] = done[id(p)][1]
            continue
        if not p.is_meta:
            continue
        new = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
        if in_place:
            torch.utils.swap_tensors(p, new)  # p has the memory now, new the meta tensor
            undo.append(lambda p=p, new=new: torch.utils.swap_tensors(p, new))
            done[id(p)] = (new, p)
            if adopt is not None:
                undo.append(adopt(p))
            fresh.append(p)
        else:
            undo.append(_putter(module._parameters, name, p))
            done[id(p)] = (p, new)
            module._parameters[name] = new
            fresh.append(new)
    meta_buffers = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
    for name in meta_buffers:
        undo.append(_putter(module._buffers, name, module._buffers[name]))
        module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
    if not fresh and not meta_buffers:
        return fresh
    # A tied parameter keeps the values it has (it may be offloaded already): this module's init writes a scratch.
    for name, p in tied.items():
        module._parameters[name] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
    try:
        with torch.no_grad():
            if init_fn is not None:
                init_fn(module)
            else:
                module.reset_parameters()
    finally:
        module._parameters.update(tied)
    return fresh


def _putter(slots: dict, name: str, old: object) -> Callable[[], None]:
    def put_back() -> None:
        slots[name] = old
    return put_back


def unmaterialize(undo: list[Callable[[], None]]) -> None:
    """Put back what :func:`materialize` changed: the model is on the meta device again, as it was given."""
    for step in reversed(undo):
        step()
