"""AdamW whose fp32 master weights and moments live in a TierStore, stepped with read-ahead and write-behind.

[Note: Stepping in backward] With ``step_in_backward=True`` a parameter is
stepped as soon as its gradient is complete, on a worker thread, while
backward goes on with the layers below: the optimizer's reads and writes
overlap backward compute instead of following it (ZeRO-Infinity's overlap of
the optimizer with backward). ``step()`` then only waits for those updates
(and steps parameters that stay resident). Gradients must be complete after
one backward: no accumulation over several backward passes and no clipping
by the global norm (use the default mode for those). Gradients queued for
the worker are memory that no tier budget counts, so backward waits (counted
as stall time) while more than ``max_grad_backlog_bytes`` of them are queued.

[Note: Finishing in the next forward] With ``finish_in_forward=True`` as
well, ``step()`` does not wait for the updates the worker has not finished:
it returns, and they go on in the order the next forward uses their
parameters (the reverse of backward's: the first layers' first), while that
forward computes and reads ahead. The drive, busy to the end of backward and
past it, then works on through the forward instead of idling in it. Nothing
can read a value before its update: the store fences each one's keys (see
[Note: Fenced keys] in tierstore/_store.py), so a forward's hold of the
parameter, ``read_param``, ``state_dict()``, a checkpoint or a flush waits
for it, and the hyper-parameters are those of the groups when ``step()``
returned (a scheduler's change after it applies from the next step, as with
torch's AdamW). An update that fails then raises wherever its values are
read (the forward's hold of its parameter, at the latest), and the model
refuses to run until ``opt.step()`` is called again, which steps it again
with the gradient it kept.

[Note: Pipelined step] Parameters are stepped one at a time in a fixed order.
Before parameter i is computed, the state of the next parameters (up to
``readahead_bytes`` of it, by default half the host budget, or half the room a
placement leaves for copies in flight, and ``readahead``
parameters if given; none where the model's prefetch depth is 0) is already
being read into the host tier; after it is computed its state is
marked dirty and a write-back is started at once, so the drive writes
parameter i while the CPU computes i+1. The arithmetic is that of
torch.optim.AdamW with foreach=False, operation for operation, so fp32
training is bit-identical to it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import torch
from torch import nn

from tierstore import Tier, TierStore, parse_bytes
from tierstore._memory import TierPool

from ._adamw import HYPER, check_hyper
from ._contract import (
    OPTIMIZER_STATE,
    STEPPED_DTYPES,
    OffloadedParameters,
    has_master,
    moment_dtype,
    optimizer_key,
)
from ._pipeline import StatePipeline, UnrestorableUpdateError, state_keys


@dataclass(eq=False)
class _Update:
    """One parameter's update handed to the worker of ``step_in_backward``."""

    name: str
    key: str
    param: torch.nn.Parameter
    grad: torch.Tensor | None
    nbytes: int
    done: Future = field(default_factory=Future)
    hyper: tuple | None = None  # the group's hyper-parameters, fixed by a step() that returns before it runs
    deferred: bool = False  # step() returned before it finished (see [Note: Finishing in the next forward])
    failed: BaseException | None = None

    def item(self) -> tuple[str, str, torch.nn.Parameter, torch.Tensor | None]:
        return self.name, self.key, self.param, self.grad


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW over offloaded parameters (an ``OffloadedModel`` or ``FSDPOffload``: see
    :class:`~tierstore.integrations._contract.OffloadedParameters`), with optimizer state in the store.

    For fp32 parameters the master weight is the parameter's own store copy;
    for bf16/fp16 parameters an fp32 master is kept and the parameter is
    rounded from it after each step (mixed precision).

    ``param_groups`` gives some parameters their own hyper-parameters, as
    torch.optim's parameter groups do: a list of dicts, each with ``"params"``
    (parameter names or the model's parameters) and any of ``lr``, ``betas``,
    ``eps``, ``weight_decay``, ``maximize``; parameters in no group form a last
    group with the keyword defaults. The update is torch.optim.AdamW's
    single-tensor one (``foreach=False``) operation for operation, ``maximize``
    included; ``foreach`` and ``fused`` are accepted, so that code written for
    torch's AdamW runs, and change nothing; ``amsgrad``, ``capturable`` and
    ``differentiable`` must be False. It is a ``torch.optim.Optimizer``, so learning-rate
    schedulers drive it through ``param_groups``; its state lives in the store
    (read it with :meth:`state_dict`), not in ``self.state``.
    """

    steps_offloaded_parameters = True  # other torch optimizers are refused over offloaded parameters

    def __init__(self, offloaded: OffloadedParameters, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, param_groups: list[dict[str, Any]] | None = None,
                 readahead: int | None = None, readahead_bytes: int | str | None = None,
                 home: Tier | str | None = None, step_in_backward: bool = False, finish_in_forward: bool = False,
                 max_grad_backlog_bytes: int | str | None = None, maximize: bool = False, amsgrad: bool = False,
                 foreach: bool | None = None, fused: bool | None = None, capturable: bool = False,
                 differentiable: bool = False) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        check_hyper(defaults, "")
        unsupported = [f"{k}=True" for k, v in (("amsgrad", amsgrad), ("capturable", capturable),
                                                  ("differentiable", differentiable)) if v]
        if unsupported:
            raise ValueError(f"OffloadedAdamW does not support {', '.join(unsupported)} (torch.optim.AdamW's "
                             f"amsgrad would keep a third state tensor per parameter; capturable and differentiable "
                             f"are for CUDA graphs and higher-order optimization): leave them False")
        del foreach, fused  # accepted as torch's AdamW takes them: the update is its own (see the class docstring)
        if finish_in_forward and not step_in_backward:
            raise ValueError("finish_in_forward=True lets the updates that step_in_backward=True runs during backward "
                             "finish during the next forward; pass step_in_backward=True with it")
        if not isinstance(offloaded, OffloadedParameters):
            raise TypeError(f"OffloadedAdamW steps offloaded parameters: pass what offload_model or offload_fsdp "
                            f"returned, not {type(offloaded).__name__}")
        from .offload import OffloadedModel

        if finish_in_forward and not isinstance(offloaded, OffloadedModel):
            raise ValueError("finish_in_forward=True is for a model of offload_model; with offload_fsdp leave it "
                             "False")
        if readahead is None:  # prefetch depth 0 turns off reading ahead, the optimizer's as well
            readahead = 0 if offloaded.policy.depth == 0 else sys.maxsize  # bytes bound it
        if readahead < 0:
            raise ValueError(f"readahead={readahead} must be >= 0")
        self.offloaded = offloaded
        self.store: TierStore = offloaded.store
        host = self.store.config.host_budget_bytes
        # Gradients waiting for their update are memory no tier budgets (see [Note: Stepping in backward]).
        self.max_grad_backlog_bytes = self._positive_bytes(max_grad_backlog_bytes, max(1, host // 4),
                                                           "max_grad_backlog_bytes")
        # Reads in flight keep the drive busy (measured: half the host tier beat a quarter and 16 parameters
        # by 5-9% a step on ViT-large); the other half is left to the parameters. Under a placement, what it
        # leaves for copies in flight bounds them instead (see integrations/_placing.py).
        fixed = None if readahead_bytes is None else self._positive_bytes(readahead_bytes, 1, "readahead_bytes")
        self._pipeline = StatePipeline(self.store, readahead=readahead, readahead_bytes=(
            (lambda: fixed) if fixed is not None else (lambda: offloaded.readahead_room() or max(1, host // 2))))
        home = Tier.parse(home if home is not None else self.store.config.optimizer_tier)
        self._step_counts: dict[str, float] = {}  # name -> AdamW's step of its last update (see ``steps``)
        # (name, param key or None for a resident one, param): frozen parameters (requires_grad=False) get no
        # state, as torch's optimizers create none for a parameter that never has a gradient.
        everything = [*offloaded.named_offloaded(), *((name, None, p) for name, p in offloaded.resident.items())]
        self._items: list[tuple[str, str | None, torch.nn.Parameter]] = [
            it for it in everything if it[2].requires_grad]
        self._frozen = [it for it in everything if not it[2].requires_grad]
        odd = [f"{name} ({p.dtype})" for name, _, p in self._items if p.dtype not in STEPPED_DTYPES]
        if odd:
            raise TypeError(f"OffloadedAdamW steps fp32, fp64, bf16 and fp16 parameters, not {', '.join(odd[:4])}"
                            f"{', ...' if len(odd) > 4 else ''}: freeze them (requires_grad_(False)) or convert "
                            f"them before offload_model")
        handles = []
        self._name_of = {id(p): name for name, _, p in everything}
        sparse = [n for n, m in offloaded.model.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
        if sparse:  # torch's AdamW refuses sparse gradients at its step too
            raise ValueError(f"{', '.join(sparse[:4])}: sparse=True gives sparse gradients, which AdamW does not "
                             f"step; build the embedding with sparse=False (the default)")
        added = [n for n, p in offloaded.model.named_parameters() if id(p) not in self._name_of and p.requires_grad]
        if added:  # they would never be stepped, and the model would train without them, silently
            raise ValueError(f"{', '.join(added[:4])}{', ...' if len(added) > 4 else ''}: trainable parameters of "
                             f"the model that offload_model did not take (modules added or replaced after it): "
                             f"OffloadedAdamW steps only what it took. Build the whole model (heads, adapters) "
                             f"before offload_model, or freeze these (requires_grad_(False))")
        self._check_host_budget(host, step_in_backward)
        if any(optimizer_key(name, "exp_avg") in self.store for name, _, _ in self._items):
            raise ValueError("this model already has an OffloadedAdamW (its state is in the store); keep using that "
                             "one (opt.load_state_dict() replaces its state), or offload a fresh model")
        self._building = True
        super().__init__(self._torch_groups(param_groups, defaults), defaults)
        self._building = False
        # name -> its group, the very dict a scheduler changes: each update reads its hyper-parameters from it.
        self._group_of = {self._name_of[id(p)]: g for g in self.param_groups for p in g["params"]}
        if home is Tier.NVME:  # room for every moment (and master) is checked before the first is written
            self.store.require_nvme_room(
                sum((p.numel() if key is None else self._param_shape(key).numel())
                    * moment_dtype(key, p).itemsize * (3 if has_master(key, p) else 2) for _, key, p in self._items),
                "AdamW state of {size}")
        try:
            for name, key, p in self._items:
                shape = p.shape if key is None else self._param_shape(key)
                zeros = torch.zeros(shape, dtype=moment_dtype(key, p))
                handles.append(self.store.put(optimizer_key(name, "exp_avg"), zeros, home=home))
                handles.append(self.store.put(optimizer_key(name, "exp_avg_sq"), zeros, home=home))
                if has_master(key, p):
                    master = self.offloaded.read_param(name).float()
                    handles.append(self.store.put(optimizer_key(name, "master"), master, home=home))
            for h in handles:
                h.wait()
        except BaseException:  # a failed constructor leaves nothing in the store (a retry must not see it)
            self.store.undo_puts(handles)
            raise
        self._pipeline.state_bytes = {name: sum(self.store.info(k)["nbytes"] for k in state_keys(name, key, p))
                                      for name, key, p in self._items}
        self.step_in_backward = step_in_backward
        self.finish_in_forward = finish_in_forward
        self._early: dict[str, _Update] = {}  # key -> update started in this backward
        self._queue: list[tuple] = []  # (name, key, param, grad) step() steps itself, in order
        self._done = 0  # how many of the queue are stepped
        # The worker's updates still to run, in order, and the one running: see [Note: Finishing in the next
        # forward] for how step() reorders them.
        self._pending: list[_Update] = []
        self._running_update: _Update | None = None
        self._deferred: list[_Update] = []  # what the last step() left to finish
        self._deferred_failed: list[_Update] = []  # ... that failed: the next step() steps them again
        self._backlog_bytes = 0  # of gradients queued and not yet consumed
        self._lock = threading.Lock()  # the worker's queue, the backlog, an update's hyper-parameters and outcome
        # name -> (the gradient its last update applied, that gradient's version), and why the last step()
        # stopped part-way: see [Note: A step that stops part-way].
        self._applied: dict[str, tuple[weakref.ref, int]] = {}
        self._unfinished: str | None = None
        self._backwards_failed = getattr(offloaded, "backwards_failed", 0)  # as of the last step()
        self._worker: ThreadPoolExecutor | None = None
        self._worker_ident: int | None = None
        if step_in_backward:
            self._by_key = {key: (name, key, p) for name, key, p in self._items if key is not None}
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="tierstore-adamw")
            self._worker_ident = self._worker.submit(threading.get_ident).result()  # the owner of its fences
            offloaded.grad_ready_callbacks.append(self._on_grad_ready)
            if hasattr(offloaded, "grad_read_guards"):  # param.grad of an offloaded parameter asks it
                offloaded.grad_read_guards.append(self._gradients_taken)
        # Every store key an update of an offloaded parameter uses, built once: eviction asks for the
        # queue's keys on each allocation.
        self._use_keys = {name: tuple(dict.fromkeys((key, *state_keys(name, key, p))))
                          for name, key, p in self._items if key is not None}
        # Eviction then knows when this state is used (see [Note: Who uses a copy next]).
        for name, key, p in self._items:
            if key is not None:
                for k in state_keys(name, key, p):
                    if k != key:
                        offloaded.later_uses.after[k] = key
        offloaded.later_uses.queues.append(self._queued)
        offloaded.later_uses.in_backward = step_in_backward
        offloaded.on_remove.append(self._drop_state)  # the state goes with the offload: a later one may reuse names
        if hasattr(offloaded, "on_load"):
            offloaded.on_load.append(self._remake_masters)

    def _check_host_budget(self, host_budget: int, step_in_backward: bool) -> None:
        """One update holds its parameter's fp32 master and both moments in the host tier at once (stepping in
        backward, beside what backward holds there): a budget below that for the largest parameter could never
        step it, or only by luck, so say so now, before any state exists."""
        def one_update(name: str, key: str | None, p: torch.nn.Parameter) -> int:
            n = (p.numel() if key is None else self._param_shape(key).numel()) * moment_dtype(key, p).itemsize
            return TierPool.capacity_for(n) * (2 if key is None else 3)

        # name -> what backward may hold in the host tier while it is updated
        beside = self.offloaded.held_beside_updates() if step_in_backward else {}
        need, name = max(((one_update(n, k, p) + beside.get(n, 0), n) for n, k, p in self._items),
                         default=(0, ""))
        what = "its master weight and two moments"
        if beside.get(name):
            what += f", beside the largest unit backward may hold meanwhile ({beside[name]} bytes)"
        if need > host_budget:
            raise ValueError(f"host_budget_bytes={host_budget} ({host_budget / 2**20:.1f} MiB) is below what one "
                             f"AdamW update of {name!r} needs at once: {need} bytes ({need / 2**20:.1f} MiB) for "
                             f"{what}. Raise host_budget_bytes to at least that (a few times more lets the "
                             f"optimizer read ahead)")

    def _torch_groups(self, param_groups: list[dict[str, Any]] | None,
                      defaults: dict[str, Any]) -> list[dict[str, Any]]:
        """``param_groups`` with parameters for names, and the parameters in no group as a last group."""
        by_name = {name: p for name, _, p in self._items}
        frozen = {name for name, _, _ in self._frozen}
        seen: dict[str, int] = {}
        groups = []
        for i, group in enumerate(param_groups or []):
            if not isinstance(group, dict) or "params" not in group:
                raise TypeError(f"param_groups[{i}] must be a dict with a 'params' list")
            unknown = sorted(set(group) - {"params", *HYPER})
            if unknown:
                raise ValueError(f"param_groups[{i}] has unknown keys {unknown}; valid: 'params', {', '.join(HYPER)}")
            params = [group["params"]] if isinstance(group["params"], (str, torch.Tensor)) else list(group["params"])
            names, named_frozen = [], False
            for p in params:
                name = p if isinstance(p, str) else self._name_of.get(id(p))
                if name in frozen:
                    named_frozen = True
                    continue  # never has a gradient: nothing to step
                if name not in by_name:
                    what = repr(p) if isinstance(p, str) else f"a tensor of shape {tuple(p.shape)}"
                    raise ValueError(f"param_groups[{i}]: {what} is not a parameter of the offloaded model "
                                     f"(give parameter names, as in model.named_parameters(), or the parameters)")
                if name in seen:
                    raise ValueError(f"param_groups[{i}]: parameter {name!r} is already in param_groups[{seen[name]}]")
                seen[name] = i
                names.append(name)
            if not names and not named_frozen:
                raise ValueError(f"param_groups[{i}] has no parameters")
            hyper = {k: v for k, v in group.items() if k != "params"}
            if "betas" in hyper:
                hyper["betas"] = tuple(hyper["betas"])
            check_hyper({**defaults, **hyper}, f"param_groups[{i}]: ")
            groups.append({"params": [by_name[n] for n in names], **hyper})
        rest = [p for name, _, p in self._items if name not in seen]
        if rest or not groups:
            groups.append({"params": rest})
        return groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Called by ``Optimizer.__init__`` with the groups :meth:`_torch_groups` checked; refused after it.

        Not torch's own, which imports torch._dynamo on its first call: 68 MiB of RSS here.
        """
        if not getattr(self, "_building", False):
            raise RuntimeError("OffloadedAdamW steps the parameters of the model it was given; pass param_groups= "
                               "when constructing it")
        self.param_groups.append({**self.defaults, **param_group, "params": list(param_group["params"])})

    @staticmethod
    def _positive_bytes(value: int | str | None, default: int, name: str) -> int:
        """A byte count given as an int or a size such as '64MiB'; ``default`` when None."""
        n = default if value is None else parse_bytes(value, name=name)
        if n < 1:
            raise ValueError(f"{name}={value!r} must be at least 1 byte")
        return n

    def _queued(self) -> dict[str, int]:
        """Store keys of the parameters still to be stepped -> their place in the queue: the worker's, then
        step()'s own. Asked by eviction under the store's lock: it reads without taking the optimizer's."""
        running, pending, queue, done = self._running_update, list(self._pending), self._queue, self._done
        names = [u.name for u in (running, *pending) if u is not None] + [item[0] for item in queue[done:]]
        out: dict[str, int] = {}
        for pos, name in enumerate(names):
            out.update(dict.fromkeys(self._use_keys.get(name, ()), pos))
        return out

    def _thawed_message(self, names: list[str]) -> str:
        return (f"{len(names)} parameter(s) have a gradient but were frozen (requires_grad=False) when this "
                f"OffloadedAdamW was created, so it keeps no state for them: {', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}. Create the optimizer after unfreezing them")

    def _on_grad_ready(self, key: str) -> None:
        if key not in self._by_key:
            raise RuntimeError(self._thawed_message([n for n, k, _ in self._frozen if k == key]))
        name, key_, p = self._by_key[key]
        if key in self._early:
            if getattr(self.offloaded, "backwards_failed", 0) != self._backwards_failed:
                self.offloaded.broken = (
                    f"a backward raised after stepping in backward had updated some parameters ({name} among them): "
                    f"their updates stand and the rest never came, so the model is part of a step ahead and no "
                    f"step can finish it; load a checkpoint to go on")
                raise UnrestorableUpdateError(self.offloaded.broken)
            raise RuntimeError(f"{name}: a second backward before step(); step_in_backward=True steps each "
                               "parameter after one backward, so gradient accumulation needs step_in_backward=False")
        grad = self.offloaded.grads.get(key)
        assert self._worker is not None
        # Backward waits while the gradients queued before this one exceed the backlog bound.
        if self._backlog_bytes > self.max_grad_backlog_bytes:
            t0 = time.perf_counter()
            while self._backlog_bytes > self.max_grad_backlog_bytes and (oldest := self._oldest_update()):
                try:
                    oldest.done.exception(timeout=0.05)
                except FutureTimeoutError:
                    # The worker waits for host memory that backward holds: backward goes on (and releases
                    # it), the backlog over its bound for a while, rather than both waiting for each other.
                    if self._worker_ident is not None and self.store.is_waiting_for_room(self._worker_ident):
                        break
            self.store.stats.add_wait(t0, time.perf_counter(), key="gradient backlog")
        nbytes = grad.numel() * grad.element_size() if grad is not None else 0
        update = _Update(name, key_, p, grad, nbytes)
        with self._lock:
            self._backlog_bytes += nbytes
            self._pending.append(update)
        self._early[key] = update
        self._worker.submit(self._step_next)

    def _oldest_update(self) -> _Update | None:
        """The worker's update that runs now, or else the next, or None."""
        running, pending = self._running_update, self._pending
        return running if running is not None else (pending[0] if pending else None)

    def _gradients_taken(self) -> str | None:
        """Why no gradient may be read now: since the last step() a backward has handed its gradients to the
        updates, which consume them as they go (a clip then would race them, or find none and clip nothing)."""
        if not self._early:
            return None
        return ("OffloadedAdamW(step_in_backward=True) applies each gradient as backward produces it, and this "
                "backward's are being applied now, so none is there to read or clip (torch's clip_grad_norm_ "
                "would clip nothing). Clip with step_in_backward=False (off.clip_grad_norm_), or read gradients "
                "after opt.step() with step_in_backward=False")

    def _step_next(self) -> None:
        """The worker's next update (one job a gradient; the order is the queue's when the job starts)."""
        with self._lock:
            update = self._pending.pop(0)
            self._running_update = update
            upcoming = [u.item() for u in (update, *self._pending)]
        try:
            # Read ahead in the worker's order, within readahead_bytes: reads issued for every gradient as
            # it arrives would overflow the host tier and evict each other before use.
            with self.store.stats.background():
                self._pipeline.read_ahead(upcoming, 0)
                self._timed_step(update.name, update.key, update.param, update.grad, lambda: self._hyper_of(update))
            self.offloaded.grads.pop(update.key, None)  # consumed: its memory goes now, not at zero_grad()
            update.grad = None
        except BaseException as e:
            with self._lock:  # deferred or not is decided under the lock step() defers under
                update.failed = e
                deferred = update.deferred
            if deferred:
                self._failed_after_step(update, e)
            update.done.set_exception(update.failed)
        else:
            update.done.set_result(None)
        finally:
            with self._lock:
                self._backlog_bytes -= update.nbytes
                self._running_update = None

    def _hyper_of(self, update: _Update) -> tuple:
        """The hyper-parameters of ``update``: fixed when a step() returned before it ran, else its group's now."""
        with self._lock:
            return update.hyper if update.hyper is not None else self._hyper(update.name)

    def _failed_after_step(self, update: _Update, error: BaseException) -> None:
        """An update step() left to finish failed (see [Note: Finishing in the next forward]): its fence raises
        this, and the model refuses to run until step() steps it again."""
        why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        if isinstance(error, UnrestorableUpdateError):
            update.failed = error  # the model is broken for good (the pipeline said so)
            return
        message = (f"the AdamW update of {update.name!r}, which step() left to finish during the next forward, "
                   f"failed ({why}); its parameter and state keep the values of before it. Call opt.step() "
                   f"again: it steps it again with the gradient it kept; until then forward, reads of that "
                   f"parameter, zero_grad() and checkpoints refuse")
        failure = RuntimeError(message)
        failure.__cause__ = error
        update.failed = failure
        with self._lock:
            self._deferred_failed.append(update)
        if self._unfinished is None:
            self._unfinished = message
        if not self.offloaded.broken:
            self.offloaded.broken = message

    def close(self) -> None:
        """Stop the worker of ``step_in_backward`` (after the updates in flight) and detach from the model."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
            callbacks = self.offloaded.grad_ready_callbacks
            if self._on_grad_ready in callbacks:
                callbacks.remove(self._on_grad_ready)
            guards = getattr(self.offloaded, "grad_read_guards", [])
            if self._gradients_taken in guards:
                guards.remove(self._gradients_taken)
        if self._queued in self.offloaded.later_uses.queues:
            self.offloaded.later_uses.queues.remove(self._queued)

    def _drop_state(self) -> None:
        """Drop this optimizer's state from the store (its model's offload is being removed)."""
        self.close()
        with contextlib.suppress(BaseException):
            self.wait()
        for name, key, p in self._items:
            for k in state_keys(name, key, p):
                if k != key and self.store.contains(k):
                    self.store.drop(k)
        self._items = []
        self.steps = {}

    def _remake_masters(self, names: list[str]) -> None:
        """The model loaded new values into these parameters: their fp32 masters are made from them, as this
        optimizer made them when it was created (a bf16 master left as it was would overwrite the loaded value
        at the next step)."""
        self.wait()
        loaded = set(names)
        for name, key, p in self._items:
            if name in loaded and has_master(key, p):
                value = self.offloaded.read_param(name)
                master = self.store.get(optimizer_key(name, "master"), Tier.HOST)
                try:
                    master.copy_(value)
                    self.store.mark_dirty(optimizer_key(name, "master"), Tier.HOST)
                finally:
                    self.store.release(optimizer_key(name, "master"), Tier.HOST)

    def _param_shape(self, key: str) -> torch.Size:
        return torch.Size(self.store.info(key)["shape"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient, or zero each in place (``set_to_none=False``), as torch's optimizers do: then a
        parameter the next backward gives no gradient (an expert no token chose, a branch not taken) is stepped
        with zeros."""
        if self._unfinished is not None:
            raise RuntimeError(self._unfinished)
        if not set_to_none and self.step_in_backward:
            raise ValueError("zero_grad(set_to_none=False) keeps every gradient, zeroed, until the next step; with "
                             "step_in_backward=True each gradient is applied and dropped as backward makes it, so "
                             "there are none to keep (a parameter that gets no gradient would not be stepped with "
                             "zeros, as torch would step it): call zero_grad() (set_to_none=True), or use "
                             "step_in_backward=False")
        self.offloaded.zero_grad(set_to_none)

    def _was_applied(self, name: str, grad: torch.Tensor) -> bool:
        """Whether ``name``'s last update applied this very gradient (see [Note: A step that stops part-way])."""
        seen = self._applied.get(name)
        return seen is not None and seen[0]() is grad and seen[1] == grad._version

    def _grad(self, name: str, key: str | None, p: torch.nn.Parameter) -> torch.Tensor | None:
        if key is None:
            return p.grad
        return self.offloaded.grads.get(key)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step over every parameter with a gradient; returns what ``closure`` returned (None without).

        ``closure``, as torch's optimizers take it, is called first with
        gradients enabled (it runs forward and backward and returns the loss).
        Writes of the updated state go on in the background (write-behind)
        while the next forward and backward run; the next ``step()`` (or
        :meth:`wait`) waits for them first and raises any failure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    def _step(self) -> None:
        if self.offloaded.broken and self.offloaded.broken != self._unfinished:
            raise UnrestorableUpdateError(self.offloaded.broken)
        early, self._early = self._early, {}
        self._backwards_failed = getattr(self.offloaded, "backwards_failed", 0)
        t0 = time.perf_counter()  # the training loop waits here for I/O-bound work: stall time
        last, self._deferred = self._deferred, []
        for update in last:  # what the last step() left to finish (its failures are in _deferred_failed)
            update.done.exception()
        if self.finish_in_forward and early and self._defer(list(early.values())):
            errors: list[BaseException | None] = []
            updated = len(early)
        else:
            errors = [u.done.exception() for u in early.values()]  # waits for the updates started in backward
            updated = sum(err is None for err in errors)  # by this step so far
        self._queue, self._done = [], 0
        try:
            updated += self._retry_failed()
            previous = self._pipeline.take_previous()
            for h in previous:
                h.wait()
            if early or previous or last:
                self.store.stats.add_wait(t0, time.perf_counter(), key="optimizer")
            for err in errors:
                if err is not None:
                    raise err
            thawed = [n for n, k, p in self._frozen if self._grad(n, k, p) is not None]
            if thawed:
                raise RuntimeError(self._thawed_message(thawed))
            ready = [(n, k, p, g) for n, k, p in self._items
                     if k not in early and (g := self._grad(n, k, p)) is not None]
            work = [item for item in ready if not self._was_applied(item[0], item[3])]
            if ready and not work and not early and self._unfinished is None:
                raise RuntimeError("step() again with the gradients the last step() applied: run backward() first "
                                   "(after zero_grad()); a step applies a gradient once")
            self._queue = work
            for i, (name, key, p, grad) in enumerate(work):
                self._pipeline.read_ahead(work, i)
                self._timed_step(name, key, p, grad)
                updated += 1
                self._done = i + 1
        except BaseException as e:
            self._queue, self._done = [], 0
            if updated and not isinstance(e, UnrestorableUpdateError):
                self._stopped_part_way(updated, e)
            raise
        self._queue, self._done = [], 0
        if self._unfinished is not None and self.offloaded.broken == self._unfinished:
            self.offloaded.broken = None  # finished: the model is one whole step ahead again
        self._unfinished = None
        self._pipeline.end_step()

    def _defer(self, updates: list[_Update]) -> bool:
        """Leave those of ``updates`` not done yet to finish during the next forward, in its order, their keys
        fenced and their hyper-parameters fixed now (see [Note: Finishing in the next forward]); False, deferring
        nothing, when one of them has failed already (step() then waits for all and raises, as without it)."""
        mine = set(updates)
        with self._lock:
            if any(u.failed is not None for u in updates):
                return False
            self._pending.reverse()  # backward's order, reversed: the next forward's
            left = [u for u in (self._running_update, *self._pending) if u is not None and u in mine]
            for u in left:
                u.deferred = True
                u.hyper = self._hyper(u.name)
        for u in left:  # a change done by now lifts its fence at once
            self.store.fence(self._use_keys[u.name], u.done, owner=self._worker_ident)
        self._deferred = left
        return True

    def _retry_failed(self) -> int:
        """Step again, here, the updates a step() left to finish that failed; how many. On a failure again
        the rest stay fenced (their reads raise) and it raises."""
        with self._lock:
            failed, self._deferred_failed = self._deferred_failed, []
        for i, update in enumerate(failed):
            self.store.unfence(self._use_keys[update.name])
            try:
                self._timed_step(update.name, update.key, update.param, update.grad, lambda u=update: u.hyper)
            except BaseException:
                for rest in failed[i:]:
                    fenced: Future = Future()
                    fenced.set_exception(rest.failed or RuntimeError(f"the update of {rest.name!r} failed"))
                    self.store.fence(self._use_keys[rest.name], fenced, owner=0)  # no thread is 0: all wait
                with self._lock:
                    self._deferred_failed[:0] = failed[i:]
                raise
            if self.offloaded.grads.get(update.key) is update.grad:
                self.offloaded.grads.pop(update.key)
            update.grad = None
        return len(failed)

    def _finish_deferred(self) -> None:
        """Wait for the updates the last step() left to finish; raise the first that failed."""
        if threading.get_ident() == self._worker_ident:
            return
        for update in list(self._deferred):
            if (error := update.done.exception()) is not None:
                raise error

    def _stopped_part_way(self, updated: int, error: BaseException) -> None:
        """[Note: A step that stops part-way] An update that fails (a read of
        its state, say) leaves that parameter as it was, but those updated
        before it stay updated: the model is part of a step ahead, which no
        resident training ever is. A gradient whose update succeeded is marked
        as applied (the tensor and its version), so calling step() again with
        the same gradients updates only the rest, and the step ends as if it
        had not failed; step() twice with the same gradients is refused. Until
        it is finished, forward, zero_grad() and checkpoints refuse (through
        the model's ``broken``), since their values would mix two steps."""
        left = sum(1 for n, k, p in self._items
                   if (g := self._grad(n, k, p)) is not None and not self._was_applied(n, g))
        if not left:
            return
        why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__  # Ctrl-C has no text
        self._unfinished = (f"step() stopped after updating {updated} parameters, {left} not yet ({why}). Call "
                            f"opt.step() again, before anything else: it updates the rest with the gradients it kept, "
                            f"and the step ends as if it had not failed; until then forward, zero_grad() and "
                            f"checkpoints refuse, since the model is part of a step ahead")
        if not self.offloaded.broken:
            self.offloaded.broken = self._unfinished

    def _timed_step(self, name: str, key: str | None, p: torch.nn.Parameter, grad: torch.Tensor,
                    hyper: Callable[[], tuple] | None = None) -> None:
        """One parameter's update through the pipeline (a timeline span when one is recorded); ``hyper`` gives
        its hyper-parameters (by default its group's, read once its state is in memory)."""
        step = self._step_counts.get(name, 0.0) + 1.0
        timeline = self.store.timeline
        with timeline.span(f"adamw {name}", "optimizer") if timeline is not None else contextlib.nullcontext():
            try:
                self._pipeline.update(name, key, p, grad, step, hyper or (lambda: self._hyper(name)))
            except UnrestorableUpdateError as e:  # no later step or forward may use the half-updated values
                self.offloaded.broken = str(e)
                raise
        self._step_counts[name] = step
        self._applied[name] = (weakref.ref(grad), grad._version)

    def wait(self) -> None:
        """Wait for the updates the last step() left to finish (``finish_in_forward``) and the write-behind of
        the last step; raises the first failure (the data stays in memory)."""
        self._finish_deferred()
        self._pipeline.wait()

    @property
    def steps(self) -> dict[str, float]:
        """Parameter name -> AdamW's step count of its last update (once the updates a step() left to finish
        are done)."""
        self._finish_deferred()
        return self._step_counts

    @steps.setter
    def steps(self, value: dict[str, float]) -> None:
        self._step_counts = dict(value)

    def _hyper(self, name: str) -> tuple:
        """(lr, betas, eps, weight_decay, maximize) of the parameter's group now: read once per update, so a scheduler
        changing the group during backward never mixes two learning rates in one update."""
        group = self._group_of[name]
        return tuple(group[k] for k in HYPER)

    def state_tensors(self, steps: dict[str, float] | None = None) -> list[tuple[str, str, str]]:
        """(parameter name, state name, store key) of every state tensor of parameters stepped so far (or,
        given ``steps``, of those it names)."""
        stepped = self.steps if steps is None else steps
        out = []
        for name, key, p in self._items:
            if name not in stepped:
                continue
            for what in OPTIMIZER_STATE[:2] + (("master",) if has_master(key, p) else ()):
                out.append((name, what, optimizer_key(name, what)))
        return out

    def group_states(self) -> list[dict[str, Any]]:
        """Each parameter group's hyper-parameters (and what a scheduler added, such as ``initial_lr``), with
        ``"params"`` as parameter names: what state_dict() and checkpoints keep."""
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": [self._name_of[id(p)] for p in g["params"]]}
                for g in self.param_groups]

    def check_group_states(self, groups: Any) -> list[dict[str, Any]]:
        """``groups`` as :meth:`load_group_states` would apply them, checked without changing anything: the same
        groups of the same parameters (one group without ``"params"``, as older state dicts have, applies to
        every group), each with valid hyper-parameters. Raises ValueError."""
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ValueError("parameter groups must be a list of dicts")
        mine = self.group_states()
        if any(isinstance(n, int) for g in groups for n in g.get("params", ())):
            raise ValueError("these parameter groups name parameters by index, as torch.optim's state_dict() does: "
                             "OffloadedAdamW's state_dict() names them (which an index cannot be matched to "
                             "safely). Load state saved by an OffloadedAdamW (or a checkpoint), or start its "
                             "moments afresh")
        if len(groups) == 1 and "params" not in groups[0]:
            groups = [{**groups[0], "params": g["params"]} for g in mine]
        if [g.get("params") for g in groups] != [g["params"] for g in mine]:
            raise ValueError(f"the saved parameter groups ({len(groups)}) do not hold the same parameters as this "
                             f"optimizer's ({len(mine)}); build it with the param_groups it was saved with")
        out = []
        for i, (saved, current) in enumerate(zip(groups, mine)):
            group = {**current, **{k: (tuple(v) if k == "betas" and isinstance(v, list) else v)
                                   for k, v in saved.items()}}
            try:
                check_hyper(group, f"group {i}: ")
            except TypeError:
                raise ValueError(f"group {i}: hyper-parameters of the wrong type: {saved}") from None
            out.append(group)
        return out

    def load_group_states(self, groups: list[dict[str, Any]]) -> None:
        """Restore :meth:`group_states` (checked by :meth:`check_group_states` first)."""
        for target, saved in zip(self.param_groups, self.check_group_states(groups)):
            for k, v in saved.items():
                if k != "params":
                    target[k] = v

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors (read from the store), like torch.optim's state_dict, keyed by parameter name."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, what, k in self.state_tensors():
            state.setdefault(name, {"step": torch.tensor(self.steps[name])})[what] = self.store.read(k)
        return {"state": state, "param_groups": self.group_states()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.wait()
        self.load_group_states(sd["param_groups"])
        names = {n for n, _, _ in self._items}
        for name, entry in sd["state"].items():
            if name not in names:
                raise KeyError(f"optimizer state for unknown parameter {name!r}")
            self.steps[name] = float(entry["step"])
            for what, value in entry.items():
                if what == "step":
                    continue
                k = optimizer_key(name, what)
                t = self.store.get(k, Tier.HOST)
                t.copy_(value)
                self.store.mark_dirty(k, Tier.HOST)
                self.store.release(k, Tier.HOST)
        self.store.flush()

    def __repr__(self) -> str:
        groups = ", ".join(f"({len(g['params'])} params: " + ", ".join(f"{k}={g[k]}" for k in HYPER) + ")"
                           for g in self.param_groups)
        return f"OffloadedAdamW({groups})"


class OffloadedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for :class:`OffloadedAdamW`: loss scaling for fp16 autocast training.

    Used as the stock scaler is (``scaler.scale(loss).backward()``, optionally
    ``scaler.unscale_(opt)`` before ``off.clip_grad_norm_``, then
    ``scaler.step(opt)`` and ``scaler.update()``), it unscales and checks for
    overflow the gradients where the offloaded model keeps them: the stock
    scaler looks in ``param.grad``, where an offloaded parameter has none, and
    would neither unscale them nor see an overflow. A step with an inf or NaN
    gradient is skipped and the scale lowered, as torch does; the numbers are
    those of ``torch.amp.GradScaler`` on the resident model (tested). It needs
    ``step_in_backward=False``: the scale must be checked before any update.
    """

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        grads_in_order = getattr(getattr(optimizer, "offloaded", None), "grads_in_order", None)
        if grads_in_order is None:  # not an offloaded model: its gradients are in param.grad
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if getattr(optimizer, "step_in_backward", False):
            raise RuntimeError("loss scaling needs every gradient checked before any update, but this optimizer "
                               "steps them during backward: use OffloadedAdamW(..., step_in_backward=False)")
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads_in_order():
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients: keep the parameters fp32 and compute in "
                                 "fp16 under torch.autocast")
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), grads in groups.items():
                if device not in found:
                    found[device] = found_inf.to(device, copy=True)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv_scale.to(device))
        return found
