"""The host tier's budget, read here and nowhere else in the integrations, and how it is shared.

[Note: Splitting the host budget] The store keeps every tier within its budget (a request beyond it waits for
room or fails); what shares the host tier is decided here, from what each user declares:

- the placement (``_placing.Placer``): what stays in the host tier for the whole run, planned within the
  budget less what other models' placements keep, and the room left for copies in flight (``room_bytes``: the
  units computing and read ahead, the largest update, and what consumers hold beside the units: gradients queued
  for an update stepping in backward, their ``held_host_bytes()``);
- the optimizer's read-ahead: half the placement's room where there is one (``Placer.readahead_room``), else
  half of the budget (measured: half beat a quarter and 16 parameters by 5-9% a step on ViT-large), unless the
  optimizer is given ``readahead_bytes``;
- the gradient backlog of an update stepping in backward: a quarter of the budget unless given;
- a whole state dict (``model.state_dict()``, ``optimizer.state_dict()``) in ordinary memory: at most the
  budget; a larger one is read into copies mapped from files (see [Note: A whole state dict beyond the host
  budget]);
- a unit's parameters must fit the budget of the tier they compute in.

``HostBudget.split()`` gives the shares as they stand (``off.host_budget_split()``; the demo prints it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from tierstore import Tier, TierStore

from .policies import default_grad_backlog_bytes


class HostBudget:
    """The host budget of one store and the shares of it (see [Note: Splitting the host budget])."""

    def __init__(self, store: TierStore) -> None:
        self._store = store
        self.total_bytes = store.config.host_budget_bytes
        self.device_bytes = store.config.device_budget_bytes

    def compute_tier_bytes(self, tier: Tier) -> int:
        """The budget of the tier a unit computes in: what one unit's parameters must fit."""
        return self.device_bytes if tier is Tier.DEVICE else self.total_bytes

    def readahead_bytes(self, placement_room: int | None) -> int:
        """What an optimizer's reads ahead may fill by default: ``placement_room`` (what the placement leaves them),
        else half the budget."""
        return placement_room or max(1, self.total_bytes // 2)

    def grad_backlog_bytes(self) -> int:
        """An update stepping or speculated in backward may have this many bytes of gradients queued by default: a
        quarter (see ``default_grad_backlog_bytes``)."""
        return default_grad_backlog_bytes(self.total_bytes)

    def state_dict_reader(self, keys: Iterable[str]) -> Callable[[str], torch.Tensor]:
        """How a whole state dict of these store keys reads each: into an ordinary copy where all of them fit the
        budget, else into a mapped one (``store.read_mapped``)."""
        total = sum(self._store.info(k)["nbytes"] for k in keys)
        return self._store.read if total <= self.total_bytes else self._store.read_mapped

    def split(self, *, kept_bytes: int, room_bytes: int | None, held_beside_bytes: int) -> dict[str, int | None]:
        """The shares as they stand, by name: the budget, what the placement keeps all run, the room for copies
        in flight (None before a placement) and what consumers hold beside the units."""
        return {"host_budget_bytes": self.total_bytes, "kept_all_run_bytes": kept_bytes,
                "room_in_flight_bytes": room_bytes, "held_beside_units_bytes": held_beside_bytes}


__all__ = ["HostBudget"]
