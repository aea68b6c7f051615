"""ZeRO-3 with an NVMe tier: each rank's FSDP2 shards live in a TierStore and are read ahead of the all-gathers.

After ``fully_shard`` has been applied as usual, :func:`offload_fsdp`
puts every rank's local shards (the tensors FSDP2 all-gathers) into that
rank's store, home NVMe by default, and frees their memory. Before FSDP2
all-gathers a parameter group -- in forward, in backward, or as one of its
own prefetches -- the group's shards are copied back from the store (the
prefetch scheduler has read them into the host tier ahead of time, in the
order recorded on the first step); once the all-gather has consumed them
they are freed again. :class:`~tierstore.integrations.optim.OffloadedAdamW`
steps each rank's shards with their state in the store.

[Note: Gradient shards in the tiers] Once FSDP2 has reduce-scattered a
group's gradients, each rank's gradient shard that must outlive the backward
(an optimizer stepping after it, accumulation, clipping) is put in the store
as the gradients of ``offload_model`` are (see [Note: Gradients in the
tiers]), in the dtype FSDP2 made it, and ``param.grad`` becomes a DTensor
whose local tensor is the stored gradient (a ``StoredGrad``): FSDP2
accumulates the next micro-batch's shard into it (``grad._local_tensor +=
new``, one read-add-write in the store), torch's ``clip_grad_norm_`` takes
its norm from the store's record and records the clip coefficient, and the
optimizer reads it ahead with its state. So a rank holds no gradient memory
outside the budgets between backward and the step. An optimizer stepping in
backward takes each shard as it is reduced, as before.

[Note: Loading into the shards] ``model.load_state_dict()`` (what
torch.distributed.checkpoint's ``set_state_dict`` calls, with the DTensors
``get_state_dict`` gave and ``dcp.load`` filled) copies each loaded value
into its parameter, whose local shard has no memory between all-gathers. So
a pre-hook of each module gives the shards the load names their memory
back, filled from the store; torch copies into them; a post-hook writes each
into the store and frees its memory again, and an optimizer of the model is
told of those whose values changed (it makes their masters again, except
those its own ``load_state_dict`` loaded since the last step: DCP loads the
optimizer first).

[Note: Layer by layer on FSDP2 ranks] ``off.accumulate(step_fn,
micro_batches)`` runs a rank's micro-batches layer by layer (see [Note: A
layer-major step]): the segments are the ``fully_shard``-ed modules under
the root (a decoder layer each), and FSDP2's own hooks still make every
collective; the step sets FSDP2's levers so that each runs once
(``_fsdp_internals.HeldGathers``). For the step no group reshards after
forward or backward, reduce-scatters, or prefetches (its backward prefetch
would all-gather the group recorded before it in forward order, which the
micro-batches interleave), and no backward is FSDP2's last. So a segment's
first micro-batch all-gathers it, the others find it unsharded, and after
the last micro-batch's forward the step reshards it (unless
``reshard_after_forward=False`` keeps it for its backward, as FSDP2 would:
then one all-gather a step). In backward, each of
its reruns adds its part to the unsharded gradient FSDP2 accumulates, as the
loop's backwards with sync off do; the last micro-batch's rerun runs with the
user's sync and reshard settings, so its post-backward reduce-scatters the
sum and reshards: a segment's unsharded gradient lives only through its own
backward. The root's group (embedding, final norm, head) stays all-gathered
through the step, as FSDP2 keeps it after forward anyway; its unsharded
gradient gets the head's parts in each micro-batch's forward stretch and
the embedding's in the glue's backward at the end, and is reduce-scattered
once, by what FSDP2's last backward ends with (its final callback, run by
the step). So a step all-gathers the root once and each segment twice, and
reduce-scatters each group once, whatever the number of micro-batches; the
sums are the loop's (sync on the last micro-batch only), in its order, bit
for bit. A micro-batch's backward between another's pre- and post-forward
of the root leaves the root's group idle, where its post-forward would
reshard it: for the step a group's post-forward runs as in forward. What
the step cannot order as the loop does runs as the loop, with a warning
once: a root parameter other than a tied embedding (see [Note: Tied
parameters on FSDP2 ranks]) with parts both before the first segment and
after the last (found at the end of the backward: the gradients dropped,
FSDP2's state reset), glue between segments (an
encoder-decoder), a nested or grouped ``fully_shard``. A step stopped (an
exception, Ctrl-C) lets FSDP2's gathers and unsharded gradients go
(``reset_iter_state``).

[Note: Tied parameters on FSDP2 ranks] A tied embedding and head (one
parameter of the root's group) gets, layer by layer, its head's parts in the
forward stretch and its embedding's at the end, into FSDP2's unsharded
gradient, which autograd accumulates. The step sums them in the loop's order
as it does for ``offload_model`` (see [Note: Tied parameters layer by
layer]), with FSDP2's unsharded gradient in place of the kept one: a hook on
the unsharded parameter (registered once the root is gathered, before any
backward) gives each part to the step before autograd adds it; the step
keeps the head's part's rows of the step's tokens and lets autograd add the
whole part, and takes the embedding's part's rows, handing back the rest
(+0 there) for autograd to add; at the end those rows are set to the loop's
sums, before FSDP2's final callback reduce-scatters the gradient.

[Note: Freeing a shard] A shard's memory is freed by resizing its storage
to zero bytes and restored by resizing it back, as FSDP2 does with its
unsharded parameters: the tensors FSDP2 keeps (the padded shard and the
DTensor's local view of it) stay the same objects, so nothing of FSDP2's
state needs rewriting. The private details this relies on are in
``_fsdp_internals.py``.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tierstore import Tier, TierStore, TierStoreError, TierValueError, UnsupportedError

from . import _fsdp_internals as internals
from ._base import STATE_KEY, OffloadBase, UnitStats, check_not_offloaded, same_values
from ._contract import zero_grads
from ._grads import GradientStore, StoredGrad
from ._layer_major import run_layer_major
from ._meta import check_meta, materialize
from ._placing import check_options
from ._tied import tied_parameters
from .policies import ParamOffloadPolicy


@dataclass(eq=False)
class _Shard:
    name: str
    key: str
    param: nn.Parameter  # the sharded DTensor parameter
    local: torch.Tensor  # its local tensor: a view of the padded shard's storage
    storage_nbytes: int  # the padded shard's size

    @property
    def nbytes(self) -> int:
        """The bytes the store holds of it."""
        return self.local.numel() * self.local.element_size()


@dataclass(eq=False)
class _ShardUnit:
    """A unit: one FSDP2 parameter group's shards, all-gathered at once."""

    name: str
    params: list[_Shard]
    nbytes: int
    materialized: bool = True  # the shards' storage holds their current values
    remove: Any = None


