"""Which parameters an ``OffloadedAdamW`` steps, and its parameter groups.

An optimizer steps every trainable parameter of the model its offload took, each with a name (as in
``model.named_parameters()``) and a store key (None for a parameter kept resident). Its parameter groups are
torch.optim's, given by name or by tensor; :func:`group_states` is what ``state_dict()`` and checkpoints keep of
them (parameters by name, never by index: an index cannot be matched to a parameter safely).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tierstore import TierTypeError, TierValueError, parse_bytes

from ._adamw import HYPER, check_hyper
from ._contract import STEPPED_DTYPES, OffloadedParameters

Item = tuple[str, "str | None", nn.Parameter]  # (name, store key or None for a resident parameter, parameter)


def check_flags(offloaded: object, *, amsgrad: bool, capturable: bool, differentiable: bool) -> None:
    """Refuse what an ``OffloadedAdamW`` cannot be given: torch.optim.AdamW's flags it does not support, or
    something other than an offload to step."""
    unsupported = [f"{k}=True" for k, v in (("amsgrad", amsgrad), ("capturable", capturable),
                                              ("differentiable", differentiable)) if v]
    if unsupported:
        raise TierValueError(f"OffloadedAdamW does not support {', '.join(unsupported)} (torch.optim.AdamW's "
                             f"amsgrad would keep a third state tensor per parameter; capturable and differentiable "
                             f"are for CUDA graphs and higher-order optimization): leave them False")
    if not isinstance(offloaded, OffloadedParameters):
        raise TierTypeError(f"OffloadedAdamW steps offloaded parameters: pass what offload_model or offload_fsdp "
                            f"returned, not {type(offloaded).__name__}")


def check_streaming(offloaded: object, *, stream_update: bool, step_in_backward: bool) -> None:
    """Refuse ``stream_update=True`` where it cannot run (see [Note: Updates streamed into the next forward])."""
    if not isinstance(stream_update, bool):
        raise TierTypeError(f"stream_update={stream_update!r} must be True or False")
    if not stream_update:
        return
    if step_in_backward:
        raise TierValueError("stream_update=True runs the updates after backward (clipped, accumulated) during the "
                             "next forward, and step_in_backward=True runs them during backward: choose one")
    if not getattr(offloaded, "streams_updates", False):
        raise TierValueError(f"stream_update=True needs a model of offload_model or offload_fsdp, whose every read "
                             f"of a parameter goes through the store, not {type(offloaded).__name__}: leave it False")


def check_speculating(offloaded: object, *, speculate: bool | str, step_in_backward: bool) -> bool:
    """Whether to speculate (see [Note: Speculated updates]): ``True`` is refused where it cannot run, ``"auto"``
    runs as ``False`` there (see [Note: When to speculate])."""
    if not isinstance(speculate, bool) and speculate != "auto":
        raise TierTypeError(f"speculate={speculate!r} must be True, False or 'auto'")
    if not speculate:
        return False
    why = _why_not_speculating(offloaded, step_in_backward)
    if why is not None and speculate is True:
        raise TierValueError(why)
    return why is None


def check_code_grads(*, code_grads: bool, keep_grads: bool, speculate: bool | str) -> None:
    """``code_grads`` codes the gradients speculated updates keep until ``step()``, which ``keep_grads=False`` lets
    go there (see [Note: A kept gradient coded against its moments] in _grad_code.py)."""
    if not isinstance(code_grads, bool):
        raise TierTypeError(f"code_grads={code_grads!r} must be True or False")
    if code_grads and keep_grads:
        raise TierValueError("code_grads=True codes the gradient a speculated update keeps until step(), where it "
                             "goes; with keep_grads=True it stays after step() as it is: pass keep_grads=False too, "
                             "or leave code_grads False")
    if code_grads and speculate is False:
        raise TierValueError("code_grads=True codes the gradients that speculated updates keep, and speculate=False "
                             "makes none: pass speculate='auto' or True, or leave code_grads False")


def _why_not_speculating(offloaded: object, step_in_backward: bool) -> str | None:
    if step_in_backward:
        return ("speculate=True makes each update in backward and keeps it at step() only where it is the step's "
                "(clipped, accumulated), and step_in_backward=True makes them in backward for good: choose one")
    if not getattr(offloaded, "speculates", False):
        return (f"speculate=True needs a model of offload_model or offload_fsdp, whose every read of a parameter goes "
                f"through the store, not {type(offloaded).__name__}: leave it False")
    if offloaded.store.swap_directory is None:  # type: ignore[attr-defined]
        return ("speculate=True keeps what each update made in backward replaces on the drive, and this store has "
                "none (no nvme_path): leave it False, or give the store an nvme_path")
    return None


def positive_bytes(value: int | str | None, default: int, name: str) -> int:
    """A byte count given as an int or a size such as '64MiB'; ``default`` when None."""
    n = default if value is None else parse_bytes(value, name=name)
    if n < 1:
        raise TierValueError(f"{name}={value!r} must be at least 1 byte")
    return n


def stepped_items(offloaded: OffloadedParameters) -> tuple[list[Item], list[Item]]:
    """(the parameters to step, the frozen ones): frozen parameters (requires_grad=False) get no state, as
    torch's optimizers create none for a parameter that never has a gradient. Refuses parameters AdamW cannot
    step and trainable ones the offload did not take."""
    everything = [*offloaded.named_offloaded(), *((name, None, p) for name, p in offloaded.resident.items())]
    items = [it for it in everything if it[2].requires_grad]
    frozen = [it for it in everything if not it[2].requires_grad]
    odd = [f"{name} ({p.dtype})" for name, _, p in items if p.dtype not in STEPPED_DTYPES]
    if odd:
        raise TierTypeError(f"OffloadedAdamW steps fp32, fp64, bf16 and fp16 parameters, not {', '.join(odd[:4])}"
                            f"{', ...' if len(odd) > 4 else ''}: freeze them (requires_grad_(False)) or convert "
                            f"them before offload_model")
    model = offloaded.model
    sparse = [n for n, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:  # torch's AdamW refuses sparse gradients at its step too
        raise TierValueError(f"{', '.join(sparse[:4])}: sparse=True gives sparse gradients, which AdamW does not "
                             f"step; build the embedding with sparse=False (the default)")
    taken = {id(p) for _, _, p in everything}
    added = [n for n, p in model.named_parameters() if id(p) not in taken and p.requires_grad]
    if added:  # they would never be stepped, and the model would train without them, silently
        raise TierValueError(f"{', '.join(added[:4])}{', ...' if len(added) > 4 else ''}: trainable parameters of "
                             f"the model that offload_model did not take (modules added or replaced after it): "
                             f"OffloadedAdamW steps only what it took. Build the whole model (heads, adapters) "
                             f"before offload_model, or freeze these (requires_grad_(False))")
    return items, frozen


def torch_groups(param_groups: list[dict[str, Any]] | None, defaults: dict[str, Any], items: list[Item],
                 frozen: list[Item], name_of: dict[int, str]) -> list[dict[str, Any]]:
    """``param_groups`` with parameters for names, and the parameters in no group as a last group."""
    by_name = {name: p for name, _, p in items}
    frozen_names = {name for name, _, _ in frozen}
    seen: dict[str, int] = {}
    groups = []
    for i, group in enumerate(param_groups or []):
        if not isinstance(group, dict) or "params" not in group:
            raise TierTypeError(f"param_groups[{i}] must be a dict with a 'params' list")
        unknown = sorted(set(group) - {"params", *HYPER})
        if unknown:
            raise TierValueError(f"param_groups[{i}] has unknown keys {unknown}; valid: 'params', {', '.join(HYPER)}")
        params = [group["params"]] if isinstance(group["params"], (str, torch.Tensor)) else list(group["params"])
        names, named_frozen = [], False
        for p in params:
            name = p if isinstance(p, str) else name_of.get(id(p))
            if name in frozen_names:
                named_frozen = True
                continue  # never has a gradient: nothing to step
            if name not in by_name:
                what = repr(p) if isinstance(p, str) else f"a tensor of shape {tuple(p.shape)}"
                raise TierValueError(f"param_groups[{i}]: {what} is not a parameter of the offloaded model "
                                     f"(give parameter names, as in model.named_parameters(), or the parameters)")
            if name in seen:
                raise TierValueError(f"param_groups[{i}]: parameter {name!r} is already in param_groups[{seen[name]}]")
            seen[name] = i
            names.append(name)
        if not names and not named_frozen:
            raise TierValueError(f"param_groups[{i}] has no parameters")
        hyper = {k: v for k, v in group.items() if k != "params"}
        if "betas" in hyper:
            hyper["betas"] = tuple(hyper["betas"])
        check_hyper({**defaults, **hyper}, f"param_groups[{i}]: ")
        groups.append({"params": [by_name[n] for n in names], **hyper})
    rest = [p for name, _, p in items if name not in seen]
    if rest or not groups:
        groups.append({"params": rest})
    return groups


def group_states(param_groups: list[dict[str, Any]], name_of: dict[int, str]) -> list[dict[str, Any]]:
    """Each parameter group's hyper-parameters (and what a scheduler added, such as ``initial_lr``), with
    ``"params"`` as parameter names."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(p)] for p in g["params"]]}
            for g in param_groups]


