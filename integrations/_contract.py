"""The contract between offloaded parameters and what steps or saves them.

:class:`OffloadedParameters` is what :class:`~tierstore.integrations.optim.OffloadedAdamW` and the checkpoint
functions use of a model's offloaded parameters; ``OffloadedModel`` (one process) and ``FSDPOffload`` (one
rank's FSDP2 shards) implement it once, in ``_base.OffloadBase``, so neither user asks what a wrapper has.
The optimizer's store keys are spelt here and nowhere else.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from tierstore import Tier, TierStore, TierStoreError, TierTypeError
from tierstore.scheduling import LaterUses, PrefetchPolicy

OPTIMIZER_PREFIX = "adam/"
OPTIMIZER_STATE = ("exp_avg", "exp_avg_sq", "master")


# Parameter dtypes AdamW steps: bf16/fp16 ones through an fp32 master (mixed precision), the others in their own
# dtype (moments of that dtype too, as torch.optim.AdamW keeps them).
MASTERED_DTYPES = (torch.bfloat16, torch.float16)
STEPPED_DTYPES = (torch.float32, torch.float64, *MASTERED_DTYPES)


class OffloadedParameterError(TierStoreError):
    """An offloaded parameter's values were needed where tierstore cannot fetch them, or can no longer be
    trusted."""


NOT_COPYABLE = ("an offloaded model cannot be copied or pickled: its parameters live in the store and its module "
                "holds placeholders. Copy it before offload_model (or offload_fsdp), call .remove() first, or save "
                "it with state_dict() (which reads the real values) or save_checkpoint()")


class NotCopyable:
    """What an offloaded model's modules and parameters hold (the front, its levels, their hooks) refuses
    ``copy.deepcopy``, ``pickle`` and ``torch.save`` with one message, whichever a copy reaches first."""

    def __deepcopy__(self, memo: dict) -> object:
        raise TierTypeError(NOT_COPYABLE)

    def __reduce_ex__(self, protocol: object) -> object:
        raise TierTypeError(NOT_COPYABLE)


def has_master(key: str | None, p: torch.Tensor) -> bool:
    """Whether an offloaded parameter (``key`` not None) is stepped through an fp32 master copy."""
    return key is not None and p.dtype in MASTERED_DTYPES


def moment_dtype(key: str | None, p: torch.Tensor) -> torch.dtype:
    """The dtype of a parameter's moments (and of its master): an offloaded bf16/fp16 parameter's are fp32; any
    other's are its own (a resident parameter is stepped as torch.optim.AdamW steps it)."""
    return torch.float32 if has_master(key, p) else p.dtype


def optimizer_key(name: str, what: str) -> str:
    """The store key of one piece of a parameter's optimizer state (``what``: exp_avg, exp_avg_sq or master,
    the fp32 master of a bf16/fp16 parameter)."""
    assert what in OPTIMIZER_STATE, what
    return f"{OPTIMIZER_PREFIX}{name}/{what}"