@dataclass
class FSDPOffloadStats(UnitStats):
    unshards: int = 0  # all-gathers whose shards were restored from the store
    layer_major_steps: int = 0  # steps ``accumulate`` ran layer by layer (see [Note: Layer by layer on FSDP2 ranks])
    loop_steps: int = 0  # steps it ran as the loop (``layer_major_refused`` says why)


class _Turns:
    """What a layer-major step asks of the pass (see [Note: A layer-major step]) where FSDP2 keeps the pass's
    state: which threads are its micro-batches (``group``), and whether one of them began the step (``joined``);
    no unit of ours runs, and nothing is a thread's own."""

    def __init__(self) -> None:
        self.running: list = []
        self.group: Any = {}
        self._begun = False

    def thread_part(self) -> tuple[Any, ...]:
        return ()

    def set_thread_part(self, part: tuple[Any, ...] = ()) -> None:
        pass

    def joined(self) -> bool:
        """Whether this forward is one more micro-batch's of a layer-major step that has begun."""
        if threading.get_ident() not in self.group:
            return False
        begun, self._begun = self._begun, True
        return begun

    def end_group(self) -> None:
        self.group = {}
        self._begun = False

    def clear(self) -> None:
        pass


class _ShardGrads:
    """``grads.get(key)``: the local shard of that parameter's gradient: a ``StoredGrad`` once it is in the store
    (see [Note: Gradient shards in the tiers]), else as FSDP2 left it."""

    def __init__(self, by_key: dict[str, _Shard], stored: GradientStore) -> None:
        self._by_key = by_key
        self.stored = stored

    def __len__(self) -> int:
        """How many parameters have a gradient shard."""
        return sum(sh.param.grad is not None for sh in self._by_key.values())

    def get(self, key: str, default: Any = None) -> torch.Tensor | None:
        sh = self._by_key.get(key)
        if sh is None or sh.param.grad is None:
            return default
        return internals.local_shard(sh.param.grad)

    def pop(self, key: str, default: Any = None) -> torch.Tensor | None:
        """The gradient shard, dropped from its parameter (its memory goes once the caller is done)."""
        grad = self.get(key, default)
        sh = self._by_key.get(key)
        if sh is not None:
            sh.param.grad = None
            if isinstance(grad, StoredGrad):  # consumed: its values are read now, not after it is dropped
                grad = grad.clone()
            self.stored.pop(key)
        return grad

    def claim(self, grad: torch.Tensor) -> None:
        self.stored.claim(grad)

    def release_claim(self, grad: torch.Tensor, *, drop: bool) -> None:
        """See ``GradientStore.release_claim``; ``drop`` lets the shard's ``param.grad`` go too (on the updates'
        worker: a forward, which waited for this update to reach the shard, does not touch it)."""
        if drop and isinstance(grad, StoredGrad):
            sh = self._by_key.get(grad._record.param_key)
            if sh is not None and sh.param.grad is not None and internals.local_shard(sh.param.grad) is grad:
                sh.param.grad = None
        self.stored.release_claim(grad, drop=drop)

    # What an update speculated in backward asks of the kept shards (see [Note: Speculated updates]).
    def watched_values(self, grad: torch.Tensor) -> Any:
        return self.stored.watched_values(grad)

    def unchanged(self, grad: torch.Tensor) -> bool:
        return self.stored.unchanged(grad)

    def scaled_by_one(self, grad: torch.Tensor) -> bool:
        return self.stored.scaled_by_one(grad)

    def dtype_of(self, param: torch.Tensor) -> torch.dtype:
        return self.stored.dtype_of(param)

    def keep(self, sh: _Shard) -> None:
        """Put the gradient shard FSDP2 just assigned in the store, and ``param.grad`` on it (see [Note: Gradient
        shards in the tiers]); one FSDP2 accumulated into is there already."""
        grad = sh.param.grad
        if grad is None or isinstance(internals.local_shard(grad), StoredGrad):
            return
        self.stored[sh.key] = internals.local_shard(grad)  # a record left from before (p.grad = None) is replaced
        sh.param.grad = internals.with_local(grad, self.stored.get(sh.key))

    def clear(self) -> None:
        """Drop every kept gradient shard: its record, and ``param.grad`` where it is one."""
        for sh in self._by_key.values():
            if sh.param.grad is not None and isinstance(internals.local_shard(sh.param.grad), StoredGrad):
                sh.param.grad = None
        self.stored.clear()


