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

[Note: Pipelined step] Parameters are stepped one at a time in a fixed order.
Before parameter i is computed, the state of the next parameters (up to
``readahead_bytes`` of it, by default half the host budget, or half the room a
placement leaves for copies in flight, and ``readahead``
parameters if given; none where the model's prefetch depth is 0) is already
being read into the host tier; after it is computed its state is
marked dirty and a write-back is started at once, so the drive writes
parameter i while the CPU computes i+1. The arithmetic is torch.optim.AdamW's
own, with the implementation its ``foreach``/``fused`` flags choose (see
[Note: Which AdamW] in _adamw.py), so fp32 training is bit-identical to it
given the same flags.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import torch
from torch import nn

from tierstore import Tier, TierStore, parse_bytes
from tierstore._copies import dense_strides
from tierstore._memory import TierPool

from . import _adamw
from ._adamw import HYPER, check_hyper
from ._contract import (
    OPTIMIZER_STATE,
    STEPPED_DTYPES,
    OffloadedParameters,
    moment_dtype,
    optimizer_key,
)
from ._grads import generation, store_key_of, values_of
from ._layouts import StateLayout, decode_state, encode_state, join_master, split_master
from ._pipeline import StatePipeline, UnrestorableUpdateError, state_keys


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
    group with the keyword defaults. The update is torch.optim.AdamW's own
    (``maximize`` included), with the implementation its flags choose for CPU
    tensors: the single-tensor one by default, the multi-tensor one with
    ``foreach=True``, the fused kernel with ``fused=True`` (one pass over the
    state, several times faster here); each is bit-identical to
    torch.optim.AdamW given the same flag, and the fused kernel's results differ
    from the default's in the last bits, as torch's do. ``amsgrad``, ``capturable`` and
    ``differentiable`` must be False. It is a ``torch.optim.Optimizer``, so learning-rate
    schedulers drive it through ``param_groups``; its state lives in the store
    (read it with :meth:`state_dict`), not in ``self.state``.
    """

    steps_offloaded_parameters = True  # other torch optimizers are refused over offloaded parameters

    def __init__(self, offloaded: OffloadedParameters, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, param_groups: list[dict[str, Any]] | None = None,
                 readahead: int | None = None, readahead_bytes: int | str | None = None,
                 home: Tier | str | None = None, step_in_backward: bool = False,
                 max_grad_backlog_bytes: int | str | None = None, maximize: bool = False, amsgrad: bool = False,
                 foreach: bool | None = None, fused: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, moments: str | None = None, master: str | None = None) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        check_hyper(defaults, "")
        unsupported = [f"{k}=True" for k, v in (("amsgrad", amsgrad), ("capturable", capturable),
                                                  ("differentiable", differentiable)) if v]
        if unsupported:
            raise ValueError(f"OffloadedAdamW does not support {', '.join(unsupported)} (torch.optim.AdamW's "
                             f"amsgrad would keep a third state tensor per parameter; capturable and differentiable "
                             f"are for CUDA graphs and higher-order optimization): leave them False")
        impl = _adamw.impl_of(foreach, fused)
        if not isinstance(offloaded, OffloadedParameters):
            raise TypeError(f"OffloadedAdamW steps offloaded parameters: pass what offload_model or offload_fsdp "
                            f"returned, not {type(offloaded).__name__}")
        config = offloaded.store.config
        self.layout = StateLayout(moments if moments is not None else config.optimizer_moments,
                                  master if master is not None else config.optimizer_master)
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
            (lambda: fixed) if fixed is not None else (lambda: offloaded.readahead_room() or max(1, host // 2))),
            impl=impl, layout=self.layout)
        home = Tier.parse(home if home is not None else self.store.config.optimizer_tier)
        self.steps: dict[str, float] = {}
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
        self.layout.check(self._items)
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
            self.store.require_nvme_room(sum(self._state_bytes(key, p) for _, key, p in self._items),
                                         "AdamW state of {size}")
        try:
            for name, key, p in self._items:
                # In the parameter's layout, as torch's AdamW makes them (zeros_like): see [Note: The fused
                # kernel and layouts].
                shape, stride = (p.shape, dense_strides(p)) if key is None else self._param_layout(key)
                zeros = self.layout.moment_tensor(self.layout.moments_of(key, p, shape.numel()),
                                                  moment_dtype(key, p), shape, stride)
                handles.append(self.store.put(optimizer_key(name, "exp_avg"), zeros, home=home))
                handles.append(self.store.put(optimizer_key(name, "exp_avg_sq"), zeros, home=home))
                how = self.layout.master_of(key, p)
                if how == "fp32":
                    master_value = self.offloaded.read_param(name).float()
                    handles.append(self.store.put(optimizer_key(name, "master"), master_value, home=home))
                elif how == "split":  # the weight's bf16 value is the master's top half: its low half is 0
                    low = (torch.zeros(shape, dtype=torch.int16) if stride is None else
                           torch.empty_strided(shape, stride, dtype=torch.int16).zero_())
                    handles.append(self.store.put(optimizer_key(name, "master"), low, home=home))
            for h in handles:
                h.wait()
        except BaseException:  # a failed constructor leaves nothing in the store (a retry must not see it)
            self.store.undo_puts(handles)
            raise
        self._pipeline.state_bytes = {name: sum(self.store.info(k)["nbytes"]
                                                for k in state_keys(name, key, p, self.layout))
                                      for name, key, p in self._items}
        self.step_in_backward = step_in_backward
        self._early: dict[str, Future] = {}  # key -> update started in backward
        self._queue: list[tuple] = []  # (name, key, param, grad) in the order they are stepped
        self._done = 0  # how many of the queue are stepped
        self._futures: list[Future] = []  # of the queue's updates started in backward
        self._backlog_bytes = 0  # of gradients queued and not yet consumed
        self._backlog_lock = threading.Lock()
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
            offloaded.grad_ready_callbacks.append(self._on_grad_ready)
            if hasattr(offloaded, "grad_read_guards"):  # param.grad of an offloaded parameter asks it
                offloaded.grad_read_guards.append(self._gradients_taken)
        # Every store key an update of an offloaded parameter uses, built once: eviction asks for the
        # queue's keys on each allocation.
        self._use_keys = {name: tuple(dict.fromkeys((key, *state_keys(name, key, p, self.layout))))
                          for name, key, p in self._items if key is not None}
        # Eviction then knows when this state is used (see [Note: Who uses a copy next]).
        for name, key, p in self._items:
            if key is not None:
                for k in state_keys(name, key, p, self.layout):
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
            numel = p.numel() if key is None else self._param_shape(key).numel()
            n = numel * moment_dtype(key, p).itemsize
            if self.layout.is_plain(key, p, numel):
                # after backward, an offloaded parameter's gradient is held too (see [Note: Gradients in the tiers])
                return TierPool.capacity_for(n) * (2 if key is None else 3 if step_in_backward else 4)
            # the stored state and the weight it steps; a kept gradient after backward
            return (sum(TierPool.capacity_for(b) for b in self._state_pieces(key, p))
                    + TierPool.capacity_for(numel * p.dtype.itemsize)
                    + (0 if step_in_backward else TierPool.capacity_for(n)))

        # name -> what backward may hold in the host tier while it is updated
        beside = self.offloaded.held_beside_updates() if step_in_backward else {}
        need, name = max(((one_update(n, k, p) + beside.get(n, 0), n) for n, k, p in self._items),
                         default=(0, ""))
        what = "its master weight and two moments" + ("" if step_in_backward else ", and its gradient")
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

    def _state_pieces(self, key: str | None, p: torch.nn.Parameter) -> list[int]:
        """Bytes of each stored piece of this parameter's optimizer state under the layout."""
        numel = p.numel() if key is None else self._param_shape(key).numel()
        return self.layout.piece_bytes(key, p, numel, moment_dtype(key, p))

    def _state_bytes(self, key: str | None, p: torch.nn.Parameter) -> int:
        return sum(self._state_pieces(key, p))

    @staticmethod
    def _positive_bytes(value: int | str | None, default: int, name: str) -> int:
        """A byte count given as an int or a size such as '64MiB'; ``default`` when None."""
        n = default if value is None else parse_bytes(value, name=name)
        if n < 1:
            raise ValueError(f"{name}={value!r} must be at least 1 byte")
        return n

    def _queued(self) -> dict[str, int]:
        """Store keys of the parameters still to be stepped -> their place in the queue."""
        queue, done = self._queue, self._done
        out: dict[str, int] = {}
        for pos, item in enumerate(queue[done:]):
            out.update(dict.fromkeys(self._use_keys.get(item[0], ()), pos))
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
            while self._backlog_bytes > self.max_grad_backlog_bytes and self._done < len(self._futures):
                try:
                    self._futures[self._done].exception(timeout=0.05)
                except FutureTimeoutError:
                    # The worker waits for host memory that backward holds: backward goes on (and releases
                    # it), the backlog over its bound for a while, rather than both waiting for each other.
                    if self._worker_ident is not None and self.store.is_waiting_for_room(self._worker_ident):
                        break
            self.store.stats.add_wait(t0, time.perf_counter(), key="gradient backlog")
        nbytes = grad.numel() * grad.element_size() if grad is not None else 0
        with self._backlog_lock:
            self._backlog_bytes += nbytes
        self._queue.append((name, key_, p, grad))
        future = self._worker.submit(self._step_ready, len(self._queue) - 1, nbytes)
        self._futures.append(future)
        self._early[key] = future

    def _gradients_taken(self) -> str | None:
        """Why no gradient may be read now: since the last step() a backward has handed its gradients to the
        updates, which consume them as they go (a clip then would race them, or find none and clip nothing)."""
        if not self._early:
            return None
        return ("OffloadedAdamW(step_in_backward=True) applies each gradient as backward produces it, and this "
                "backward's are being applied now, so none is there to read or clip (torch's clip_grad_norm_ "
                "would clip nothing). Clip with step_in_backward=False (off.clip_grad_norm_), or read gradients "
                "after opt.step() with step_in_backward=False")

    def _step_ready(self, i: int, nbytes: int) -> None:
        self._worker_ident = threading.get_ident()
        # Read ahead in the worker's order, within readahead_bytes: reads issued for every gradient as
        # it arrives would overflow the host tier and evict each other before use.
        ready = self._queue
        try:
            with self.store.stats.background():
                self._pipeline.read_ahead(ready, i)
                name, key, p, grad = ready[i]
                self._timed_step(name, key, p, grad)
            ready[i] = (name, key, p, None)
            self.offloaded.grads.pop(key, None)  # consumed: its memory goes now, not at zero_grad()
        finally:
            with self._backlog_lock:
                self._backlog_bytes -= nbytes
            self._done = i + 1

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
            for k in state_keys(name, key, p, self.layout):
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
            if name in loaded and self.layout.master_of(key, p) is not None:
                self._write_master(name, key, p, None)

    def _write_master(self, name: str, key: str | None, p: torch.nn.Parameter, value: torch.Tensor | None) -> None:
        """Set a parameter's master to ``value`` (fp32), or to its weight's value (None). Under
        ``master="split"`` a value sets the weight too: it is the master's top half."""
        k = optimizer_key(name, "master")
        how = self.layout.master_of(key, p)
        held = self.store.get(k, Tier.HOST)
        try:
            if how == "fp32":
                held.copy_(self.offloaded.read_param(name) if value is None else value)
            elif value is None:
                held.zero_()  # the weight's own value: a low half of 0
            else:
                assert key is not None
                weight = self.store.get(key, Tier.HOST)
                try:
                    self.store.writing(key).wait()  # its last write reads it
                    master = torch.empty_like(weight, dtype=torch.float32).copy_(value)
                    split_master(master, weight, held)
                    self.store.mark_dirty(key, Tier.HOST)
                finally:
                    self.store.release(key, Tier.HOST)
                self.store.write_back(key)
            self.store.mark_dirty(k, Tier.HOST)
        finally:
            self.store.release(k, Tier.HOST)

    def named_items(self) -> list[tuple[str, str | None, torch.nn.Parameter]]:
        """(name, store key or None for a resident parameter, parameter) of each parameter this optimizer steps."""
        return list(self._items)

    def reset_state(self, names: list[str] | set[str]) -> None:
        """Start these parameters' state afresh, as a new optimizer would: zero moments, no step, masters made
        from the parameters' current values. What a load does for the parameters its saved state does not
        hold (torch's ``load_state_dict`` replaces the whole state: nothing of a later step may survive)."""
        self.wait()
        chosen = set(names)
        for name, key, p in self._items:
            if name not in chosen:
                continue
            self.steps.pop(name, None)
            self._applied.pop(name, None)
            for what in ("exp_avg", "exp_avg_sq"):
                k = optimizer_key(name, what)
                t = self.store.get(k, Tier.HOST)
                try:
                    t.zero_()
                    self.store.mark_dirty(k, Tier.HOST)
                finally:
                    self.store.release(k, Tier.HOST)
        self._remake_masters(list(chosen))

    def _param_shape(self, key: str) -> torch.Size:
        return torch.Size(self.store.info(key)["shape"])

    def _param_layout(self, key: str) -> tuple[torch.Size, tuple[int, ...] | None]:
        """The stored parameter's shape, and its strides where it is not contiguous."""
        info = self.store.info(key)
        return torch.Size(info["shape"]), info["stride"]

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
        return seen is not None and seen[0]() is grad and seen[1] == generation(grad)

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
        errors = [f.exception() for f in early.values()]  # waits for the updates started in backward
        self._queue, self._done, self._futures = [], 0, []
        updated = sum(err is None for err in errors)  # by this step so far
        try:
            previous = self._pipeline.take_previous()
            for h in previous:
                h.wait()
            if early or previous:
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

    def _timed_step(self, name: str, key: str | None, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """One parameter's update through the pipeline (a timeline span when one is recorded)."""
        step = self.steps.get(name, 0.0) + 1.0
        timeline = self.store.timeline
        with timeline.span(f"adamw {name}", "optimizer") if timeline is not None else contextlib.nullcontext():
            try:
                with values_of(grad) as values:  # a stored gradient is read into the host tier for its update
                    self._pipeline.update(name, key, p, values, step, lambda: self._hyper(name))
            except UnrestorableUpdateError as e:  # no later step or forward may use the half-updated values
                self.offloaded.broken = str(e)
                raise
        self.steps[name] = step
        self._applied[name] = (weakref.ref(grad), generation(grad))

    def wait(self) -> None:
        """Wait for the write-behind of the last step; raises the first failure (the data stays in memory)."""
        self._pipeline.wait()

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
            for what in OPTIMIZER_STATE[:2] + (("master",) if self.layout.master_of(key, p) is not None else ()):
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
        """Plain tensors (read from the store), like torch.optim's state_dict, keyed by parameter name: each piece
        of state as the layout stores it (an 8-bit moment is its packed bytes: nothing is inflated, and a load
        into the same layout gives back the same bits), with ``"state_layout"`` naming the layout."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, what, k in self.state_tensors():
            state.setdefault(name, {"step": torch.tensor(self.steps[name])})[what] = self.store.read(k)
        return {"state": state, "param_groups": self.group_states(), "state_layout": self.layout.as_dict()}

    def decoded(self, name: str, what: str, stored: torch.Tensor, layout: StateLayout | None = None) -> torch.Tensor:
        """The values of one piece of ``name``'s state stored under ``layout`` (this optimizer's by default), as
        the fp32 layout holds them: fp32 moments, an fp32 master (a split one joined with the weight now in the
        model)."""
        layout = layout or self.layout
        key, p = self._item(name)
        shape, stride = (p.shape, dense_strides(p)) if key is None else self._param_layout(key)
        if what == "master":
            return stored if layout.master_of(key, p) == "fp32" else join_master(
                self.offloaded.read_param(name), stored)
        return decode_state(layout.moments_of(key, p, shape.numel()), stored, what == "exp_avg", shape, stride)

    def _item(self, name: str) -> tuple[str | None, torch.nn.Parameter]:
        for n, key, p in self._items:
            if n == name:
                return key, p
        raise KeyError(f"optimizer state for unknown parameter {name!r}")

    def load_state_dict(self, sd: dict[str, Any], *, convert: bool = False) -> None:
        """Load what :meth:`state_dict` gave. State saved under another layout (``"state_layout"``; the fp32
        one where it names none, as torch.optim's state dicts) is refused unless ``convert=True``, which decodes
        each piece and encodes it into this layout: converting to fewer bits rounds, a master the layout keeps
        none of (``master="none"``) is dropped, and one the saved state lacks is made from the weight."""
        self.wait()
        saved = StateLayout(**sd.get("state_layout", {}))
        if saved != self.layout and not convert:
            raise ValueError(f"this optimizer state was saved with {saved.describe()}, and this OffloadedAdamW "
                             f"stores {self.layout.describe()}: build it with the saved layout, or pass convert=True "
                             f"to convert the state (rounded where the new layout has fewer bits)")
        self.load_group_states(sd["param_groups"])
        names = {n for n, _, _ in self._items}
        unknown = [name for name in sd["state"] if name not in names]
        if unknown:
            raise KeyError(f"optimizer state for unknown parameter {unknown[0]!r}")
        # The whole state is replaced, as torch's is: a parameter with no saved state starts afresh.
        self.reset_state(names - set(sd["state"]))
        for name, entry in sd["state"].items():
            pieces = {what: v for what, v in entry.items() if what != "step"}
            if saved == self.layout:
                for what, value in pieces.items():
                    k = optimizer_key(name, what)
                    info = self.store.info(k)
                    if tuple(value.shape) != tuple(info["shape"]) or value.dtype != info["dtype"]:
                        raise ValueError(f"optimizer state {name}/{what} is {list(value.shape)} {value.dtype}, but "
                                         f"this optimizer stores {info['shape']} {info['dtype']}: wrong model")
                    t = self.store.get(k, Tier.HOST)
                    try:
                        t.copy_(value)
                        self.store.mark_dirty(k, Tier.HOST)
                    finally:
                        self.store.release(k, Tier.HOST)
            else:
                self.load_values(name, {what: self.decoded(name, what, v, saved) for what, v in pieces.items()})
            self.steps[name] = float(entry["step"])
            self._applied.pop(name, None)
        self.store.flush()

    def load_values(self, name: str, values: dict[str, torch.Tensor]) -> None:
        """Set one parameter's ``exp_avg``, ``exp_avg_sq`` and ``master`` from values of the fp32 layout
        (encoded into this one)."""
        key, p = self._item(name)
        shape, stride = (p.shape, dense_strides(p)) if key is None else self._param_layout(key)
        for what in ("exp_avg", "exp_avg_sq"):
            if what not in values:
                continue
            k = optimizer_key(name, what)
            t = self.store.get(k, Tier.HOST)
            try:
                encode_state(self.layout.moments_of(key, p, shape.numel()), values[what], t, what == "exp_avg",
                             stride)
                self.store.mark_dirty(k, Tier.HOST)
            finally:
                self.store.release(k, Tier.HOST)
        if self.layout.master_of(key, p) is not None:
            self._write_master(name, key, p, values.get("master"))

    def __repr__(self) -> str:
        groups = ", ".join(f"({len(g['params'])} params: " + ", ".join(f"{k}={g[k]}" for k in HYPER) + ")"
                           for g in self.param_groups)
        flag = {"single": "", "foreach": ", foreach=True", "fused": ", fused=True"}[self._pipeline.impl]
        return f"OffloadedAdamW({groups}{flag})"


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
                # A stored gradient is read and written one at a time (the kernel takes each tensor in turn).
                plain = [g for g in grads if store_key_of(g) is None]
                for batch in ([plain] if plain else []) + [[g] for g in grads if store_key_of(g) is not None]:
                    torch._amp_foreach_non_finite_check_and_unscale_(batch, found[device], inv_scale.to(device))
        return found