def zero_grads(params: Iterable[torch.Tensor], set_to_none: bool) -> None:
    """What ``torch.optim.Optimizer.zero_grad`` does to each parameter's ``.grad``."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()


class Mend(enum.Enum):
    """Whether values that can no longer be trusted can be made whole again."""

    BY_STEPPING_AGAIN = "step() again finishes the step that stopped part-way"
    NEVER = "no step can: load a checkpoint"


@dataclass(frozen=True)
class BrokenValues:
    """Why a model's values can no longer be trusted (``off.broken``): set by its ``owner`` (the optimizer whose
    update stopped or failed), which alone may mend it, and only where ``mend`` says it can (see [Note: A step
    that stops part-way] in optim.py). ``str()`` of it is what every refused forward, step and save says."""

    owner: object
    why: str
    mend: Mend

    def __str__(self) -> str:
        return self.why

    def mendable_by(self, owner: object) -> bool:
        return self.owner is owner and self.mend is Mend.BY_STEPPING_AGAIN


class PassConsumer:
    """What reacts to an offloaded model's passes: an optimizer (its state's later uses, a load of the weights,
    the offload's removal), the worker stepping in backward (each gradient as it completes), a layer-major step
    (its activations' later uses). Subclass it and override what you react to; attach it with
    ``off.attach(consumer)`` and detach it with ``off.detach(consumer)`` (see [Note: Consumers of a pass]).

    [Note: Consumers of a pass] One interface, called by the offload and nothing else, in place of lists of
    callbacks that each level filled from outside. Who calls what, and how:

    - ``grad_ready(key)``: the parameter's gradient for this backward is complete. On the thread running the
      backward (the training thread on a CPU; autograd's device thread with CUDA), outside the store's lock;
      only consumers whose ``consumes_grads`` is true get it, and while one is attached the gradients are handed
      over to it instead of being kept (see [Note: Stepping in backward]), and those whose ``watches_grads`` is
      true, with the gradient kept (see [Note: Speculated updates]).
    - ``takes_part(key, grad)``: a part of the parameter's gradient from one backward; a consumer that returns True
      keeps it instead (a layer-major step holds a tied parameter's parts until they can be summed in the loop's
      order: see [Note: Tied parameters layer by layer]). Where ``grad_ready`` is called, before it.
    - ``grads_taken()``: why no gradient may be read now (None: they may), on the thread reading ``param.grad``.
    - ``loaded(names)``: the model's ``load_state_dict`` or a checkpoint wrote these parameters; ``finish()``:
      the offload is about to be removed (finish what is in flight on its values); ``removed()``: it was, its
      values given back (after which the consumer is detached). On the training thread.
    - ``next_uses()`` and ``held_host_bytes()``: the store keys the consumer will use next with how many of its
      steps away each use is, and the host-tier bytes it may hold beside the parameters' units. On any thread
      that evicts (a mover's prefetch, an update's worker), inside the store's lock: they return a snapshot
      that no thread changes afterwards, and call nothing of the store.

    The offload keeps its consumers as a tuple replaced whole on attach and detach, so an evicting thread
    iterates one that no thread changes.
    """

    consumes_grads = False
    """Whether ``grad_ready`` takes each gradient away (an update stepping in backward) instead of it being kept."""

    watches_grads = False
    """Whether ``grad_ready`` is called for it while the gradients are kept (an update speculated in backward)."""

    def grad_ready(self, key: str) -> None:
        """The gradient of ``key``'s parameter is complete for this backward."""

    def takes_part(self, key: str, grad: torch.Tensor) -> bool:
        """Whether this consumer keeps ``grad``, one backward's part of ``key``'s gradient, instead of it being
        added to the kept gradient."""
        return False

    def grads_taken(self) -> str | None:
        """Why no gradient may be read now (an update in backward is consuming them), or None."""
        return None

    def loaded(self, names: list[str]) -> None:
        """The parameters named were written by a load."""

    def finish(self) -> None:
        """The offload is about to be removed: finish what is in flight on the model's values (updates, their
        writes), which its removal then reads back."""

    def removed(self) -> None:
        """The offload is being removed, its values given back: drop what is kept for it."""

    def next_uses(self) -> Mapping[str, int]:
        """Store keys this consumer will use next -> how many of its steps away (a snapshot)."""
        return {}

    def held_host_bytes(self) -> int:
        """Bytes of the host tier it may hold beside the parameters' units (gradients queued for updates)."""
        return 0


class Consumers:
    """The consumers attached to one offload (see [Note: Consumers of a pass]), and what the levels below the front
    ask of them together: the pass (``PassState``) hands each gradient over or keeps it, a parameter's ``.grad``
    read asks whether gradients may be read, the eviction order and the placement read their next uses and held
    bytes. ``attached`` is a tuple replaced whole on attach and detach, so an evicting thread iterates one that no
    thread changes."""

    def __init__(self) -> None:
        self.attached: tuple[PassConsumer, ...] = ()

    def attach(self, consumer: PassConsumer) -> None:
        if consumer not in self.attached:
            self.attached = (*self.attached, consumer)

    def detach(self, consumer: PassConsumer) -> None:
        self.attached = tuple(c for c in self.attached if c is not consumer)

    def consumes_grads(self) -> bool:
        """Whether a consumer takes each gradient as it completes (an update stepping in backward)."""
        return any(c.consumes_grads for c in self.attached)

    def grad_ready(self, key: str) -> None:
        for c in self.attached:
            if c.consumes_grads or c.watches_grads:
                c.grad_ready(key)

    def takes_part(self, key: str, grad: torch.Tensor) -> bool:
        """Whether a consumer kept this part of ``key``'s gradient (see :meth:`PassConsumer.takes_part`)."""
        return any(c.takes_part(key, grad) for c in self.attached)

    def grads_taken(self) -> str | None:
        """Why no gradient may be read now, or None."""
        return next((why for c in self.attached if (why := c.grads_taken()) is not None), None)

    def loaded(self, names: list[str]) -> None:
        for c in self.attached:
            c.loaded(names)

    def next_uses(self) -> dict[str, int]:
        """Every consumer's next uses, the nearest for a key used by several (on an evicting thread)."""
        out: dict[str, int] = {}
        for c in self.attached:
            for k, pos in c.next_uses().items():
                out[k] = min(pos, out.get(k, pos))
        return out

    def held_host_bytes(self) -> int:
        return sum(c.held_host_bytes() for c in self.attached)


def note_interrupt(error: BaseException, where: str, store: TierStore) -> None:
    """Add to a Ctrl-C (``KeyboardInterrupt``) or another ``BaseException`` that is no error where the run stood
    (``where``: what was let go, what to call next) and what becomes of the swap directory, so that it does not
    surface bare from a ``threading`` wait; an ordinary exception is left as it is."""
    if isinstance(error, Exception) or not hasattr(error, "add_note"):
        return
    swap = store.swap_directory
    error.add_note(f"tierstore: {where}" + (f"; the swap directory {swap} is removed when the store closes or the "
                                             f"process exits" if swap else ""))


class GradientSource(Protocol):
    """A model's gradients by store key: ``get``; ``pop`` also lets one go; ``claim``/``release_claim`` keep the bytes
    of one an update queued for later reads, whoever lets it go meanwhile (``OffloadedModel``'s alone: see [Note:
    Updates streamed into the next forward])."""

    def get(self, key: str, default: torch.Tensor | None = None) -> torch.Tensor | None: ...

    def pop(self, key: str, default: torch.Tensor | None = None) -> torch.Tensor | None: ...

    def claim(self, grad: torch.Tensor) -> None: ...

    def release_claim(self, grad: torch.Tensor, *, drop: bool) -> None: ...


@runtime_checkable
class OffloadedParameters(Protocol):
    """A model's parameters with their values in a store.

    - ``model``: the module whose parameters these are;
    - ``named_offloaded()``: (name, store key, parameter) of each offloaded parameter; ``resident``: name ->
      parameter of those kept in memory (stepped in memory too);
    - ``grads``: the gradient of a store key (``get``; ``pop`` also lets it go), as backward left it;
    - ``keeps_grads``: whether gradients are kept by the offload (read through ``grads``; ``grads_in_order()``
      lists them in ``model.parameters()`` order) rather than left in ``param.grad``;
    - ``attach(consumer)``/``detach(consumer)``: a :class:`PassConsumer` (an optimizer, the worker stepping in
      backward) told of the passes; ``consumers``: those attached; ``tells_loads``: whether its consumers hear of
      a load (False: weights are loaded before an optimizer is made); ``loaded(names)``: tell them of one;
      ``backwards_failed``: how many backward passes raised; ``final_gradients``: while ``accumulate`` runs its
      micro-batches, whether the gradient of a key backward completed just now is the step's (None: no
      ``accumulate`` runs);
    - ``later_uses`` and ``prefetch_policy``: what eviction weighs (an optimizer's state keys), the prefetch trace;
    - ``forward_order()``: store key -> its place in the last recorded forward, by first use;
      ``forward_distance(key)``: how many unit uses the running forward is from that key's parameter (inf: none
      runs on the recorded trace, it is past it, or the offload cannot tell; on FSDP2 ranks the root's forward);
    - ``in_forward_or_backward()``: whether a forward or backward of the model is running now;
    - ``held_beside_updates()``: offloaded parameter name -> bytes of the host tier that backward may hold while
      that parameter's update runs in backward (what the optimizer's host budget must leave room for);
    - ``follow_optimizer(home)``: the optimizer that steps these parameters keeps its state in ``home``: kept
      gradients live there too, unless the offload's policy chose their tier (``grad_tier``);
    - ``readahead_room()``: host bytes an optimizer's read-ahead may fill under the placement (None: no
      placement yet);
    - ``broken``: None, or a :class:`BrokenValues`: why the values can no longer be trusted (an update stopped
      or failed half-way), who set it and whether a step again mends it; every later forward and save raises it.
    """

    model: nn.Module
    store: TierStore
    home: Tier
    resident: dict[str, nn.Parameter]
    grads: GradientSource
    keeps_grads: bool
    tells_loads: bool
    final_gradients: Callable[[str], bool] | None
    later_uses: LaterUses
    broken: BrokenValues | None

    @property
    def prefetch_policy(self) -> PrefetchPolicy: ...

    @property
    def consumers(self) -> tuple[PassConsumer, ...]: ...

    @property
    def backwards_failed(self) -> int: ...

    def attach(self, consumer: PassConsumer) -> None: ...

    def detach(self, consumer: PassConsumer) -> None: ...

    def loaded(self, names: list[str]) -> None: ...

    def named_offloaded(self) -> Iterator[tuple[str, str, nn.Parameter]]: ...

    def read_param(self, name: str) -> torch.Tensor: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def grads_in_order(self) -> list[torch.Tensor]: ...

    def forward_order(self) -> dict[str, int]: ...

    def forward_distance(self, key: str) -> float: ...

    def in_forward_or_backward(self) -> bool: ...

    def held_beside_updates(self) -> dict[str, int]: ...

    def readahead_room(self) -> int | None: ...

    def follow_optimizer(self, home: Tier) -> None: ...


class KeptGradients(GradientSource, Protocol):
    """What backward does with a model's gradients (``_grads.GradientStore``): keeps them for a later step, adding
    each backward's into the kept one, or hands each to an optimizer stepping in backward."""

    def accumulate(self, param_key: str, grad: torch.Tensor, param_dtype: torch.dtype) -> None: ...

    def hand_over(self, param_key: str, grad: torch.Tensor) -> None: ...

    def dtype_of(self, param: torch.Tensor) -> torch.dtype: ...


__all__ = ["NOT_COPYABLE", "OPTIMIZER_PREFIX", "OPTIMIZER_STATE", "BrokenValues", "Consumers", "GradientSource",
           "KeptGradients", "Mend", "NotCopyable", "OffloadedParameterError", "OffloadedParameters", "PassConsumer",
           "note_interrupt", "optimizer_key", "zero_grads"]
