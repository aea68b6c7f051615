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
construction. Memory given to a meta tensor is filled with what no initialization
writes (NaN; an integer type's minimum) first, and a tensor still holding it after
its module's initialization is an error naming it: uninitialized memory is never
trained on. Under FSDP2 a parameter is this rank's shard (a DTensor), given
memory in place as ``to_empty`` does, so FSDP2's own references stay right; it
gets the values FSDP2's recipe (``to_empty``, then each module's
``reset_parameters()``) gives it.

[Note: Real parameters in a model built on meta] A constructor that ignores
the device context (``nn.Parameter(torch.FloatTensor(d, h))``, as XLNet's
attention has it) makes a real tensor of uninitialized memory in a model
built on meta, and the modules' initialization is what would have written it
in eager construction. Whether a real parameter holds values or garbage cannot
be told from its bytes, so it is the caller's word: ``real_parameters=
"initialize"`` treats it as fresh memory (filled, initialized by its module,
checked, as the meta ones are; what ``to_empty()`` and ``reset_parameters()``
do), ``"keep"`` keeps its values, and with neither a model with such
parameters is an error naming them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.utils import parametrize
from tierstore import TierValueError

if TYPE_CHECKING:
    from tierstore import TierStore


REAL_PARAMETERS = ("initialize", "keep")


def check_meta(model: nn.Module, init_fn: Callable[[nn.Module], None] | None,
               real_parameters: str | None = None) -> bool:
    """Whether ``model`` is (partly) on the meta device; if so, that every module with meta tensors of its own can
    be initialized (its ``reset_parameters()``, or ``init_fn``), else an error naming them, and that parameters
    not on meta have been said what to do with (see [Note: Real parameters in a model built on meta])."""
    if real_parameters not in (None, *REAL_PARAMETERS):
        raise TierValueError(f"real_parameters={real_parameters!r}: choose one of "
                             f"{', '.join(map(repr, REAL_PARAMETERS))}")
    # A parametrization's original tensors are initialized through the module it parametrizes (see [Note:
    # Parametrized tensors on the meta device]).
    on_meta = [(mname, m) for mname, m in model.named_modules() if not isinstance(m, parametrize.ParametrizationList)
               and any(
        t is not None and t.is_meta for t in (*m._parameters.values(), *m._buffers.values(),
                                              *_parametrization_originals(m)))]
    if not on_meta:
        return False
    real = [name for name, p in model.named_parameters() if not p.is_meta]
    if real and real_parameters is None:
        raise TierValueError(
            f"the model is on the meta device but {len(real)} of its parameters are not: {', '.join(real[:4])}"
            f"{f' and {len(real) - 4} more' if len(real) > 4 else ''}. A constructor that ignores "
            f"torch.device('meta') (torch.FloatTensor(size), torch.Tensor(size): XLNet's attention builds its weights "
            f"so) makes them of "
            f"uninitialized memory, which would be trained on. Pass real_parameters='initialize' to initialize them "
            f"with their modules, as the meta ones are (and as to_empty() and reset_parameters() would), or "
            f"real_parameters='keep' if they hold values on purpose")
    if init_fn is None:
        if real_parameters == "initialize":  # modules whose parameters are all real are initialized too
            real_owners = [(n, m) for n, m in model.named_modules() if _initializes_real(m)]
            on_meta += [(n, m) for n, m in real_owners if not any(m is o for _, o in on_meta)]
        cannot = [mname or "<root>" for mname, m in on_meta if not callable(getattr(m, "reset_parameters", None))]
        if cannot:
            raise TierValueError(f"the model is on the meta device and {len(cannot)} module(s) with tensors of their "
                                 f"own have no reset_parameters() to initialize them: {', '.join(cannot[:5])}"
                                 f"{'...' if len(cannot) > 5 else ''}. Pass init_fn=f, f(module) initializing a "
                                 f"module's own parameters and buffers (transformers: init_fn=model._init_weights)")
    return True


