"""The part of :class:`~tierstore.integrations.OffloadedAdamW` that reads and writes its state whole: torch's
``state_dict``/``load_state_dict`` (converting between state layouts), ``opt.state`` as torch's optimizers have it,
the parameter groups a checkpoint keeps, and state made afresh or made again after a load. A base of the optimizer,
over the same attributes.

[Note: A whole state dict beyond the host budget] ``model.state_dict()`` and ``optimizer.state_dict()`` return
every tensor at once, and the savers users call walk them whole: ``torch.save`` (transformers' ``Trainer``,
Accelerate's ``save_state``, Lightning's checkpoints), torch.distributed.checkpoint's writer. For a state larger
than the host budget, ordinary copies would be more RAM than the user gave the store, and for a 7B model more
than the machine has. So such a state dict holds copies mapped from private files on the drive (the store's
``read_mapped``, [Note: Tensors mapped from a file]), written one tensor at a time through the host tier: the
saver reads each from the page cache, and the kernel drops their pages when memory is short, so what cannot be
dropped (the anonymous memory) stays within the budget however large the state. Each costs a write and a read
of the drive beyond the saver's own; ``save_checkpoint`` (and ``stream_checkpoints(trainer)``) write each tensor
straight from the store instead. A load writes each tensor it is given into the store, whatever memory holds it.

[Note: Optimizer state of shards] Under FSDP2 (``offload_fsdp``) each rank steps its shards, and its state is the
state of those shards. torch's AdamW keeps it as DTensors placed as the parameters are, and
torch.distributed.checkpoint saves each such piece as the shards of one tensor; a plain tensor it would take for
a copy of one tensor that every rank holds and keep one rank's. So ``state_dict()`` gives each piece of a shard's
state as a DTensor: a piece of the parameter's local shape (fp32 or bf16 moments, an fp32 master, a split master's
low half) placed as its parameter. An 8-bit moment's packed bytes have no such shape, and a rank whose shard has
fewer than ``MIN_COMPRESSED`` values keeps fp32 moments where another packs them; so where any rank packs a
parameter's moments (each rank knows every rank's shard from the global shape: FSDP2 chunks dim 0), each rank's
moment is its stored bytes as its own row of a (ranks, most bytes) uint8 DTensor, which a load cuts back to what
it stores. Decoding them to fp32 instead would not give back the same codes (a block whose largest value is
negative has no code for -1, so its scale comes back smaller). A split master's low half (int16, which neither
gloo nor NCCL gathers, as DCP's full state dicts do) is given as a bf16 view of its bits, taken back as int16 where
that is what is stored. Only a parameter sharded otherwise than on dim 0
with packed moments gives torch's fp32 values, and a load encodes them again without ``convert=True`` (rounded).
Masters are copied as they are saved, never joined with the weight in the model, which DCP loads after them.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

from tierstore import TierKeyError, TierStore, TierStoreError, TierTypeError, TierValueError
from tierstore.memory import give_back_pages

from ._budget import HostBudget
from ._contract import moment_dtype, optimizer_key
from ._fsdp_internals import dim0_shards, is_dtensor, local_shard, rows_of_ranks, shard_like
from ._layouts import StateLayout
from ._optim_params import check_group_states, group_states
from ._optim_state import AdamWState


class ParamStateView(MutableMapping):
    """One parameter's entry in ``opt.state``: ``step`` and each piece of its state, read from the store when
    asked for (an ordinary copy of one tensor), as the layout stores it (see :meth:`StateDictIO.state_dict`).

    Setting a piece to the very tensor this entry gave for it changes nothing (what moving a state to its device
    does, as Lightning does at the start and end of ``fit``); any other value is refused."""

    def __init__(self, opt: StateDictIO, name: str) -> None:
        self._opt, self._name = opt, name
        self._given: dict[str, weakref.ref] = {}

    def _keys(self) -> dict[str, str | None]:
        return {"step": None, **{what: k for _, what, k in self._opt.state_tensors({self._name: 0.0})}}

    def __getitem__(self, what: str) -> torch.Tensor:
        k = self._keys()[what]  # KeyError for a piece it does not have, as a dict
        self._opt.updates_done()  # its step count too
        t = torch.tensor(self._opt.steps.get(self._name, 0.0)) if k is None else self._opt.store.read(k)
        self._given[what] = weakref.ref(t)
        return t

    def __setitem__(self, what: str, value: Any) -> None:
        given = self._given.get(what)
        if given is not None and given() is value:
            return
        raise TierTypeError(f"opt.state of an OffloadedAdamW is read from the store, and {self._name!r}'s "
                            f"{what!r} cannot be set in it: load a whole state with opt.load_state_dict()")

    def __delitem__(self, what: str) -> None:
        raise TierTypeError(f"opt.state of an OffloadedAdamW is read from the store: {self._name!r}'s {what!r} "
                            f"cannot be deleted from it")

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __repr__(self) -> str:
        return f"<state of {self._name!r} in the store: {', '.join(self._keys())}>"


class StateView(Mapping):
    """``opt.state`` of an :class:`~tierstore.integrations.OffloadedAdamW`: parameter -> its state, as torch's
    optimizers key it, for every parameter the optimizer steps, from its creation (zero moments, ``step`` 0), so
    that code which takes an empty state for one never stepped does not step it to make one
    (torch.distributed.checkpoint's ``get_state_dict`` does). Nothing is read until a value is asked for, one
    tensor at a time; read-only (``opt.load_state_dict()`` writes a state)."""

    def __init__(self, opt: StateDictIO) -> None:
        self._opt = opt

    def _params(self) -> dict[int, tuple[torch.nn.Parameter, str]]:
        return {} if self._opt._removed else {id(p): (p, name) for name, _, p in self._opt._items}

    def __getitem__(self, p: torch.Tensor) -> ParamStateView:
        found = self._params().get(id(p))
        if found is None or found[0] is not p:
            raise TierKeyError("not a parameter this OffloadedAdamW steps (opt.state is keyed by the parameters of "
                               "opt.param_groups)")
        return ParamStateView(self._opt, found[1])

    def __iter__(self) -> Iterator[torch.nn.Parameter]:
        return (p for p, _ in self._params().values())

    def __len__(self) -> int:
        return len(self._params())

    def __repr__(self) -> str:
        return f"<OffloadedAdamW state of {len(self)} parameters, in the store>"


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
    # masters load_state_dict() loaded since the last step, whose weights a model load may bring after them
    _masters_loaded: frozenset[str] = frozenset()

    def updates_done(self) -> None:
        """Wait for the updates the last step queued to run beside the next forward (see [Note: Updates streamed
        into the next forward]): a whole state read now sees none half-applied."""

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
        at the next step). Not those whose masters :meth:`load_state_dict` loaded since the last step: their
        weights are arriving after them (torch.distributed.checkpoint's ``set_state_dict`` loads the
        optimizer's state first), and a split master's low half is kept only beside the weight it was saved
        with."""
        self.wait()
        pending = self._masters_loaded
        self._masters_loaded = pending - set(names)
        self._state.remake_masters([n for n in names if n not in pending])

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

    def state_tensors(self, steps: dict[str, float] | None = None, *,
                      all_params: bool = False) -> list[tuple[str, str, str]]:
        """(parameter name, state name, store key) of every state tensor of parameters stepped so far (or,
        given ``steps``, of those it names; with ``all_params``, of every parameter it steps). Refused once its
        model's offload was removed (its state went with it): a checkpoint would hold none."""
        self._check_attached()
        self.updates_done()
        if all_params:
            steps = {name: 0.0 for name, _, _ in self._items}
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

    def _index_names(self) -> list[str]:
        """The names of the parameters in torch's numbering: those of ``param_groups``, one group after another."""
        return [self._name_of[id(p)] for g in self.param_groups for p in g["params"]]

    def state_dict(self, *, beyond_host_budget: bool = False) -> dict[str, Any]:
        """The state as torch.optim's ``state_dict()`` gives it: ``"state"`` keyed by each parameter's index (the
        parameters of ``param_groups`` counted one group after another), ``"param_groups"`` with those indices as
        ``"params"`` and the parameters' names as ``"param_names"``, and ``"state_layout"`` naming the layout.
        Each piece of state is as the layout stores it (an 8-bit moment is its packed bytes: nothing is inflated,
        and a load into the same layout gives back the same bits). Every parameter this optimizer steps has an
        entry from its creation (zero moments, ``step`` 0), as ``opt.state`` has.

        A state within the store's host budget is read into ordinary memory. A larger one is read one tensor at
        a time into copies mapped from files on the drive (see [Note: A whole state dict beyond the host
        budget]), which a saver (``torch.save``, torch.distributed.checkpoint) walks with no more than the host
        budget of ordinary memory; ``beyond_host_budget=True`` reads it into ordinary memory all the same."""
        tensors = self.state_tensors(all_params=True)  # refused for an optimizer whose model's offload was removed
        read = self.store.read if beyond_host_budget else HostBudget(self.store).state_dict_reader(
            k for _, _, k in tensors)
        index = {name: i for i, name in enumerate(self._index_names())}
        shards = {name: p for name, _, p in self._items if is_dtensor(p)}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, what, k in tensors:
            entry = state.setdefault(index[name], {"step": torch.tensor(self.steps.get(name, 0.0))})
            entry[what] = read(k)
            if name in shards:  # see [Note: Optimizer state of shards]
                entry[what] = self._as_shard(name, what, entry[what], shards[name], mapped=read != self.store.read)
        groups = [{**g, "params": [index[n] for n in g["params"]], "param_names": g["params"]}
                  for g in self.group_states()]
        return {"state": state, "param_groups": groups, "state_layout": self.layout.as_dict()}

    def _as_shard(self, name: str, what: str, piece: torch.Tensor, param: torch.Tensor, *,
                  mapped: bool) -> torch.Tensor:
        """A piece of a sharded parameter's state as a DTensor (see [Note: Optimizer state of shards]); a piece
        made here is mapped from a file where ``mapped`` says the pieces are."""
        sizes = None if what == "master" else self._moment_bytes_of_ranks(name, param)
        key = self._state.item(name)[0]
        # packed on some rank: each rank's bytes its own row
        if sizes is not None and any(self.layout.moments_of(key, param, n) == "8bit" for n in sizes[1]):
            row = torch.zeros(1, max(sizes[0]), dtype=torch.uint8)
            row[0, :piece.numel() * piece.element_size()] = piece.reshape(-1).view(torch.uint8)
            return rows_of_ranks(param, self.store.mapped(row) if mapped else row)
        if tuple(piece.shape) != tuple(local_shard(param).shape):  # packed, sharded otherwise than on dim 0
            piece = self.decoded(name, what, piece)  # torch's fp32 values
            piece = self.store.mapped(piece) if mapped else piece
        # A split master's low half (int16, which neither gloo nor NCCL gathers: DCP's full_state_dict) as its bits.
        return shard_like(param, piece.view(torch.bfloat16) if piece.dtype == torch.int16 else piece)

    def _moment_bytes_of_ranks(self, name: str, param: torch.Tensor) -> tuple[list[int], list[int]] | None:
        """(bytes of a moment, values of the shard) of each rank's shard of ``param``, sharded on dim 0 as FSDP2
        shards (a rank's rows as ``torch.chunk`` gives them); None where it is sharded otherwise."""
        shards = dim0_shards(param)
        if shards is None:
            return None
        ranks, _, rows = shards
        per_row = param.numel() // param.shape[0] if param.shape[0] else 0
        key = self._state.item(name)[0]
        numels = [max(0, min(rows, param.shape[0] - r * rows)) * per_row for r in range(ranks)]
        return [self.layout.piece_bytes(key, param, n, moment_dtype(key, param))[0] for n in numels], numels

    def _from_shard(self, name: str, what: str, value: torch.Tensor) -> torch.Tensor:
        """The local piece of a shard's state :meth:`_as_shard` gave (from its row of bytes, the bytes this rank
        stores, as it stores them); a value that is no DTensor as it is."""
        if not is_dtensor(value):
            return value
        local = value.to_local()
        k = optimizer_key(name, what)
        if not self.store.contains(k):
            return local
        info = self.store.info(k)
        if (tuple(local.shape), local.dtype) == (tuple(info["shape"]), info["dtype"]):
            return local
        if local.dtype == torch.uint8 and local.dim() == 2 and local.shape[0] == 1 and \
                local.shape[1] >= info["nbytes"]:
            return local[0, :info["nbytes"]].view(info["dtype"]).view(info["shape"])
        if (local.dtype, info["dtype"]) == (torch.bfloat16, torch.int16) and tuple(local.shape) == tuple(info["shape"]):
            return local.view(torch.int16)  # a low half's bits
        return local

    def decoded(self, name: str, what: str, stored: torch.Tensor, layout: StateLayout | None = None) -> torch.Tensor:
        """The values of one piece of ``name``'s state stored under ``layout`` (this optimizer's by default), as
        the fp32 layout holds them: fp32 moments, an fp32 master (a split one joined with the weight now in the
        model)."""
        return self._state.decoded(name, what, stored, layout)

    def load_state_dict(self, state_dict: dict[str, Any], *, convert: bool = False) -> None:
        """Load what :meth:`state_dict` gave, or a dict of the same form keyed by parameter name (as earlier
        versions gave, and as torch.distributed.checkpoint passes it). Parameters given by index are matched to
        this optimizer's by their ``"param_names"`` where the dict has them, else by their place in the groups,
        as torch's optimizers match them. An entry whose ``step`` is 0 starts afresh; a parameter with no entry
        too, as torch replaces the whole state.

        State saved under another layout (``"state_layout"``; where the dict names none, for the moments and for
        the masters apart, this optimizer's where every such piece has the dtype and shape it stores, else the
        fp32 one, as torch.optim's) is refused unless ``convert=True``, which decodes each piece and encodes it
        into this layout: converting to fewer bits rounds, a master the layout keeps none of (``master="none"``)
        is dropped, and one the saved state lacks is made from the weight. Where the dict names no layout, each
        piece with the dtype and shape this optimizer stores is copied as it is. Pieces given as DTensors (a
        sharded state dict: see [Note: Optimizer state of shards]) load as their local tensors."""
        self._check_attached()
        self.wait()
        groups, state = self._by_name(state_dict)
        state = {name: {what: self._from_shard(name, what, v) for what, v in entry.items()}
                 for name, entry in state.items()}  # a shard's pieces (see [Note: Optimizer state of shards])
        saved = self._saved_layout(state_dict, state)
        # Split masters of the first version convert without loss: the same masters, weights rounded from them; and
        # moments a sharded state dict gave decoded encode again into what they were.
        if saved != self.layout and not convert and saved not in (
                dataclasses.replace(self.layout, split="truncated"),
                *([dataclasses.replace(self.layout, moments="fp32")] if self._sharded() else [])):
            raise TierValueError(f"this optimizer state was saved with {saved.describe()}, and this OffloadedAdamW "
                                 f"stores {self.layout.describe()}: build it with the saved layout, or pass "
                                 f"convert=True to convert the state (rounded where the new layout has fewer bits)")
        self.load_group_states(groups)
        names = {n for n, _, _ in self._items}
        unknown = [name for name in state if name not in names]
        if unknown:
            raise TierKeyError(f"optimizer state for unknown parameter {unknown[0]!r}")
        # The whole state is replaced, as torch's is: a parameter with no saved state, or none stepped, starts afresh.
        stepped = {name: entry for name, entry in state.items() if float(entry["step"]) != 0}
        self.reset_state(names - set(stepped))
        for name, entry in stepped.items():
            self._state.load(name, {what: v for what, v in entry.items() if what != "step"},
                             saved if "state_layout" in state_dict else None)
            give_back_pages(list(entry.values()))  # in the store now: see [Note: Loaded pages given back]
            self.steps[name] = float(entry["step"])
            self._applied.pop(name, None)
        self._masters_loaded = frozenset(name for name, entry in stepped.items() if "master" in entry)
        self.store.flush()

    def _by_name(self, sd: Any) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        """The parameter groups and the state of ``sd`` with parameters named, not numbered."""
        if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or not isinstance(
                sd.get("param_groups"), list) or not all(isinstance(g, dict) for g in sd["param_groups"]):
            raise TierValueError("an optimizer state dict has a 'state' dict and a 'param_groups' list of dicts "
                                 "(what opt.state_dict() gives)")
        groups = [{k: v for k, v in g.items() if k != "param_names"} for g in sd["param_groups"]]
        numbered = [i for g in groups for i in g.get("params", ()) if not isinstance(i, str)]
        if not numbered:
            return groups, sd["state"]
        mine = self.group_states()
        saved_sizes = [len(g.get("params", [])) for g in sd["param_groups"]]
        if saved_sizes != [len(g["params"]) for g in mine]:
            raise TierValueError(f"the saved parameter groups ({saved_sizes} parameters) do not hold the same "
                                 f"parameters as this optimizer's ({[len(g['params']) for g in mine]}): build it with "
                                 f"the param_groups it was saved with")
        name_of: dict[Any, str] = {}
        for saved, current in zip(sd["param_groups"], mine):
            names = saved.get("param_names", current["params"])  # by place where the dict names none, as torch
            if sorted(names) != sorted(current["params"]):
                extra = sorted(set(names) - set(current["params"]))
                lacking = sorted(set(current["params"]) - set(names))
                raise TierValueError(f"the saved parameter group holds {extra[:3]} where this optimizer's holds "
                                     f"{lacking[:3]}: build it with the param_groups it was saved with")
            name_of.update(zip(saved["params"], names))
        missing = [i for i in sd["state"] if i not in name_of]
        if missing:
            raise TierKeyError(f"optimizer state for parameter {missing[0]!r}, which no parameter group holds")
        for g in groups:
            g["params"] = [name_of[i] for i in g.get("params", ())]
        return groups, {name_of[i]: entry for i, entry in sd["state"].items()}

    def _saved_layout(self, sd: dict[str, Any], state: dict[str, dict[str, Any]]) -> StateLayout:
        """The layout ``sd`` was saved with: the one it names; where it names none (torch.distributed.checkpoint
        keeps only ``state`` and ``param_groups``), for the moments and for the masters apart, this optimizer's
        where every such piece is what it stores, else the fp32 layout's (torch's AdamW)."""
        if "state_layout" in sd:
            return StateLayout.from_dict(sd["state_layout"])
        same = {"moments": True, "master": True}
        for name, entry in state.items():
            for what, v in entry.items():
                if what == "step" or not self.store.contains(k := optimizer_key(name, what)):
                    continue
                info = self.store.info(k)
                if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(info["shape"]) or \
                        v.dtype != info["dtype"]:
                    same["master" if what == "master" else "moments"] = False
        if all(same.values()):
            return self.layout
        fp32 = StateLayout.from_dict({})
        return dataclasses.replace(self.layout, **({} if same["moments"] else {"moments": fp32.moments}),
                                   **({} if same["master"] else {"master": fp32.master, "split": fp32.split}))

    def _sharded(self) -> bool:
        """Whether the parameters are FSDP2's shards (DTensors): their state dict gives decoded moments."""
        return any(is_dtensor(p) for _, _, p in self._items)

    def load_values(self, name: str, values: dict[str, torch.Tensor]) -> None:
        """Set one parameter's ``exp_avg``, ``exp_avg_sq`` and ``master`` from values of the fp32 layout
        (encoded into this one)."""
        self._state.load_values(name, values)
