"""ZeRO-3 with an NVMe tier: each rank's FSDP2 shards live in a TierStore and are read ahead of the all-gathers.

After ``fully_shard`` has been applied as usual, :func:`offload_fsdp`
puts every rank's local shards (the tensors FSDP2 all-gathers) into that
rank's store, home NVMe by default, and frees their memory. Before FSDP2
all-gathers a parameter group -- in forward, in backward, or as one of its
own prefetches -- the group's shards are copied back from the store (the
prefetch scheduler has read them into the host tier ahead of time, in the
order recorded on the first step); once the all-gather has consumed them
they are freed again. Gradients stay as FSDP2 leaves them (sharded, in
``param.grad``); :class:`~tierstore.integrations.optim.OffloadedAdamW`
steps each rank's shards with their state in the store.

[Note: Freeing a shard] A shard's memory is freed by resizing its storage
to zero bytes and restored by resizing it back, as FSDP2 does with its
unsharded parameters: the tensors FSDP2 keeps (the padded shard and the
DTensor's local view of it) stay the same objects, so nothing of FSDP2's
state needs rewriting. The private details this relies on are in
``_fsdp_internals.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tierstore import Tier, TierStore
from tierstore._memory import TierPool
from tierstore._placement import Placement
from tierstore._schedule import LaterUses, PrefetchPolicy, group_victim_order

from . import _fsdp_internals as internals
from ._contract import OPTIMIZER_PREFIX, OffloadedParameters, zero_grads
from ._meta import check_meta, materialize, unmaterialize
from ._placing import AUTO_START_DEPTH, Placer, StepStarts, check_options

_STATE_KEY = "_tierstore_fsdp"


@dataclass(eq=False)
class _Shard:
    name: str
    key: str
    param: nn.Parameter  # the sharded DTensor parameter
    local: torch.Tensor  # its local tensor: a view of the padded shard's storage
    storage_nbytes: int  # the padded shard's size


@dataclass(eq=False)
class _ShardGroup:
    name: str
    shards: list[_Shard]
    nbytes: int
    materialized: bool = True  # the shards' storage holds their current values
    remove: Any = None


@dataclass
class FSDPOffloadStats:
    stall_seconds_by_group: dict[str, float] = field(default_factory=dict)
    prefetches_issued: int = 0
    unshards: int = 0


class _ShardGrads:
    """``grads.get(key)``: the local shard of that parameter's gradient, as FSDP2 left it."""

    def __init__(self, by_key: dict[str, _Shard]) -> None:
        self._by_key = by_key

    def get(self, key: str, default: Any = None) -> torch.Tensor | None:
        sh = self._by_key.get(key)
        if sh is None or sh.param.grad is None:
            return default
        return sh.param.grad.to_local()

    def pop(self, key: str, default: Any = None) -> torch.Tensor | None:
        """The gradient shard, dropped from its parameter (its memory goes once the caller is done)."""
        grad = self.get(key, default)
        sh = self._by_key.get(key)
        if sh is not None:
            sh.param.grad = None
        return grad


