"""What both wrappers share: the :class:`~._contract.OffloadedParameters` contract implemented once.

``OffloadedModel`` (one process: ``offload.py``) and ``FSDPOffload`` (one rank's FSDP2 shards: ``fsdp.py``)
are both an :class:`OffloadBase`: a model's parameters given to a store under their names, split into units
(what one fetch brings into memory: a module's parameters for the model wrapper, an FSDP2 parameter group for
the shards), a prefetch policy over the units' trace, an eviction order, a placement, and the public tail an
optimizer and a checkpoint use. Each wrapper adds only how its units are fetched: hooks on the modules, or the
all-gather of FSDP2.

Every offloaded parameter is a record with ``name``, ``key`` (its store key), ``param`` and ``nbytes`` (the
bytes the store holds); every unit one with ``name``, ``params`` (those records) and ``nbytes``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn

from tierstore import Tier, TierKeyError, TierStore, TierStoreError, TierTypeError, TierValueError
from tierstore.memory import TierPool
from tierstore.scheduling import LaterUses, Placement, PrefetchPolicy, unit_victim_order

from ._contract import OPTIMIZER_PREFIX, BrokenValues, Mend, OffloadedParameters, PassConsumer
from ._meta import unmaterialize
from ._placing import AUTO_START_DEPTH, Placer, StepStarts

STATE_KEY = "_tierstore_offload"  # the attribute of an offloaded module that holds its OffloadBase


class OffloadedParameterError(TierStoreError):
    """An offloaded parameter's values were needed where tierstore cannot fetch them, or can no longer be
    trusted."""


@dataclass
class UnitStats:
    """What the units' fetches did since the offload began (the store keeps its own counters)."""

    stall_seconds_by_unit: dict[str, float] = field(default_factory=dict)
    """Seconds the training loop waited for each unit's parameters to arrive."""
    prefetches_issued: int = 0
    prefetch_depth: int = 0
    """The prefetch depth of this step (chosen each step with ``prefetch_depth="auto"``)."""

    @property
    def stall_seconds_by_group(self) -> dict[str, float]:
        """Deprecated: ``stall_seconds_by_unit`` (the old name; it goes in the next release)."""
        warnings.warn("stall_seconds_by_group is now stall_seconds_by_unit", DeprecationWarning, stacklevel=2)
        return self.stall_seconds_by_unit


def offloaded_of(model: nn.Module) -> OffloadBase | None:
    """The offload of ``model`` (by ``offload_model`` or ``offload_fsdp``), or None."""
    return model.__dict__.get(STATE_KEY)


def check_not_offloaded(model: nn.Module, wrapper: str) -> None:
    """Refuse a module that is not a module, or that is offloaded already (either way)."""
    if not isinstance(model, nn.Module):
        raise TierTypeError(f"{wrapper} needs an nn.Module, not {type(model).__name__}")
    off = offloaded_of(model)
    if off is not None:
        raise TierValueError(f"this module is already offloaded (by {type(off).__name__}); call .remove() on it "
                             f"first")


