"""The part of :class:`~tierstore.integrations.OffloadedAdamW` that reads and writes its state whole: torch's
``state_dict``/``load_state_dict`` (converting between state layouts), the parameter groups a checkpoint keeps, and
state made afresh or made again after a load. A base of the optimizer, over the same attributes."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tierstore import TierBudgetError, TierKeyError, TierStore, TierStoreError, TierValueError

from ._budget import HostBudget
from ._layouts import StateLayout
from ._optim_params import check_group_states, group_states
from ._optim_state import AdamWState


class StateDictIO:
    """What :class:`~tierstore.integrations.OffloadedAdamW` offers to save and load its state."""

    store: TierStore
    layout: StateLayout
    steps: dict[str, float]
    param_groups: list[dict[str, Any]]
    _state: AdamWState
    _items: list[tuple[str, str | None, torch.nn.Parameter]]
    _name_of: dict[int, str]
    _applied: dict[str, tuple[weakref.ref, int]]
    wait: Callable[[], None]  # the optimizer's: waits for its write-behind
    _removed = False  # its model's offload was removed (off.remove() or store.close()) and its state with it

    def _check_attached(self) -> None:
        if self._removed:
            raise TierStoreError("this OffloadedAdamW's model is no longer offloaded (off.remove(), or store.close(), "
                                 "which gives the model its values back), and its state went with it: make a new "
                                 "optimizer for the model (torch.optim.AdamW for a model no longer offloaded, or "
                                 "OffloadedAdamW after offload_model again)")

    def _resplit_truncated(self) -> None:
        """Split masters loaded as the first version stored them, made again as this version stores them."""
        self.wait()
        self._state.resplit_truncated()
        self.store.flush()

    def _remake_masters(self, names: list[str]) -> None:
        """The model loaded new values into these parameters: their fp32 masters are made from them, as this
        optimizer made them when it was created (a bf16 master left as it was would overwrite the loaded value
        at the next step)."""
        self.wait()
        self._state.remake_masters(names)

    def reset_state(self, names: list[str] | set[str]) -> None:
        """Start these parameters' state afresh, as a new optimizer would: zero moments, no step, masters made
        from the parameters' current values. What a load does for the parameters its saved state does not
        hold (torch's ``load_state_dict`` replaces the whole state: nothing of a later step may survive)."""
        self.wait()
        chosen = set(names)
        for name in chosen:
            self.steps.pop(name, None)
            self._applied.pop(name, None)
        self._state.reset(chosen)

    def state_tensors(self, steps: dict[str, float] | None = None) -> list[tuple[str, str, str]]:
        """(parameter name, state name, store key) of every state tensor of parameters stepped so far (or,
        given ``steps``, of those it names). Refused once its model's offload was removed (its state went with
        it): a checkpoint would hold none."""
        self._check_attached()
        return self._state.tensors(self.steps if steps is None else steps)

    def group_states(self) -> list[dict[str, Any]]:
        """Each parameter group's hyper-parameters (and what a scheduler added, such as ``initial_lr``), with
        ``"params"`` as parameter names: what state_dict() and checkpoints keep."""
        self._check_attached()
        return group_states(self.param_groups, self._name_of)

    def check_group_states(self, groups: Any) -> list[dict[str, Any]]:
        """``groups`` as :meth:`load_group_states` would apply them, checked without changing anything (see
        ``_optim_params.check_group_states``). Raises ValueError."""
        return check_group_states(groups, self.group_states())

    def load_group_states(self, groups: list[dict[str, Any]]) -> None:
        """Restore :meth:`group_states` (checked by :meth:`check_group_states` first)."""
        for target, saved in zip(self.param_groups, self.check_group_states(groups)):
            for k, v in saved.items():
                if k != "params":
                    target[k] = v

    def state_dict(self, *, beyond_host_budget: bool = False) -> dict[str, Any]:
        """Plain tensors (read from the store), like torch.optim's state_dict, keyed by parameter name: each piece
        of state as the layout stores it (an 8-bit moment is its packed bytes: nothing is inflated, and a load
        into the same layout gives back the same bits), with ``"state_layout"`` naming the layout.

        Every piece is read into memory at once, so a state larger than the store's host budget is refused (see
        [Note: A whole state dict beyond the host budget]) unless ``beyond_host_budget=True``."""
        tensors = self.state_tensors()  # refused for an optimizer whose model's offload was removed
        if not beyond_host_budget:
            self._check_state_fits([k for _, _, k in tensors])
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, what, k in tensors:
            state.setdefault(name, {"step": torch.tensor(self.steps[name])})[what] = self.store.read(k)
        return {"state": state, "param_groups": self.group_states(), "state_layout": self.layout.as_dict()}

    def _check_state_fits(self, keys: list[str]) -> None:
        """[Note: A whole state dict beyond the host budget] ``state_dict()`` returns every piece of state in
        memory at once: for a state larger than the host budget that is more RAM than the user gave the store,
        and for a 7B model more than the machine has. transformers' ``Trainer`` calls it at each checkpoint
        (``torch.save(optimizer.state_dict())``), so without ``stream_checkpoints(trainer)`` a run would peak at
        its first save or die there, with nothing said. So it raises instead, naming the streamed savers: the
        one line for ``Trainer``, ``save_checkpoint`` for a loop of one's own. A state within the budget is
        returned as torch returns it."""
        budget = HostBudget(self.store).total_bytes
        total = sum(self.store.info(k)["nbytes"] for k in keys)
        if total > budget:
            raise TierBudgetError(
                f"optimizer.state_dict() would read the whole optimizer state ({total / 2**20:.1f} MiB) into memory, "
                f"more than the store's host budget ({budget / 2**20:.1f} MiB). Save it one tensor at a time "
                f"instead: with transformers' Trainer, call tierstore.integrations.stream_checkpoints(trainer) "
                f"once after building it; in a loop of your own, "
                f"tierstore.integrations.save_checkpoint(path, model, optimizer). To read it all into memory "
                f"anyway, call state_dict(beyond_host_budget=True)")

    def decoded(self, name: str, what: str, stored: torch.Tensor, layout: StateLayout | None = None) -> torch.Tensor:
        """The values of one piece of ``name``'s state stored under ``layout`` (this optimizer's by default), as
        the fp32 layout holds them: fp32 moments, an fp32 master (a split one joined with the weight now in the
        model)."""
        return self._state.decoded(name, what, stored, layout)

    def load_state_dict(self, sd: dict[str, Any], *, convert: bool = False) -> None:
        """Load what :meth:`state_dict` gave. State saved under another layout (``"state_layout"``; the fp32
        one where it names none, as torch.optim's state dicts) is refused unless ``convert=True``, which decodes
        each piece and encodes it into this layout: converting to fewer bits rounds, a master the layout keeps
        none of (``master="none"``) is dropped, and one the saved state lacks is made from the weight."""
        self._check_attached()
        self.wait()
        saved = StateLayout.from_dict(sd.get("state_layout", {}))
        # split masters of the first version convert without loss: the same masters, weights rounded from them
        if saved != self.layout and not convert and saved != dataclasses.replace(self.layout, split="truncated"):
            raise TierValueError(f"this optimizer state was saved with {saved.describe()}, and this OffloadedAdamW "
                                 f"stores {self.layout.describe()}: build it with the saved layout, or pass "
                                 f"convert=True to convert the state (rounded where the new layout has fewer bits)")
        self.load_group_states(sd["param_groups"])
        names = {n for n, _, _ in self._items}
        unknown = [name for name in sd["state"] if name not in names]
        if unknown:
            raise TierKeyError(f"optimizer state for unknown parameter {unknown[0]!r}")
        # The whole state is replaced, as torch's is: a parameter with no saved state starts afresh.
        self.reset_state(names - set(sd["state"]))
        for name, entry in sd["state"].items():
            self._state.load(name, {what: v for what, v in entry.items() if what != "step"}, saved)
            self.steps[name] = float(entry["step"])
            self._applied.pop(name, None)
        self.store.flush()

    def load_values(self, name: str, values: dict[str, torch.Tensor]) -> None:
        """Set one parameter's ``exp_avg``, ``exp_avg_sq`` and ``master`` from values of the fp32 layout
        (encoded into this one)."""
        self._state.load_values(name, values)
