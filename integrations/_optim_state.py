"""An ``OffloadedAdamW``'s state in the store: made, read, loaded, reset, converted between layouts, dropped.

Each stepped parameter has ``exp_avg`` and ``exp_avg_sq`` and, for a bf16/fp16 weight, a master, each under
its own store key (``_contract.optimizer_key``), stored as the optimizer's :class:`~._layouts.StateLayout`
gives them (see [Note: Compressed optimizer state]). Nothing here steps: the update is ``_pipeline.py``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tierstore import Tier, TierKeyError, TierStore, TierValueError
from tierstore.memory import dense_strides
from tierstore.memory import TierPool
from tierstore.scheduling import LaterUses

from ._contract import OPTIMIZER_STATE, OffloadedParameters, moment_dtype, optimizer_key
from ._grads import grad_key
from ._layouts import StateLayout, decode_state, encode_state, join_master, split_master
from ._optim_params import Item
from ._pipeline import state_keys


class AdamWState:
    """The stored state of the parameters one optimizer steps (``items``), under ``layout``."""

    def __init__(self, offloaded: OffloadedParameters, layout: StateLayout, items: list[Item]) -> None:
        self.offloaded = offloaded
        self.store: TierStore = offloaded.store
        self.layout = layout
        self.items = items
        self._by_name = {name: (key, p) for name, key, p in items}
        self.use_keys: dict[str, tuple[str, ...]] = {}

    def attach(self, later: LaterUses) -> None:
        """Tell eviction when this state is used: right after its parameter's last use in a step (see [Note: Who
        uses a copy next]); ``use_keys`` lists every store key one update uses, built once (eviction asks for the
        queue's keys on each allocation). A gradient kept in the store (see [Note: Gradients in the tiers]) is used
        alike: the next backward adds to it, and the update reads it with the state."""
        self.use_keys = {name: tuple(dict.fromkeys((key, grad_key(key), *state_keys(name, key, p, self.layout))))
                         for name, key, p in self.items if key is not None}
        for name, key, p in self.items:
            if key is not None:
                later.grads[grad_key(key)] = key
                for k in state_keys(name, key, p, self.layout):
                    if k != key:
                        later.after[k] = key

    # ---- shapes and sizes ------------------------------------------------------------------
    def item(self, name: str) -> tuple[str | None, nn.Parameter]:
        """(store key or None, parameter) of a parameter this optimizer steps."""
        if name not in self._by_name:
            raise TierKeyError(f"optimizer state for unknown parameter {name!r}")
        return self._by_name[name]

    def param_layout(self, key: str | None, p: nn.Parameter) -> tuple[torch.Size, tuple[int, ...] | None]:
        """The parameter's shape as stepped (a stored one's, or this rank's shard's), and its strides where it
        is not contiguous."""
        if key is None:
            return p.shape, dense_strides(p)
        info = self.store.info(key)
        return torch.Size(info["shape"]), info["stride"]

    def pieces(self, key: str | None, p: nn.Parameter) -> list[int]:
        """Bytes of each stored piece of this parameter's optimizer state under the layout."""
        numel = self.param_layout(key, p)[0].numel()
        return self.layout.piece_bytes(key, p, numel, moment_dtype(key, p))

    def nbytes(self, key: str | None, p: nn.Parameter) -> int:
        return sum(self.pieces(key, p))

    def check_host_budget(self, host_budget: int, step_in_backward: bool, *, speculate: bool = False) -> None:
        """Refuse a host budget below what one update needs at once (see ``host_shortfall``), before any state
        exists."""
        short = self.host_shortfall(host_budget, step_in_backward, speculate=speculate)
        if short is not None:
            raise TierValueError(short)

    def host_shortfall(self, host_budget: int, step_in_backward: bool, *, speculate: bool = False) -> str | None:
        """One update holds its parameter's fp32 master and both moments in the host tier at once (stepping in
        backward or speculating there, beside what backward holds there; with its gradient but stepping in
        backward): a budget below that for the largest parameter could never step it, or only by luck. What to
        say then, or None where the budget holds it."""
        in_backward = step_in_backward or speculate
        def one_update(name: str, key: str | None, p: nn.Parameter) -> int:
            numel = self.param_layout(key, p)[0].numel()
            n = numel * moment_dtype(key, p).itemsize
            if self.layout.is_plain(key, p, numel):
                # after backward, an offloaded parameter's gradient is held too (see [Note: Gradients in the tiers])
                return TierPool.capacity_for(n) * (2 if key is None else 3 if step_in_backward else 4)
            # the stored state and the weight it steps; a kept gradient after backward
            return (sum(TierPool.capacity_for(b) for b in self.pieces(key, p))
                    + TierPool.capacity_for(numel * p.dtype.itemsize)
                    + (0 if step_in_backward else TierPool.capacity_for(n)))

        # name -> what backward may hold in the host tier while it is updated
        beside = self.offloaded.held_beside_updates() if in_backward else {}
        need, name = max(((one_update(n, k, p) + beside.get(n, 0), n) for n, k, p in self.items), default=(0, ""))
        if need <= host_budget:
            return None
        what = "its master weight and two moments" + ("" if step_in_backward else ", and its gradient")
        if beside.get(name):
            what += f", beside the largest unit backward may hold meanwhile ({beside[name]} bytes)"
        return (f"host_budget_bytes={host_budget} ({host_budget / 2**20:.1f} MiB) is below what one AdamW update of "
                f"{name!r} needs at once: {need} bytes ({need / 2**20:.1f} MiB) for {what}. Raise host_budget_bytes to "
                f"at least that (a few times more lets the optimizer read ahead)")

    # ---- made, reset and dropped ---------------------------------------------------------------
    def create(self, home: Tier) -> dict[str, int]:
        """Zero moments and masters from the weights, for every parameter, in the store (all or nothing);
        returns name -> the stored bytes of its state and weight."""
        if home is Tier.NVME:  # room for every moment (and master) is checked before the first is written
            self.store.require_nvme_room(sum(self.nbytes(key, p) for _, key, p in self.items),
                                         "AdamW state of {size}")
        handles: list[Any] = []
        try:
            for name, key, p in self.items:
                # In the parameter's layout, as torch's AdamW makes them (zeros_like): see [Note: The fused
                # kernel and layouts].
                shape, stride = self.param_layout(key, p)
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
        return {name: sum(self.store.info(k)["nbytes"] for k in state_keys(name, key, p, self.layout))
                for name, key, p in self.items}

    def reset(self, names: set[str]) -> None:
        """Zero moments and masters made from the weights now, for these parameters."""
        for name, key, p in self.items:
            if name in names:
                for what in ("exp_avg", "exp_avg_sq"):
                    self._write(optimizer_key(name, what), lambda t: t.zero_())
        self.remake_masters(names)

    def remake_masters(self, names: set[str] | list[str]) -> None:
        """The masters of these parameters made from their weights' values now."""
        chosen = set(names)
        for name, key, p in self.items:
            if name in chosen and self.layout.master_of(key, p) is not None:
                self.write_master(name, key, p, None)

    def resplit_truncated(self) -> None:
        """Split masters stored as the first version stored them (the weight their top half: [Note: A rounded
        split]) made again as this layout stores them: the same masters, the weights rounded from them."""
        for name, key, p in self.items:
            if self.layout.master_of(key, p) == "split":
                assert key is not None
                self._write(optimizer_key(name, "master"), lambda held, name=name, key=key: self._split_into(
                    key, join_master(self.offloaded.read_param(name), held, split="truncated"), held))

    def drop(self) -> None:
        """Every piece of state leaves the store."""
        for name, key, p in self.items:
            for k in state_keys(name, key, p, self.layout):
                if k != key and self.store.contains(k):
                    self.store.drop(k)
        self.items, self._by_name = [], {}

    def _write(self, k: str, fill: Any) -> None:
        """``fill(t)`` on the host copy of store key ``k``, marked changed."""
        t = self.store.get(k, Tier.HOST)
        try:
            fill(t)
            self.store.mark_dirty(k, Tier.HOST)
        finally:
            self.store.release(k, Tier.HOST)

    def write_master(self, name: str, key: str | None, p: nn.Parameter, value: torch.Tensor | None) -> None:
        """Set a parameter's master to ``value`` (fp32), or to its weight's value (None). Under
        ``master="split"`` a value sets the weight too: it is the master rounded to bf16."""
        how = self.layout.master_of(key, p)
        if how == "fp32":
            self._write(optimizer_key(name, "master"),
                        lambda held: held.copy_(self.offloaded.read_param(name) if value is None else value))
        elif value is None:
            self._write(optimizer_key(name, "master"), lambda held: held.zero_())  # the weight's own value: low 0
        else:
            assert key is not None
            self._write(optimizer_key(name, "master"), lambda held: self._split_into(key, value, held))

    def _split_into(self, key: str, value: torch.Tensor, low: torch.Tensor) -> None:
        """Write fp32 ``value`` as the weight (rounded to bf16) and ``low`` (its low half)."""
        weight = self.store.get(key, Tier.HOST)
        try:
            self.store.writing(key).wait()  # its last write reads it
            master = torch.empty_like(weight, dtype=torch.float32).copy_(value)
            split_master(master, weight, low)
            self.store.mark_dirty(key, Tier.HOST)
        finally:
            self.store.release(key, Tier.HOST)
        self.store.write_back(key)

    # ---- read and loaded -----------------------------------------------------------------------
    def tensors(self, stepped: dict[str, float]) -> list[tuple[str, str, str]]:
        """(parameter name, state name, store key) of every state tensor of the parameters ``stepped`` names."""
        out = []
        for name, key, p in self.items:
            if name in stepped:
                for what in OPTIMIZER_STATE[:2] + (("master",) if self.layout.master_of(key, p) is not None else ()):
                    out.append((name, what, optimizer_key(name, what)))
        return out

    def decoded(self, name: str, what: str, stored: torch.Tensor, layout: StateLayout | None = None) -> torch.Tensor:
        """The values of one piece of ``name``'s state stored under ``layout`` (this one by default), as the fp32
        layout holds them: fp32 moments, an fp32 master (a split one joined with the weight now in the model)."""
        layout = layout or self.layout
        key, p = self.item(name)
        shape, stride = self.param_layout(key, p)
        if what == "master":
            return stored if layout.master_of(key, p) == "fp32" else join_master(
                self.offloaded.read_param(name), stored, split=layout.split)
        return decode_state(layout.moments_of(key, p, shape.numel()), stored, what == "exp_avg", shape, stride)

    def load(self, name: str, pieces: dict[str, torch.Tensor], saved: StateLayout | None) -> None:
        """Pieces of ``name``'s state from a state dict saved under layout ``saved``: each kind (the moments, the
        master) copied in where ``saved`` stores it as this layout does, else converted (a split master joined
        with the weight now in the model). Where the state dict named no layout (``saved`` None), each piece is
        copied where it has the dtype and shape this optimizer stores, else taken for torch's fp32 values."""
        if saved is None:
            copied = {what: v for what, v in pieces.items() if self._stored_as(name, what, v)}
            saved = StateLayout.from_dict({})
        else:
            same = {"master": (saved.master, saved.split) == (self.layout.master, self.layout.split),
                    "moments": saved.moments == self.layout.moments}
            copied = {what: v for what, v in pieces.items() if same["master" if what == "master" else "moments"]}
        converted = {what: self.decoded(name, what, v, saved) for what, v in pieces.items() if what not in copied}
        for what, value in copied.items():
            if not self._stored_as(name, what, value):
                info = self.store.info(optimizer_key(name, what))
                raise TierValueError(f"optimizer state {name}/{what} is {list(value.shape)} {value.dtype}, but "
                                     f"this optimizer stores {info['shape']} {info['dtype']}: wrong model")
            self._write(optimizer_key(name, what), lambda t, value=value: t.copy_(value))
        if converted:
            self.load_values(name, converted, master="master" not in copied)

    def _stored_as(self, name: str, what: str, value: Any) -> bool:
        """Whether ``value`` has the dtype and shape this optimizer stores ``name``'s ``what`` in."""
        info = self.store.info(optimizer_key(name, what))
        return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(info["shape"]) and \
            value.dtype == info["dtype"]

    def load_values(self, name: str, values: dict[str, torch.Tensor], *, master: bool = True) -> None:
        """Set one parameter's ``exp_avg``, ``exp_avg_sq`` and (with ``master``) ``master`` from values of the fp32
        layout (encoded into this one); a master not given is made from the weight."""
        key, p = self.item(name)
        shape, stride = self.param_layout(key, p)
        for what in ("exp_avg", "exp_avg_sq"):
            if what in values:
                how = self.layout.moments_of(key, p, shape.numel())
                self._write(optimizer_key(name, what),
                            lambda t, what=what: encode_state(how, values[what], t, what == "exp_avg", stride))
        if master and self.layout.master_of(key, p) is not None:
            self.write_master(name, key, p, values.get("master"))


__all__ = ["AdamWState"]