class OffloadBase(OffloadedParameters):
    """The contract, the schedule and the public tail of an offloaded model; see the module docstring."""

    stats: UnitStats
    params: dict[int, Any]  # id(parameter) -> its record
    _units: dict[str, Any]  # unit name -> its record
    prefix: str  # of its parameters' store keys

    def __init__(self, model: nn.Module, store: TierStore, home: Tier) -> None:
        self.model = model
        self.store = store
        self.home = home
        self.resident: dict[str, nn.Parameter] = {}
        self.params = {}
        self._units = {}
        # What reacts to the passes (see [Note: Consumers of a pass]): a tuple replaced whole, read by evicting
        # threads.
        self.consumers: tuple[PassConsumer, ...] = ()
        self.tells_loads = True  # whether a load of the weights reaches the consumers (see OffloadedParameters)
        # An optimizer's state keys, which eviction weighs with the trace's.
        self.later_uses = LaterUses()
        # Store keys of others that this model's victim order ranks through a consumer's next uses (a layer-major
        # step's activations: see [Note: Activations in the tiers]).
        self.claimed: set[str] = set()
        # whether gradients are kept by the offload (``grads``), not in ``param.grad``
        self.keeps_grads = True
        self.broken: BrokenValues | None = None  # why the values can no longer be trusted (see OffloadedParameters)
        self.backwards_failed = 0  # backward passes that raised (an optimizer stepping in backward asks)
        self._steps = StepStarts()
        self._by_key: dict[str, Any] = {}
        self._key_units: dict[str, tuple[str, ...]] = {}

    # ---- construction -------------------------------------------------------------------
    @contextmanager
    def putting(self) -> Iterator[tuple[list, list[Callable[[], None]]]]:
        """The put/undo transaction: yields (store put handles, undo steps of a meta build); on any error the
        store holds nothing of the model and the model is as it was given."""
        handles: list = []
        undo: list[Callable[[], None]] = []
        try:
            yield handles, undo
            for h in handles:
                h.wait()
        except BaseException:
            self.store.undo_puts(handles)
            unmaterialize(undo)
            self.params.clear()
            raise

    def _schedule(self, *, prefetch_depth: int | str, prefetch_bytes: int | None, placement: bool,
                  trace: list[str] | None = None, grad_of: Callable[[str], tuple[str, int] | None] | None = None,
                  forward_uses: int | None = None) -> None:
        """The prefetch policy over the units, the eviction order and the placement (once the units exist)."""
        auto = prefetch_depth == "auto"
        self.prefetch_policy = PrefetchPolicy(depth=AUTO_START_DEPTH if auto else int(prefetch_depth),
                                              max_bytes=prefetch_bytes,
                                     unit_bytes={u.name: u.nbytes for u in self._units.values()}, trace=trace,
                                     forward_uses=forward_uses)
        self.stats.prefetch_depth = self.prefetch_policy.depth
        self._by_key = {r.key: r for r in self.params.values()}
        for u in self._units.values():
            for r in u.params:
                self._key_units[r.key] = (*self._key_units.get(r.key, ()), u.name)
        # Which of its copies eviction should drop first (Belady over its trace and its optimizer's queue).
        self.victim_order = unit_victim_order(self.prefetch_policy, self._key_units, self.later_uses,
                                              waiting=self._next_uses)
        self._victim_token = self.store.add_victim_order(
            self.victim_order, owns=self._owns)
        # What stays in the host tier for the whole run, and the depth with "auto" (see integrations/_placing.py).
        self.placer = Placer(self.store, self.prefetch_policy, self.later_uses, held_beside=self._held_host_bytes,
                             unit_keys=self._unit_keys,
                             place=placement, auto_depth=auto, grad_of=grad_of)

    # ---- consumers (see [Note: Consumers of a pass]) ------------------------------------------
    def attach(self, consumer: PassConsumer) -> None:
        """``consumer`` is told of the passes from now on, until :meth:`detach` (or ``remove()``)."""
        if consumer not in self.consumers:
            self.consumers = (*self.consumers, consumer)

    def detach(self, consumer: PassConsumer) -> None:
        self.consumers = tuple(c for c in self.consumers if c is not consumer)

    def consumes_grads(self) -> bool:
        """Whether a consumer takes each gradient as it completes (an update stepping in backward)."""
        return any(c.consumes_grads for c in self.consumers)

    def grad_ready(self, key: str) -> None:
        for c in self.consumers:
            if c.consumes_grads:
                c.grad_ready(key)

    def grads_taken(self) -> str | None:
        """Why no gradient may be read now, or None."""
        return next((why for c in self.consumers if (why := c.grads_taken()) is not None), None)

    def loaded(self, names: list[str]) -> None:
        """A load wrote these parameters: the consumers hear of it (an optimizer remakes their masters)."""
        for c in self.consumers:
            c.loaded(names)

    def _next_uses(self) -> dict[str, int]:
        """Every consumer's next uses, the nearest for a key used by several (on an evicting thread)."""
        out: dict[str, int] = {}
        for c in self.consumers:
            for k, pos in c.next_uses().items():
                out[k] = min(pos, out.get(k, pos))
        return out

    def _held_host_bytes(self) -> int:
        return sum(c.held_host_bytes() for c in self.consumers)

    def _owns(self, key: str) -> bool:
        """Whether this model's victim order ranks ``key``: its parameters, their optimizer state and kept
        gradients."""
        later = self.later_uses
        return key in self._key_units or key in later.after or key in later.grads or key in self.claimed

    def _unit_keys(self) -> dict[str, list[tuple[str, int]]]:
        return {u.name: [(r.key, TierPool.capacity_for(r.nbytes)) for r in u.params]
                for u in self._units.values() if u.params}

    # ---- a step ---------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self.broken is not None:
            raise OffloadedParameterError(str(self.broken))

    def _begin_step(self) -> None:
        """A forward of the model starts a step, unless it is one more forward of the same step (see [Note:
        Several forwards, one backward])."""
        if not self._steps.forward():
            return
        self.prefetch_policy.start_step()
        self.placer.start_step()
        self.stats.prefetch_depth = self.prefetch_policy.depth

    def prefetch_after(self, unit: Any, tier: Tier) -> None:
        """``unit`` is about to be used: read ahead the units the policy names."""
        for name in self.prefetch_policy.on_use(unit.name, self.placer.clock()):
            for r in self._units[name].params:
                self.store.prefetch(r.key, tier)
                self.stats.prefetches_issued += 1

    def add_stall(self, unit: Any, since: float) -> None:
        by_unit = self.stats.stall_seconds_by_unit
        by_unit[unit.name] = by_unit.get(unit.name, 0.0) + time.perf_counter() - since

    # ---- what OffloadedAdamW and checkpoints use (see OffloadedParameters) -------------------
    def named_offloaded(self) -> Iterator[tuple[str, str, nn.Parameter]]:
        """(name, store key, parameter) of every offloaded parameter."""
        for r in self.params.values():
            yield r.name, r.key, r.param

    def read_param(self, name: str) -> torch.Tensor:
        """A copy (on CPU) of the parameter's current value (this rank's local shard under FSDP2), read from
        wherever it lives."""
        self._check_attached()
        r = next((r for r in self.params.values() if r.name == name), None)
        if r is not None:
            return self.store.read(r.key)
        if name in self.resident:
            return self.resident[name].detach().cpu().clone()
        raise TierKeyError(f"no parameter named {name!r}")

    def units(self) -> dict[str, list[str]]:
        """Each unit that holds parameters (module name, ``""`` for the root) with the names of what it fetches
        at once: a module's own parameters and those its forward was seen to read (see [Note: Units]), or an
        FSDP2 parameter group's shards."""
        return {u.name: [r.name for r in u.params] for u in self._units.values() if u.params}

    def grads_in_order(self) -> list[torch.Tensor]:
        """The gradient of every parameter that has one, in ``model.parameters()`` order (tied ones once)."""
        out = []
        for p in self.model.parameters():
            r = self.params.get(id(p))
            grad = p.grad if r is None else self.grads.get(r.key)
            if grad is not None:
                out.append(grad)
        return out

    def in_forward_or_backward(self) -> bool:
        return False

    def held_beside_updates(self) -> dict[str, int]:
        return {}

    def readahead_room(self) -> int | None:
        return self.placer.readahead_room()

    def host_budget_split(self) -> dict[str, int | None]:
        """How the host budget is shared now (see [Note: Splitting the host budget]): the budget, what the
        placement keeps all run, the room for copies in flight and what consumers hold beside the units, in
        bytes."""
        placement = self.placer.placement
        return self.placer.host.split(kept_bytes=placement.resident_bytes if placement is not None else 0,
                                      room_bytes=placement.room_bytes if placement is not None else None,
                                      held_beside_bytes=self._held_host_bytes())

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

    def local_state_bytes(self) -> dict[str, int]:
        """Bytes of this model's parameters and optimizer state in the store (this rank's under FSDP2), by home
        tier."""
        names = {r.name for r in self.params.values()} | set(self.resident)
        out: dict[str, int] = {}
        for key in self.store.keys():
            # this model's parameters and their state only: other models may share the store
            name = key[len(OPTIMIZER_PREFIX):].rpartition("/")[0] if key.startswith(OPTIMIZER_PREFIX) else None
            if key in self._by_key or name in names:
                info = self.store.info(key)
                out[info["home"]] = out.get(info["home"], 0) + info["nbytes"]
        return out

    def _detach(self, handles: Iterable[Any]) -> None:
        """What ``remove()`` undoes once the values are back: optimizers drop their state, hooks go, and the
        schedule lets go of the store."""
        for consumer in self.consumers:
            consumer.removed()
        self.consumers = ()
        for h in handles:
            h.remove()
        self.store.remove_victim_order(self._victim_token)
        self.placer.close()

    removed = False  # remove() (or store.close()) has run: the module is no longer offloaded

    def _check_attached(self) -> None:
        if self.removed:
            raise TierStoreError(f"this offload of {type(self.model).__name__} was removed (off.remove(), or "
                                 f"store.close(), which gives the model its values back): its parameters are ordinary "
                                 f"tensors again; read them from the model (model.state_dict())")

    def _forget(self) -> None:
        """The last of ``remove()``: the module is no longer offloaded."""
        self.removed = True
        self.params.clear()
        self.model.__dict__.pop(STATE_KEY, None)
        self.store.detach_user(self)

    # ---- the store closing (tierstore.StoreUser) ------------------------------------------
    def close_refusal(self, claimed: dict[str, int]) -> str | None:
        """Why ``store.close()`` cannot give this model its values back now, or None (see ``TierStore.close``):
        ``claimed`` is what the store's users before it take of each device's memory; it adds its own."""
        what = f"{type(self.model).__name__} is offloaded to this store ({self.wrapper_name})"
        if self.running_pass():
            return f"{what} and inside a forward or backward; close the store after the step"
        if self.broken is not None and self.broken.mend is Mend.BY_STEPPING_AGAIN:
            return (f"{what}, and its last step stopped part-way, so its values are part of a step ahead: call "
                    f"opt.step() to finish the step first, or drop them with off.remove(keep_values=False) "
                    f"({self.broken})")
        need = sum(r.nbytes for r in self.params.values())
        device = self.give_back_device()
        taken = claimed.get(str(device), 0)
        free = free_memory_bytes(device) - taken
        if need > free:
            return (f"{what}, and its {need / 2**30:.2f} GiB of values live only here, more than the "
                    f"{free / 2**30:.2f} GiB of {device.type} memory free to give them back into. Save them first "
                    f"(save_checkpoint(path, model, optimizer) or model.save_pretrained(path)), then "
                    f"{self.drop_hint}")
        claimed[str(device)] = taken + need
        return None

    def store_closing(self) -> None:
        """The store closes: the model gets its values back as ``remove()`` gives them."""
        self.remove()

    def running_pass(self) -> bool:
        """Whether a forward or backward of the model is running now (not one that raised and left holds)."""
        return self.in_forward_or_backward()

    wrapper_name = "offload_model"
    drop_hint = "drop them with off.remove(keep_values=False) and close the store"

    def give_back_device(self) -> torch.device:
        """Where ``remove()`` puts the values back."""
        return torch.device("cpu")

    def __deepcopy__(self, memo: dict) -> Any:
        raise TierTypeError(_NOT_COPYABLE)

    def __reduce_ex__(self, protocol: object) -> Any:
        raise TierTypeError(_NOT_COPYABLE)


_NOT_COPYABLE = ("an offloaded model cannot be copied or pickled: its parameters live in the store and its module "
                 "holds placeholders. Copy it before offload_model (or offload_fsdp), call .remove() first, or save "
                 "it with state_dict() (which reads the real values) or save_checkpoint()")


def free_memory_bytes(device: torch.device) -> int:
    """Bytes of memory free on ``device`` now: CUDA's free memory with what torch's caching allocator holds unused,
    else the system's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                   - torch.cuda.memory_allocated(device))
    return int(psutil.virtual_memory().available)


__all__ = ["STATE_KEY", "OffloadBase", "OffloadedParameterError", "UnitStats", "check_not_offloaded",
           "offloaded_of"]