class FSDPOffload(OffloadedParameters):
    """The NVMe tier under one rank's FSDP2 shards; returned by :func:`offload_fsdp`."""

    def __init__(self, model: nn.Module, store: TierStore, *, prefetch_depth: int | str, prefetch_bytes: int | None,
                 home: Tier, init_fn: Callable[[nn.Module], None] | None = None, placement: bool = True,
                 real_parameters: str | None = None) -> None:
        self.model = model
        self.store = store
        self.home = home
        self.stats = FSDPOffloadStats()
        self.resident: dict[str, nn.Parameter] = {}
        # Called with a store key once that shard's gradient for this backward is reduced and assigned.
        self.grad_ready_callbacks: list[Callable[[str], None]] = []
        # An optimizer's uses of store keys, which eviction weighs with the trace's.
        self.later_uses = LaterUses()
        self.on_remove: list[Callable[[], None]] = []  # called by remove(): optimizers drop their state
        self.broken: str | None = None  # why the values can no longer be trusted (see OffloadedParameters)
        self.groups: dict[str, _ShardGroup] = {}
        self.params: dict[int, _Shard] = {}  # id(param) -> shard
        groups = list(internals.fsdp_groups(model))
        for gname, _module, group in groups:
            internals.check_group_supported(gname, group)
        if not any(internals.group_params(group) for _, _, group in groups):
            raise ValueError("no fully_shard-ed module with parameters found; apply fully_shard before offload_fsdp")
        meta = check_meta(model, init_fn, real_parameters)
        sharded = {id(p) for _, _, group in groups for p in internals.group_params(group)}
        outside = [n for n, p in model.named_parameters() if id(p) not in sharded]
        if outside:  # an optimizer of the shards would never step them
            raise ValueError(f"{len(outside)} parameter(s) belong to no fully_shard-ed module: "
                             f"{', '.join(outside[:4])}{', ...' if len(outside) > 4 else ''}; apply fully_shard to "
                             f"the root module too (after its blocks), as FSDP2 recommends")
        if home is Tier.NVME:
            need = sum(internals.local_shard(p).numel() * p.element_size() for _, _, g in groups
                       for p in internals.group_params(g))
            store.require_nvme_room(need, "offloading {size} of this rank's parameter shards")
        names = {id(p): n for n, p in model.named_parameters()}
        put: dict[int, int] = {}  # id(param) -> the padded shard's bytes, for each shard given to the store
        handles: list = []
        undo: list[Callable[[], None]] = []

        def give(p: nn.Parameter, *, free: bool) -> None:
            """Put ``p``'s local shard in the store; with ``free``, its memory goes once it is there."""
            local = internals.local_shard(p)
            put[id(p)] = local.untyped_storage().nbytes()
            handles.append(store.put(f"fsdp/{names[id(p)]}", local.detach().contiguous(), home=home))
            if free:
                handles[-1].wait()
                local.untyped_storage().resize_(0)

        try:
            if meta:  # one module's tensors in memory at a time (see [Note: Building on the meta device])
                done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
                by_id = internals.fsdp_params_by_id(model)

                def adopt(p: nn.Parameter) -> Callable[[], None]:
                    return internals.adopt_local_tensor(by_id[id(p)]) if id(p) in by_id else lambda: None

                for mname, module in model.named_modules():
                    fresh = materialize(module, init_fn, done, undo, in_place=True, adopt=adopt, mname=mname,
                                        initialize_real=real_parameters == "initialize")
                    for p in fresh:
                        if id(p) in sharded:
                            give(p, free=True)
            for _, _, group in groups:
                for p in internals.group_params(group):
                    if id(p) not in put:
                        give(p, free=meta)
            for h in handles:
                h.wait()
        except BaseException:  # the store holds nothing of the model, and a meta model is on meta again
            store.undo_puts(handles)
            unmaterialize(undo)
            raise
        for gname, _module, group in groups:
            shards = []
            for p in internals.group_params(group):
                name = names[id(p)]
                sh = _Shard(name, f"fsdp/{name}", p, internals.local_shard(p), put[id(p)])
                shards.append(sh)
                self.params[id(p)] = sh
            self.groups[gname] = _ShardGroup(gname, shards, sum(s.local.numel() * s.local.element_size()
                                                                 for s in shards), materialized=not meta)
        for gname, _module, group in groups:
            sg = self.groups[gname]
            sg.remove = internals.wrap_group(group, lambda sg=sg: self._materialize(sg), lambda sg=sg: self._free(sg),
                                             lambda sg=sg, group=group: self._gradients_ready(sg, group))
        self._by_key = {sh.key: sh for sh in self.params.values()}
        self.grads = _ShardGrads(self._by_key)
        auto = prefetch_depth == "auto"
        self.policy = PrefetchPolicy(depth=AUTO_START_DEPTH if auto else int(prefetch_depth), max_bytes=prefetch_bytes,
                                     group_bytes={g.name: g.nbytes for g in self.groups.values()})
        self._key_group = {sh.key: (g.name,) for g in self.groups.values() for sh in g.shards}
        # Which of its copies eviction should drop first (Belady over its trace and its optimizer's queue).
        self.victim_order = group_victim_order(self.policy, self._key_group, self.later_uses)
        self._victim_token = store.add_victim_order(
            self.victim_order, owns=lambda k: k in self._key_group or k in self.later_uses.after)
        self._steps = StepStarts()
        self._hook = model.register_forward_pre_hook(self._start_step, prepend=True)
        # What stays in the host tier for the whole run, and the depth with "auto" (see integrations/_placing.py).
        self.placer = Placer(store, self.policy, self.later_uses, group_keys=self._group_keys,
                             place=placement, auto_depth=auto)

    # ---- the all-gather loop -----------------------------------------------------------
    def _start_step(self, module: nn.Module, args: Any) -> None:
        if self.broken:
            raise RuntimeError(self.broken)
        if not self._steps.forward():  # see [Note: Several forwards, one backward]
            return
        self.policy.start_step()
        self.placer.start_step()

    def _group_keys(self) -> dict[str, list[tuple[str, int]]]:
        return {g.name: [(sh.key, TierPool.capacity_for(sh.local.numel() * sh.local.element_size()))
                         for sh in g.shards] for g in self.groups.values()}

    def _materialize(self, sg: _ShardGroup) -> None:
        """Before FSDP2 all-gathers ``sg``: its shards' storage back, filled from the store."""
        self.stats.unshards += 1
        if torch._C._current_graph_task_id() != -1:  # an all-gather for backward (its pre-backward hook)
            self.policy.backward_starts()
        for name in self.policy.on_use(sg.name, self.placer.clock()):
            for sh in self.groups[name].shards:
                self.store.prefetch(sh.key, Tier.HOST)
                self.stats.prefetches_issued += 1
        t0 = time.perf_counter()
        for sh in sg.shards:
            storage = sh.local.untyped_storage()
            if storage.nbytes() != sh.storage_nbytes:
                storage.resize_(sh.storage_nbytes)
                used = sh.local.numel() * sh.local.element_size()
                if used < sh.storage_nbytes:  # FSDP2's padding: all-gathered, never read
                    torch.empty(0, dtype=torch.uint8, device=sh.local.device).set_(storage)[used:].zero_()
            if sh.local.numel():
                with torch.no_grad():
                    sh.local.copy_(self.store.get(sh.key, Tier.HOST))
                self.store.release(sh.key, Tier.HOST)
        by_group = self.stats.stall_seconds_by_group
        by_group[sg.name] = by_group.get(sg.name, 0.0) + time.perf_counter() - t0
        sg.materialized = True

    def _gradients_ready(self, sg: _ShardGroup, group: Any) -> None:
        self._steps.backward()
        if not self.grad_ready_callbacks:
            return
        ready = [sh.key for sh in sg.shards if sh.param.grad is not None]
        if ready:
            internals.wait_for_gradients(group)
        for key in ready:
            for callback in self.grad_ready_callbacks:
                callback(key)

    def _free(self, sg: _ShardGroup) -> None:
        """The all-gather has read the shards: free their memory (see [Note: Freeing a shard])."""
        if not sg.materialized:
            return
        for sh in sg.shards:
            sh.local.untyped_storage().resize_(0)
        sg.materialized = False

    # ---- what OffloadedAdamW and checkpoints use ----------------------------------------
    def named_offloaded(self) -> Iterator[tuple[str, str, nn.Parameter]]:
        """(name, store key, sharded parameter) of every offloaded shard."""
        for sh in self.params.values():
            yield sh.name, sh.key, sh.param

    def read_param(self, name: str) -> torch.Tensor:
        """A CPU copy of this rank's local shard of parameter ``name``."""
        sh = next((s for s in self.params.values() if s.name == name), None)
        if sh is None:
            raise KeyError(f"no offloaded parameter named {name!r}")
        return self.store.read(sh.key)

    def in_forward_or_backward(self) -> bool:
        """False: FSDP2 gathers from its own copies of the shards, so nothing of the store is held in a step."""
        return False

    def held_beside_updates(self) -> dict[str, int]:
        """None: a shard restored for an all-gather is FSDP2's memory, not the host tier's."""
        return {}

    def readahead_room(self) -> int | None:
        return self.placer.readahead_room()

    @property
    def placement(self) -> Placement | None:
        """This rank's placement (see ``OffloadedModel.placement``)."""
        return self.placer.placement

    @property
    def placement_verdict(self) -> str | None:
        return self.placer.verdict

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient shards, or zero them in place (``set_to_none=False``), as torch does."""
        zero_grads((sh.param for sh in self.params.values()), set_to_none)

    def local_state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's parameter shards and optimizer state in the store, by home tier."""
        out: dict[str, int] = {}
        for key in self.store.keys():
            if key.startswith(("fsdp/", OPTIMIZER_PREFIX)):
                info = self.store.info(key)
                out[info["home"]] = out.get(info["home"], 0) + info["nbytes"]
        return out

    def remove(self) -> None:
        """Put every shard back in memory (current values) and detach from FSDP2 (an optimizer of it drops its
        state)."""
        for drop in self.on_remove:
            drop()
        self.on_remove.clear()
        self._hook.remove()
        self.grad_ready_callbacks.clear()
        self.store.remove_victim_order(self._victim_token)
        self.placer.close()
        for sg in self.groups.values():
            sg.remove()
            sg.materialized = False
            self._materialize(sg)
            for sh in sg.shards:
                self.store.drop(sh.key)
        self.params.clear()
        delattr(self.model, _STATE_KEY)