class FSDPOffload(OffloadBase):
    """The NVMe tier under one rank's FSDP2 shards; returned by :func:`offload_fsdp`."""

    prefix = "fsdp/"
    streams_updates = True  # FSDP2's all-gather reads each shard from the store first (``_materialize``)
    speculates = True  # and so waits for a speculated update's decision, or undoes it (see [Note: Speculated updates])

    def __init__(self, model: nn.Module, store: TierStore, *, prefetch_depth: int | str, prefetch_bytes: int | None,
                 home: Tier, init_fn: Callable[[nn.Module], None] | None = None, placement: bool = True,
                 real_parameters: str | None = None, grad_tier: Tier | None = None) -> None:
        super().__init__(model, store, home, FSDPOffloadStats())
        self.keeps_grads = False  # gradient shards are in param.grad (whose local tensor may be in the store)
        groups = list(internals.fsdp_groups(model))
        for gname, _module, group in groups:
            internals.check_group_supported(gname, group)
        if not any(internals.group_params(group) for _, _, group in groups):
            raise TierValueError("no fully_shard-ed module with parameters found; apply fully_shard before "
                                 "offload_fsdp")
        meta = check_meta(model, init_fn, real_parameters)
        sharded = {id(p) for _, _, group in groups for p in internals.group_params(group)}
        outside = [n for n, p in model.named_parameters() if id(p) not in sharded]
        if outside:  # an optimizer of the shards would never step them
            raise TierValueError(f"{len(outside)} parameter(s) belong to no fully_shard-ed module: "
                                 f"{', '.join(outside[:4])}{', ...' if len(outside) > 4 else ''}; apply fully_shard to "
                                 f"the root module too (after its blocks), as FSDP2 recommends")
        if home is Tier.NVME:
            need = sum(internals.local_shard(p).numel() * p.element_size() for _, _, g in groups
                       for p in internals.group_params(g))
            store.require_nvme_room(need, "offloading {size} of this rank's parameter shards")
        names = {id(p): n for n, p in model.named_parameters()}
        put = self._put_shards(groups, sharded, names, meta, init_fn, real_parameters)
        for gname, _module, group in groups:
            shards = []
            for p in internals.group_params(group):
                name = names[id(p)]
                sh = self.params[id(p)] = _Shard(name, f"{self.prefix}{name}", p, internals.local_shard(p), put[id(p)])
                shards.append(sh)
            self._units[gname] = _ShardUnit(gname, shards, sum(sh.nbytes for sh in shards), materialized=not meta)
        for gname, _module, group in groups:
            su = self._units[gname]
            su.remove = internals.wrap_group(group, lambda su=su: self._materialize(su), lambda su=su: self._free(su),
                                             lambda reduced, su=su, group=group: self._gradients_ready(su, group,
                                                                                                       reduced))
        self._schedule(prefetch_depth=prefetch_depth, prefetch_bytes=prefetch_bytes, placement=placement)
        # in FSDP2's dtype, which it accumulates in (see [Note: Gradient shards in the tiers])
        self.grads = _ShardGrads(self._by_key, GradientStore(store, grad_tier, "param"))
        self._hook = model.register_forward_pre_hook(self._start_step, prepend=True)
        self._forwards = 0  # the root's forwards running now (see _forward_runs)
        self._end_hook = model.register_forward_hook(self._end_forward, always_call=True)
        self._said_unsynced = False  # see _unsynced_message
        self.pass_state = _Turns()  # see [Note: Layer by layer on FSDP2 ranks]
        # where a layer-major step reads its activations (see [Note: Activations in the tiers])
        self.compute_tier = (Tier.DEVICE if store.device.type != "cpu" and self.give_back_device().type != "cpu"
                             else Tier.HOST)
        self.layer_major_refused: str | None = None  # why accumulate runs the micro-batches as the loop
        self._layer_major = False  # a layer-major step runs: gradient sync is off by design
        # Shards a load names, with whether it gave them memory (see [Note: Loading into the shards]).
        self._loading: list[tuple[_Shard, bool]] = []
        self._state_dict_hooks = [hook for module in model.modules() if any(self._owned(module))
                                  for hook in (module.register_state_dict_post_hook(partial(self._fill_state_dict)),
                                               module.register_load_state_dict_pre_hook(self._before_load),
                                               module.register_load_state_dict_post_hook(self._after_load))]

    def _put_shards(self, groups: list, sharded: set[int], names: dict[int, str], meta: bool,
                    init_fn: Callable[[nn.Module], None] | None, real_parameters: str | None) -> dict[int, int]:
        """Every local shard given to the store (a meta model materialized module by module on the way); returns
        id(param) -> the padded shard's bytes."""
        put: dict[int, int] = {}
        with self.putting() as (handles, undo):

            def give(p: nn.Parameter, *, free: bool) -> None:
                """Put ``p``'s local shard in the store; with ``free``, its memory goes once it is there."""
                local = internals.local_shard(p)
                put[id(p)] = local.untyped_storage().nbytes()
                handles.append(self.store.put(f"{self.prefix}{names[id(p)]}", local.detach().contiguous(),
                                              home=self.home))
                if free:
                    handles[-1].wait()
                    local.untyped_storage().resize_(0)

            if meta:  # one module's tensors in memory at a time (see [Note: Building on the meta device])
                done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
                by_id = internals.fsdp_params_by_id(self.model)

                def adopt(p: nn.Parameter) -> Callable[[], None]:
                    return internals.adopt_local_tensor(by_id[id(p)]) if id(p) in by_id else lambda: None

                for mname, module in self.model.named_modules():
                    fresh = materialize(module, init_fn, done, undo, in_place=True, adopt=adopt, mname=mname,
                                        initialize_real=real_parameters == "initialize")
                    for p in fresh:
                        if id(p) in sharded:
                            give(p, free=True)
            for _, _, group in groups:
                for p in internals.group_params(group):
                    if id(p) not in put:
                        give(p, free=meta)
        return put

    # ---- state dicts -------------------------------------------------------------------
    def _fill_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        """A module's state_dict post-hook: each of its shards as FSDP2 gives it (a DTensor), its local tensor read
        from the store (the parameter's own has no memory between all-gathers: see [Note: Freeing a shard])."""
        for pname, sh in self._owned(module):
            if prefix + pname in state_dict:
                state_dict[prefix + pname] = internals.with_local(sh.param, self._state_dict_value(sh))

    def _before_load(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: dict,
                     *_: Any) -> None:
        """model.load_state_dict() into shards (torch.distributed.checkpoint's ``set_state_dict``): each shard the
        load names gets its memory back, filled from the store, for torch to copy the loaded value into (see
        [Note: Loading into the shards])."""
        mine = self._named_by_load(module, state_dict, prefix, local_metadata)
        if not mine:
            return
        self._check_usable()
        for sh, _ in mine:
            restored = sh.local.untyped_storage().nbytes() != sh.storage_nbytes
            if restored:
                self._restore(sh)
            self._loading.append((sh, restored))

    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        """The shards restored for a load hold their loaded values: into the store, their memory freed again; an
        optimizer of the model hears of those that changed (it makes their masters again)."""
        loading, self._loading = self._loading, []
        changed = []
        for sh, restored in loading:
            if sh.local.numel():
                stored = self.store.get(sh.key, Tier.HOST)
                try:
                    if not same_values(stored, sh.local):  # loaded (a load that failed copied nothing)
                        self.store.writing(sh.key).wait()  # a write of its bytes in flight must not see them change
                        stored.copy_(sh.local)
                        self.store.mark_dirty(sh.key, Tier.HOST)
                        changed.append(sh.name)
                finally:
                    self.store.release(sh.key, Tier.HOST)
            if restored:
                sh.local.untyped_storage().resize_(0)
        if changed:
            self.loaded(changed)

    # ---- the all-gather loop -----------------------------------------------------------
    def _start_step(self, module: nn.Module, args: Any) -> None:
        self._check_usable()
        joined = self.pass_state.joined()
        self._forwards = self._forwards + 1 if joined else 1  # 1: a count left up by a forward Ctrl-C stopped
        if joined:  # one more micro-batch of a layer-major step: the step has begun
            return
        self._begin_step()

    def _end_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root's forward returned or raised an Exception (an always-called hook; torch calls none for Ctrl-C,
        whose count the next forward sets right): streamed updates are paced while a forward runs (see [Note: Paced
        streamed updates])."""
        self._forwards = max(self._forwards - 1, 0)

    def _forward_runs(self) -> bool:
        return self._forwards > 0

    def _materialize(self, su: _ShardUnit) -> None:
        """Before FSDP2 all-gathers ``su``: its shards' storage back, filled from the store."""
        self.stats.unshards += 1
        if torch._C._current_graph_task_id() != -1:  # an all-gather for backward (its pre-backward hook)
            self.prefetch_policy.backward_starts()
        self.schedule.prefetch_after(su, Tier.HOST)
        t0 = time.perf_counter()
        for sh in su.params:
            self._restore(sh)
        self.schedule.add_stall(su, t0)
        su.materialized = True

    def _restore(self, sh: _Shard) -> None:
        """A shard's storage back (see [Note: Freeing a shard]), filled from the store."""
        storage = sh.local.untyped_storage()
        if storage.nbytes() != sh.storage_nbytes:
            storage.resize_(sh.storage_nbytes)
            used = sh.nbytes
            if used < sh.storage_nbytes:  # FSDP2's padding: all-gathered, never read
                torch.empty(0, dtype=torch.uint8, device=sh.local.device).set_(storage)[used:].zero_()
        if sh.local.numel():
            with torch.no_grad():
                sh.local.copy_(self.store.get(sh.key, Tier.HOST))
            self.store.release(sh.key, Tier.HOST)

    def _gradients_ready(self, su: _ShardUnit, group: Any, reduced: bool) -> None:
        self._steps.backward()
        if not internals.syncs_gradients(group) and not self._said_unsynced and not self._layer_major:
            self._said_unsynced = True
            warnings.warn(_unsynced_message(self.model), stacklevel=2)
        if not reduced:  # no new gradient shard (sync off, or nothing to reduce)
            return
        ready = [sh for sh in su.params if sh.param.grad is not None]
        if ready:
            internals.wait_for_gradients(group)
        if not self.pass_consumers.consumes_grads():  # kept until the step (see [Note: Gradient shards in the tiers])
            for sh in ready:
                self.grads.keep(sh)
            for sh in ready:  # kept, and seen by an optimizer that speculates (see [Note: Speculated updates])
                self.pass_consumers.grad_ready(sh.key)
            return
        for sh in ready:
            self.pass_consumers.grad_ready(sh.key)

    def _free(self, su: _ShardUnit) -> None:
        """The all-gather has read the shards: free their memory (see [Note: Freeing a shard])."""
        if not su.materialized:
            return
        for sh in su.params:
            sh.local.untyped_storage().resize_(0)
        su.materialized = False

    # ---- the contract (the rest is OffloadBase's) ------------------------------------------
    def in_forward_or_backward(self) -> bool:
        """False: FSDP2 gathers from its own copies of the shards, so nothing of the store is held in a step."""
        return False

    def held_beside_updates(self) -> dict[str, int]:
        """None: a shard restored for an all-gather is FSDP2's memory, not the host tier's."""
        return {}

    def follow_optimizer(self, home: Tier) -> None:
        self.grads.stored.follow(home)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient shards, or zero them in place (``set_to_none=False``), as torch does."""
        zero_grads((sh.param for sh in self.params.values()), set_to_none)
        if set_to_none:
            self.grads.clear()

    def accumulate(self, step_fn: Callable[[Any], Any], micro_batches: Sequence[Any]) -> list[Any]:
        """``[step_fn(mb) for mb in micro_batches]``, run layer by layer on this rank, as ``offload_model``'s
        ``accumulate`` runs them (see [Note: A layer-major step]): every ``fully_shard``-ed block all-gathers once
        for the forward of all micro-batches and once for their backward, and reduce-scatters once a step, at the end
        of its own backward; the gradients are those of FSDP2's loop with gradient sync on the last micro-batch only,
        bit for bit. Call it on every rank with as many micro-batches. See [Note: Layer by layer on FSDP2 ranks]."""
        segments, refused = _segments(self.model)

        def gathers() -> internals.HeldGathers:  # the step runs layer by layer: gradient sync off by design
            self._layer_major = True
            tied = {i: self.params[i].key for i in tied_parameters(self.model) if i in self.params}
            return internals.HeldGathers(self.model, segments, tied, self.pass_consumers.takes_part)

        try:
            return run_layer_major(self, step_fn, micro_batches, segments, refused=refused, gathers=gathers)
        finally:
            self._layer_major = False

    wrapper_name = "offload_fsdp"
    drop_hint = "end the process (its swap directory is removed at exit)"

    def give_back_device(self) -> torch.device:
        su = next(iter(self._units.values()), None)
        sh = su.params[0] if su is not None and su.params else None
        return sh.local.device if sh is not None else torch.device("cpu")

    def remove(self, *, keep_values: bool = True) -> None:
        """Put every shard back in memory (current values) and detach from FSDP2 (an optimizer of it drops its
        state). ``store.close()`` calls it for a model still offloaded."""
        if self.removed:  # removed already (by store.close(), say): nothing more to give back
            return
        if not keep_values:
            raise UnsupportedError("remove(keep_values=False) of FSDP2 shards: FSDP2 keeps no shard without "
                                   "memory; remove() (the values come back) or end the process")
        self._detach([self._hook, self._end_hook, *self._state_dict_hooks])
        self.grads.clear()  # gradients go, as offload_model's remove() drops its own
        for su in self._units.values():
            su.remove()
            su.materialized = False
            self._materialize(su)
            for sh in su.params:
                self.store.drop(sh.key)
        self._forget()


def _segments(model: nn.Module) -> tuple[list[nn.Module], str | None]:
    """The segments of a layer-major step on FSDP2 (the ``fully_shard``-ed modules under the root, in the model's
    order), and why the model cannot run so (None: it can, as far as is seen before it runs)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return [], ("the model itself is not fully_shard-ed: apply fully_shard to the root module too (after its "
                    "blocks), as FSDP2 recommends")
    segments: list[tuple[str, nn.Module]] = []
    for name, gmodule, group in internals.fsdp_groups(model):
        if gmodule is model:
            continue
        outer = next((o for o, _ in segments if name.startswith(o + ".")), None)
        if outer is not None:
            return [], f"fully_shard-ed module {name!r} is inside another ({outer!r}): shard the blocks one level deep"
        if len(group.modules) > 1:
            return [], f"fully_shard was applied to several modules at once ({name!r} and others) as one group"
        segments.append((name, gmodule))
    return [m for _, m in segments], None