def materialize(module: nn.Module, init_fn: Callable[[nn.Module], None] | None,
                done: dict[int, tuple[nn.Parameter, nn.Parameter]], undo: list[Callable[[], None]], *,
                in_place: bool = False, mname: str = "", initialize_real: bool = False,
                adopt: Callable[[nn.Parameter], Callable[[], None]] | None = None) -> list[nn.Parameter]:
    """Give ``module``'s own meta parameters and buffers CPU memory and initialize them, as its constructor would
    have (see [Note: Building on the meta device]); returns the parameters given memory here (with
    ``initialize_real``, its real parameters too, as if on meta: see [Note: Real parameters in a model built on
    meta]).

    ``done``: id of a parameter met before -> (the meta one, the one with memory), so that a tied one stays one
    object; ``undo``: functions that put the model back as it was given, run last first by :func:`unmaterialize`.
    ``in_place``: the parameter object keeps its identity (its contents are swapped, as ``to_empty`` does), for
    owners that hold references to it (FSDP2); ``adopt(param)`` is then called before the init, and returns what
    undoes it."""
    fresh: list[nn.Parameter] = []
    fresh_names: list[str] = []
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
        if not p.is_meta and not (initialize_real and _initializes_real(module)):
            continue  # a real one is given new memory as a meta one is, and kept as it was for a failure
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
        fresh_names.append(name)
    meta_buffers = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
    for name in meta_buffers:
        undo.append(_putter(module._buffers, name, module._buffers[name]))
        module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
    parametrized = _meta_parametrizations(module)
    if parametrized and in_place:
        raise TierValueError(f"{mname or '<root>'} has parametrized tensors ({', '.join(parametrized)}) on the meta "
                             f"device, which a sharded model cannot initialize here: build that module eagerly")
    if not fresh and not meta_buffers and not parametrized:
        return fresh
    for t in (*fresh, *(module._buffers[name] for name in meta_buffers)):
        _fill_unwritten(t)
    # A tied parameter keeps the values it has (it may be offloaded already): this module's init writes a scratch.
    for name, p in tied.items():
        module._parameters[name] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
    cls = module.__class__
    try:
        if parametrized:  # the module's own class, with a plain tensor for each parametrized one to initialize
            module.__class__ = cls.__bases__[0]
            for tname, shaped in parametrized.items():
                module._parameters[tname] = nn.Parameter(_fill_unwritten(torch.empty_like(shaped, device="cpu")))
        with torch.no_grad():
            if init_fn is not None:
                init_fn(module)
            else:
                module.reset_parameters()
        values = {tname: module._parameters[tname].detach() for tname in parametrized}
    finally:
        for tname in parametrized:
            module._parameters.pop(tname, None)
        module.__class__ = cls
        module._parameters.update(tied)
    _refuse_unwritten(module, mname, [(n, module._parameters[n]) for n in fresh_names] +
                      [(n, module._buffers[n]) for n in meta_buffers] + list(values.items()), init_fn)
    for tname, value in values.items():
        _set_originals(module, tname, value, done, undo)
    return fresh


def _parametrization_originals(module: nn.Module) -> list[torch.Tensor]:
    if not parametrize.is_parametrized(module):
        return []
    return [t for plist in module.parametrizations.values() for t in plist.parameters(recurse=False)]


