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

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from torch import nn

from tierstore import Tier, TierKeyError, TierStore, TierStoreError, TierTypeError, TierValueError
from tierstore.scheduling import LaterUses, Placement, PrefetchPolicy, unit_victim_order

from ._budget import HostBudget
from ._contract import (
    OPTIMIZER_PREFIX, BrokenValues, Consumers, Mend, NotCopyable, OffloadedParameterError, OffloadedParameters,
    PassConsumer,
)
from ._meta import putting
from ._placing import AUTO_START_DEPTH, Placer, StepStarts, UnitSchedule

STATE_KEY = "_tierstore_offload"  # the attribute of an offloaded module that holds its OffloadBase


def same_values(held: torch.Tensor | None, value: Any) -> bool:
    """Whether a load gives a held parameter the very values it has, bit for bit (another dtype counts as other
    values)."""
    if held is None or not isinstance(value, torch.Tensor) or value.shape != held.shape or value.dtype != held.dtype:
        return False
    bits = [t.detach().to(held.device).reshape(-1).view(torch.uint8) for t in (held, value)]
    return held.numel() == 0 or torch.equal(*bits)


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


class OffloadBase(NotCopyable, OffloadedParameters):
    """The contract, the schedule and the public tail of an offloaded model; see the module docstring."""

    stats: UnitStats
    params: dict[int, Any]  # id(parameter) -> its record
    _units: dict[str, Any]  # unit name -> its record
    prefix: str  # of its parameters' store keys

    streams_updates = False
    speculates = False
    # Within ``accumulate``: whether a gradient backward completes is the step's (see [Note: Speculated updates]).
    final_gradients: Callable[[str], bool] | None = None
    """Whether an optimizer may stream its updates into the next forward (see [Note: Updates streamed into the
    next forward]): every read of a parameter's values goes through the store, which waits for a queued update."""

    def __init__(self, model: nn.Module, store: TierStore, home: Tier, stats: UnitStats) -> None:
        self.model = model
        self.stats = stats
        self.store = store
        self.home = home
        self.resident: dict[str, nn.Parameter] = {}
        self.params = {}
        # What reacts to the passes (see [Note: Consumers of a pass]), given to the levels below as it is.
        self.pass_consumers = Consumers()
        self.tells_loads = True  # whether a load of the weights reaches the consumers (see OffloadedParameters)
        # An optimizer's state keys, which eviction weighs with the trace's.
        self.later_uses = LaterUses()
        # Store keys of others that this model's victim order ranks through a consumer's next uses (a layer-major
        # step's activations: see [Note: Activations in the tiers]).
        self.claimed: set[str] = set()
        # whether gradients are kept by the offload (``grads``), not in ``param.grad``
        self.keeps_grads = True
        self.broken: BrokenValues | None = None  # why the values can no longer be trusted (see OffloadedParameters)
        self._steps = StepStarts()
        self._by_key: dict[str, Any] = {}
        # The units, their read-ahead and stalls: what the levels below are given (see UnitSchedule).
        self.schedule = UnitSchedule(store, self.stats)
        # how state_dict() reads offloaded values: into ordinary copies, or mapped ones beyond the host budget
        self._state_dict_read: Callable[[str], torch.Tensor] | None = None

    @property
    def backwards_failed(self) -> int:
        """Backward passes that raised (an optimizer stepping in backward asks); FSDP2's ranks count none."""
        return 0

    @property
    def consumers(self) -> tuple[PassConsumer, ...]:
        """The consumers attached now (see [Note: Consumers of a pass])."""
        return self.pass_consumers.attached

    @property
    def _units(self) -> dict[str, Any]:
        return self.schedule.units

    @property
    def _key_units(self) -> dict[str, tuple[str, ...]]:
        return self.schedule.key_units

    @property
    def prefetch_policy(self) -> PrefetchPolicy:
        assert self.schedule.policy is not None
        return self.schedule.policy

    @property
    def placer(self) -> Placer:
        assert self.schedule.placer is not None
        return self.schedule.placer

    # ---- construction -------------------------------------------------------------------
    def putting(self) -> AbstractContextManager[tuple[list, list[Callable[[], None]]]]:
        """The put/undo transaction (see ``_meta.putting``): on any error the store holds nothing of the model."""
        return putting(self.store, self.params)

    def _schedule(self, *, prefetch_depth: int | str, prefetch_bytes: int | None, placement: bool,
                  trace: list[str] | None = None, grad_of: Callable[[str], tuple[str, int] | None] | None = None,
                  forward_uses: int | None = None) -> None:
        """The prefetch policy over the units, the eviction order and the placement (once the units exist)."""
        auto = prefetch_depth == "auto"
        schedule = self.schedule
        schedule.policy = PrefetchPolicy(depth=AUTO_START_DEPTH if auto else int(prefetch_depth),
                                         max_bytes=prefetch_bytes, trace=trace, forward_uses=forward_uses,
                                         unit_bytes={u.name: u.nbytes for u in schedule.units.values()})
        self.stats.prefetch_depth = schedule.policy.depth
        self._by_key = {r.key: r for r in self.params.values()}
        for u in schedule.units.values():
            for r in u.params:
                schedule.key_units[r.key] = (*schedule.key_units.get(r.key, ()), u.name)
        # Which of its copies eviction should drop first (Belady over its trace and its optimizer's queue).
        self.victim_order = unit_victim_order(schedule.policy, schedule.key_units, self.later_uses,
                                              waiting=self.pass_consumers.next_uses)
        self._victim_token = self.store.add_victim_order(self.victim_order, owns=self._owns)
        # What stays in the host tier for the whole run, and the depth with "auto" (see integrations/_placing.py).
        schedule.placer = Placer(self.store, schedule.policy, self.later_uses,
                                 held_beside=self.pass_consumers.held_host_bytes, unit_keys=schedule.unit_keys,
                                 place=placement, auto_depth=auto, grad_of=grad_of)

    # ---- consumers (see [Note: Consumers of a pass]) ------------------------------------------
    def attach(self, consumer: PassConsumer) -> None:
        """``consumer`` is told of the passes from now on, until :meth:`detach` (or ``remove()``)."""
        self.pass_consumers.attach(consumer)

    def detach(self, consumer: PassConsumer) -> None:
        self.pass_consumers.detach(consumer)

    def loaded(self, names: list[str]) -> None:
        """A load wrote these parameters: the consumers hear of it (an optimizer remakes their masters)."""
        self.pass_consumers.loaded(names)

    def _owns(self, key: str) -> bool:
        """Whether this model's victim order ranks ``key``: its parameters, their optimizer state and kept
        gradients."""
        later = self.later_uses
        return key in self._key_units or key in later.after or key in later.grads or key in self.claimed

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

    def _named_by_load(self, module: nn.Module, state_dict: Any, prefix: str,
                       local_metadata: dict) -> list[tuple[Any, Any]]:
        """(record, value) of each offloaded parameter ``module`` itself owns that a load (a load_state_dict
        pre-hook's arguments) names; one with ``assign=True`` is refused, as it would replace them."""
        mine = [(r, state_dict[prefix + pname]) for pname, r in self._owned(module) if prefix + pname in state_dict]
        if mine and local_metadata.get("assign_to_params_buffers"):
            raise OffloadedParameterError(f"load_state_dict(assign=True) would replace the parameters "
                                          f"{self.wrapper_name} keeps by new tensors; load with assign=False, or "
                                          f"before {self.wrapper_name}")
        return mine

    def _owned(self, module: nn.Module) -> Iterator[tuple[str, Any]]:
        """(its name in ``module``, its record) of each offloaded parameter ``module`` itself owns: what the state
        dict hooks of that module read and write."""
        for pname, p in module._parameters.items():
            if p is not None and (record := self.params.get(id(p))) is not None:
                yield pname, record

    def _state_dict_value(self, record: Any) -> torch.Tensor:
        """What ``model.state_dict()`` holds for an offloaded parameter (``record``: its entry in ``params``): its
        value read from the store, an ordinary copy, or, for a model beyond the host budget, a mapped one (see
        [Note: A whole state dict beyond the host budget])."""
        if self._state_dict_read is None:  # decided once: the hooks of each module ask it
            self._state_dict_read = HostBudget(self.store).state_dict_reader(r.key for r in self.params.values())
        return self._state_dict_read(record.key)

    def units(self) -> dict[str, list[str]]:
        """Each unit that holds parameters (module name, ``""`` for the root) with the names of what it fetches
        at once: a module's own parameters and those its forward was seen to read (see [Note: Units]), or an
        FSDP2 parameter group's shards."""
        return {u.name: [r.name for r in u.params] for u in self._units.values() if u.params}

    def forward_distance(self, key: str) -> float:
        """How many unit uses from now the running forward reaches the parameter of ``key`` (inf when no forward
        runs on the recorded trace, or none the offload sees, or it is past that parameter)."""
        if not self._forward_runs():
            return float("inf")
        policy = self.prefetch_policy
        return min((policy.forward_use_distance(u) for u in self._key_units.get(key, ())), default=float("inf"))

    def forward_order(self) -> dict[str, int]:
        """Store key -> its place among the keys the last recorded step's forward used, by first use (empty before
        a step is recorded)."""
        policy = self.prefetch_policy
        trace = policy.trace or []
        out: dict[str, int] = {}
        for name in trace[:len(trace) if policy.forward_uses is None else policy.forward_uses]:
            for r in self._units[name].params:
                out.setdefault(r.key, len(out))
        return out

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

    def _forward_runs(self) -> bool:
        """Whether a forward of the model runs now (False where the offload cannot tell)."""
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
                                      held_beside_bytes=self.pass_consumers.held_host_bytes())

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
            self.pass_consumers.detach(consumer)
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



def free_memory_bytes(device: torch.device) -> int:
    """Bytes of memory free on ``device`` now: CUDA's free memory with what torch's caching allocator holds unused,
    else the system's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                   - torch.cuda.memory_allocated(device))
    return int(psutil.virtual_memory().available)


__all__ = ["STATE_KEY", "OffloadBase", "OffloadedParameterError", "UnitStats", "check_not_offloaded", "same_values",
           "offloaded_of"]