def _unsynced_message(model: nn.Module) -> str:
    """What a backward with gradient sync off costs (said once): FSDP2 keeps each group's unsharded gradient,
    accumulated, in ordinary memory until a backward that syncs."""
    full = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return (f"offload_fsdp: with gradient sync off (set_requires_gradient_sync(False)), FSDP2 keeps every group's "
            f"unsharded gradient in ordinary memory until the backward that syncs: up to {full / 2**20:.1f} MiB on "
            f"each rank (the full size of the trainable parameters), outside the store's budgets. "
            f"off.accumulate(step_fn, micro_batches) runs them layer by layer instead, each group's unsharded "
            f"gradient living only through its own backward and reduce-scattered once (docs/fsdp.md); syncing on "
            f"every micro-batch keeps only the gradient shards, in the store, at the cost of a reduce-scatter a "
            f"micro-batch")


def offload_fsdp(model: nn.Module, store: TierStore, *, prefetch_depth: int | str | None = None,
                 prefetch_bytes: int | None = None, home: Tier | str | None = None,
                 init_fn: Callable[[nn.Module], None] | None = None,
                 allow_untested_torch: bool = False, placement: bool = True,
                 real_parameters: str | None = None, policy: ParamOffloadPolicy | None = None) -> FSDPOffload:
    """Give this rank's FSDP2 shards of ``model`` a home in ``store`` (NVMe by default).

    Call after ``fully_shard`` (on the blocks, then the root) and before the
    first forward. ``prefetch_depth``, ``prefetch_bytes`` and ``home`` override
    ``policy`` (a :class:`ParamOffloadPolicy`; its defaults when none is
    given); its ``grad_tier`` is the home of the gradient
    shards, and its ``resident_threshold_bytes`` is not used here (FSDP2 shards
    every parameter). A model built on the
    meta device (then ``fully_shard``-ed, as FSDP2's recipe has it) is given
    memory and initialized one module at a time, each module's shards written
    to the store before the next (``reset_parameters()``, or ``init_fn(module)``;
    see [Note: Building on the meta device]); call no ``to_empty`` first.
    ``prefetch_depth``, ``placement`` and ``real_parameters`` are as for ``offload_model``.
    """
    internals.check_torch_version(allow_untested_torch)
    check_not_offloaded(model, "offload_fsdp")
    if not dist.is_initialized():
        raise TierStoreError("offload_fsdp needs torch.distributed initialised (run under torchrun, "
                             "init_process_group) and fully_shard applied")
    check_options(prefetch_depth, placement)
    chosen = (policy or ParamOffloadPolicy()).overridden(
        prefetch_depth=prefetch_depth, prefetch_bytes=prefetch_bytes, home=home)
    state = FSDPOffload(model, store,
                        prefetch_depth=chosen.prefetch_depth, prefetch_bytes=chosen.prefetch_bytes,
                        home=chosen.home, grad_tier=chosen.grad_tier, init_fn=init_fn,
                        placement=placement, real_parameters=real_parameters)
    setattr(model, STATE_KEY, state)
    store.attach_user(state)  # store.close() gives the shards back first (see TierStore.close)
    return state


__all__ = ["FSDPOffload", "offload_fsdp"]