def _meta_parametrizations(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parametrized tensors (torch.nn.utils.parametrize) whose original tensors are on the meta
    device: name -> a meta tensor of the parametrized value's shape and dtype.

    [Note: Parametrized tensors on the meta device] Eager construction initializes
    a plain weight (``reset_parameters()``) and then registering a parametrization
    (``weight_norm``, ``orthogonal``, ``spectral_norm``) computes its original
    tensors from it with ``right_inverse``; a parametrized module's
    ``reset_parameters()`` writes a value computed from those originals and is lost.
    So on the meta device the module is initialized as its own class with a plain
    tensor in the parametrized one's place, and the originals are computed from it
    as registration does."""
    if not parametrize.is_parametrized(module):
        return {}
    out = {}
    for tname, plist in module.parametrizations.items():
        if any(t.is_meta for t in plist.parameters(recurse=False)):
            try:
                with torch.no_grad():
                    out[tname] = getattr(module, tname)
            except Exception as e:
                raise TierValueError(f"the parametrized {tname!r} of {type(module).__name__} on the meta device: its "
                                     f"parametrization cannot run there ({e}); build this module eagerly") from e
    return out


def _set_originals(module: nn.Module, tname: str, value: torch.Tensor,
                   done: dict[int, tuple[nn.Parameter, nn.Parameter]], undo: list[Callable[[], None]]) -> None:
    """The original tensors of ``module``'s parametrized ``tname``, given memory and computed from ``value`` as
    registering the parametrization computes them (see [Note: Parametrized tensors on the meta device])."""
    plist = module.parametrizations[tname]
    new = value
    with torch.no_grad():
        for parametrization in reversed(plist):
            if hasattr(parametrization, "right_inverse"):
                try:
                    new = parametrization.right_inverse(new)
                except NotImplementedError:  # registration takes it as the identity, too
                    pass
    news = [new] if plist.is_tensor else list(new)
    names = ["original"] if plist.is_tensor else [f"original{i}" for i in range(plist.ntensors)]
    for oname, t in zip(names, news, strict=True):
        old = plist._parameters[oname]
        if t.shape != old.shape or t.dtype != old.dtype:
            raise TierValueError(f"the parametrization of {tname!r} of {type(module).__name__} gives {oname} of "
                                 f"shape {tuple(t.shape)} and {t.dtype} from its value, not {tuple(old.shape)} and "
                                 f"{old.dtype}")
        undo.append(_putter(plist._parameters, oname, old))
        fresh = nn.Parameter(t.detach().to("cpu", copy=True).contiguous(), requires_grad=old.requires_grad)
        done[id(old)] = (old, fresh)
        plist._parameters[oname] = fresh


def _fill_unwritten(t: torch.Tensor) -> torch.Tensor:
    """Fill fresh memory with what no initialization writes, so that :func:`_refuse_unwritten` can tell."""
    local = t.to_local() if hasattr(t, "to_local") else t
    with torch.no_grad():
        if local.dtype.is_floating_point or local.dtype.is_complex:
            local.fill_(float("nan"))
        elif local.dtype != torch.bool:
            local.fill_(torch.iinfo(local.dtype).min)
    return t


_CHECK = 1 << 24  # elements checked at once: the comparison's temporary is this many bytes


def _unwritten(t: torch.Tensor) -> bool:
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.dtype == torch.bool or local.numel() == 0:
        return False
    flat = local.detach().reshape(-1)
    fill = None if local.dtype.is_floating_point or local.dtype.is_complex else torch.iinfo(local.dtype).min
    for start in range(0, flat.numel(), _CHECK):
        part = flat[start:start + _CHECK]
        if bool(part.isnan().any() if fill is None else (part == fill).any()):
            return True
    return False


def _refuse_unwritten(module: nn.Module, mname: str, tensors: list[tuple[str, torch.Tensor]],
                      init_fn: Callable[[nn.Module], None] | None) -> None:
    """Memory given to a meta tensor is uninitialized: one its module's initialization left unwritten (in part
    or whole) would train on whatever was there, so it is an error naming it."""
    left = [f"{mname}.{name}" if mname else name for name, t in tensors if _unwritten(t)]
    if left:
        how = f"init_fn({mname or '<root>'})" if init_fn is not None else f"{mname or '<root>'}.reset_parameters()"
        how += f" ({type(module).__name__})"
        raise TierValueError(f"the model is on the meta device and {how} left {', '.join(left)} (in whole or part) "
                             f"unwritten: it would train on uninitialized memory. "
                             f"Pass an init_fn that writes every parameter and buffer of each module it is given (any "
                             f"values, zeros say, where load_safetensors replaces them next), or build the model "
                             f"eagerly")


def _initializes_real(module: nn.Module) -> bool:
    """Whether ``real_parameters="initialize"`` has ``module`` initialize real parameters of its own (a
    parametrization's originals are its parametrized module's to initialize)."""
    return not isinstance(module, parametrize.ParametrizationList) and any(
        p is not None and not p.is_meta for p in module._parameters.values())


def _putter(slots: dict, name: str, old: object) -> Callable[[], None]:
    def put_back() -> None:
        slots[name] = old
    return put_back


@contextmanager
def putting(store: TierStore, records: dict) -> Iterator[tuple[list, list[Callable[[], None]]]]:
    """The put/undo transaction of a model's parameters: yields (store put handles, undo steps of a meta build);
    on any error the store holds nothing of the model, ``records`` (what the build filled) is emptied and the
    model is as it was given."""
    handles: list = []
    undo: list[Callable[[], None]] = []
    try:
        yield handles, undo
        for h in handles:
            h.wait()
    except BaseException:
        store.undo_puts(handles)
        unmaterialize(undo)
        records.clear()
        raise


def unmaterialize(undo: list[Callable[[], None]]) -> None:
    """Put back what :func:`materialize` changed: the model is on the meta device again, as it was given."""
    for step in reversed(undo):
        step()