def check_group_states(groups: Any, mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Saved ``groups`` as they would apply over ``mine`` (this optimizer's :func:`group_states`), checked: the
    same groups of the same parameters (one group without ``"params"``, as older state dicts have, applies to
    every group), each with valid hyper-parameters. Raises ValueError."""
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise TierValueError("parameter groups must be a list of dicts")
    if any(isinstance(n, int) for g in groups for n in g.get("params", ())):
        raise TierValueError("these parameter groups name parameters by index, as torch.optim's state_dict() does: "
                             "OffloadedAdamW's state_dict() names them (which an index cannot be matched to "
                             "safely). Load state saved by an OffloadedAdamW (or a checkpoint), or start its "
                             "moments afresh")
    if len(groups) == 1 and "params" not in groups[0]:
        groups = [{**groups[0], "params": g["params"]} for g in mine]
    if [g.get("params") for g in groups] != [g["params"] for g in mine]:
        raise TierValueError(f"the saved parameter groups ({len(groups)}) do not hold the same parameters as this "
                             f"optimizer's ({len(mine)}); build it with the param_groups it was saved with")
    out = []
    for i, (saved, current) in enumerate(zip(groups, mine)):
        group = {**current, **{k: (tuple(v) if k == "betas" and isinstance(v, list) else v)
                               for k, v in saved.items()}}
        try:
            check_hyper(group, f"group {i}: ")
        except TypeError:
            raise TierValueError(f"group {i}: hyper-parameters of the wrong type: {saved}") from None
        out.append(group)
    return out


__all__ = ["Item", "check_flags", "check_group_states", "group_states", "positive_bytes", "stepped_items",
           "torch_groups"]