def offload_fsdp(model: nn.Module, store: TierStore, *, prefetch_depth: int | str | None = None,
                 prefetch_bytes: int | None = None, home: Tier | str | None = None,
                 init_fn: Callable[[nn.Module], None] | None = None,
                 allow_untested_torch: bool = False, placement: bool = True,
                 real_parameters: str | None = None) -> FSDPOffload:
    """Give this rank's FSDP2 shards of ``model`` a home in ``store`` (NVMe by default).

    Call after ``fully_shard`` (on the blocks, then the root) and before the
    first forward. Defaults come from ``store.config``. A model built on the
    meta device (then ``fully_shard``-ed, as FSDP2's recipe has it) is given
    memory and initialized one module at a time, each module's shards written
    to the store before the next (``reset_parameters()``, or ``init_fn(module)``;
    see [Note: Building on the meta device]); call no ``to_empty`` first.
    ``prefetch_depth``, ``placement`` and ``real_parameters`` are as for ``offload_model``.
    """
    internals.check_torch_version(allow_untested_torch)
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload_fsdp needs an nn.Module, not {type(model).__name__}")
    if hasattr(model, _STATE_KEY):
        raise ValueError("this model's shards are already offloaded; call .remove() on its FSDPOffload first")
    if not dist.is_initialized():
        raise RuntimeError("offload_fsdp needs torch.distributed initialised (run under torchrun, "
                           "init_process_group) and fully_shard applied")
    cfg = store.config
    check_options(prefetch_depth, placement)
    state = FSDPOffload(model, store,
                        prefetch_depth=cfg.prefetch_depth if prefetch_depth is None else prefetch_depth,
                        prefetch_bytes=cfg.prefetch_bytes if prefetch_bytes is None else prefetch_bytes,
                        home=Tier.parse(home if home is not None else cfg.param_tier), init_fn=init_fn,
                        placement=placement, real_parameters=real_parameters)
    setattr(model, _STATE_KEY, state)
    return state


__all__ = ["FSDPOffload", "offload_fsdp"]
