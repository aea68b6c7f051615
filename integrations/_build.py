"""Building an ``OffloadedModel``: its parameters given to the store, a meta model materialized on the way.

See [Note: Building on the meta device] (``_meta.py``) for how a model built on the meta device is given
memory one module at a time; here each parameter goes to the store as its module is done, so the whole model
never exists in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tierstore import Tier, TierStore, TierValueError
from tierstore.memory import dense_strides

from ._meta import materialize, putting
from ._param import StoredParam


@dataclass
class ParamBuilder:
    """What building an offload's parameters uses, and what it fills: the store, the parameters' home tier and
    the prefix of their store keys, how a parameter's record is made (``record(name, key, param, nbytes)``), the
    size under which a parameter stays resident; the records made (``params``: id(parameter) -> its
    ``StoredParam``; ``resident``: name -> the parameters kept in memory, their ids in ``resident_ids``), which
    the front owns once it is built."""

    store: TierStore
    home: Tier
    prefix: str
    record: Callable[[str, str, nn.Parameter, int], StoredParam]
    threshold: int
    params: dict[int, StoredParam] = field(default_factory=dict)
    resident: dict[str, nn.Parameter] = field(default_factory=dict)
    resident_ids: set[int] = field(default_factory=set)

    def check_names_free(self, offloaded: dict[int, tuple[str, int]]) -> None:
        """Refuse a model whose parameter names another model already keeps in the store."""
        taken = [name for name, _ in offloaded.values() if f"{self.prefix}{name}" in self.store]
        if taken:
            raise TierValueError(
                f"the store already holds an offloaded parameter named {taken[0]!r} ({len(taken)} of this model's "
                f"names are taken): a store keeps a model's parameters and optimizer state under their names, so "
                f"another model offloaded into it must not share them. Give each model its own TierStore, or "
                f"call .remove() on the other model's offload first")

    def room_for(self, offloaded: dict[int, tuple[str, int]]) -> None:
        """With the drive as the parameters' home, check its room for them before anything is written."""
        if self.home is Tier.NVME:
            self.store.require_nvme_room(sum(nbytes for _, nbytes in offloaded.values()),
                                         "offloading {size} of parameters")

    def put_parameters(self, model: nn.Module, meta: bool, init_fn: Callable[[nn.Module], None] | None,
                       real_parameters: str | None) -> None:
        """Give every parameter of ``model`` of ``threshold`` bytes or more to the store (the rest stay resident),
        materializing a meta model module by module; all or nothing (see ``_meta.putting``)."""
        with putting(self.store, self.params) as (handles, undo):
            if meta:  # materialized module by module: one module's tensors in memory at a time
                done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
                for mname, module in model.named_modules():
                    materialize(module, init_fn, done, undo, mname=mname,
                                initialize_real=real_parameters == "initialize")
                    for pname, p in module._parameters.items():
                        name = f"{mname}.{pname}" if mname else pname
                        if p is not None and id(p) not in self.params and id(p) not in self.resident_ids:
                            self._put(name, p, handles, wait=True)
            else:
                for name, p in model.named_parameters():
                    self._put(name, p, handles, wait=False)

    def _put(self, name: str, p: nn.Parameter, handles: list[Any], *, wait: bool) -> None:
        """Give ``p``'s bytes to the store (or keep it resident when small)."""
        nbytes = p.numel() * p.element_size()
        if nbytes < self.threshold:
            self.resident[name] = p
            self.resident_ids.add(id(p))
            return
        value = p.detach()
        key = f"{self.prefix}{name}"
        handles.append(self.store.put(key, value if dense_strides(value) else value.contiguous(), home=self.home))
        sp = self.params[id(p)] = self.record(name, key, p, nbytes)
        if wait:  # its memory goes now
            handles[-1].wait()
            sp.param.data = sp.placeholder


def to_compute_device(model: nn.Module, resident: Iterable[nn.Parameter], device: torch.device) -> None:
    """What stays in memory (parameters under the threshold, buffers) computes beside the fetched parameters,
    so it goes to their device: a model built on the CPU (or on meta) then runs on the GPU."""
    if device.type == "cpu":
        return
    with torch.no_grad():
        for p in resident:
            if p.device != device:
                p.data = p.data.to(device)
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and b.device != device:
                    module._buffers[name] = b.to(device)
