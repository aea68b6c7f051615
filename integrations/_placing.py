"""What an offloaded model keeps resident and how far it reads ahead, decided at the start of each step from the
steps before: the placement (``tierstore.scheduling``) from the recorded trace and the budget, and with
``prefetch_depth="auto"`` the depth from the measured drive rate and compute time per use.

[Note: Re-planning] The placement is planned once a step has been recorded,
and again whenever the trace is recorded anew (a step departed from it) or an
optimizer adds or drops its state; until then nothing is kept. Kept copies are
only a preference of eviction, so a stale plan costs bytes, never values or a
budget error.

[Note: A placement on trial] The cost model behind a placement is a model:
with little room, an optimizer stepping on a worker behind backward can
find a streamed weight gone before its update and read it again, and the
plan then moves more than caching in the whole budget did (ViT-large at a
tenth of its state as host budget: 9.0 GiB a step against 7.7). So a plan is
tried against measurement, on the steps of its own trace: one runs without a
placement (the baseline), the plan is made at the start of the next, that
step loads the kept copies, and the one after is measured; unless it moved
less than KEEP_BELOW of the baseline's bytes, the placement is dropped.
``verdict`` says what was measured and decided, and the decision is kept per
trace. A trace is tried once it repeats: two steps running, or, before
anything is decided, at its second step (training and an evaluation forward
taking turns). Meanwhile a step of another trace changes nothing and its
bytes count for nothing, unless it runs twice in a row (a new regime: an
evaluation loop), which starts its own trial; a trace that comes back
(training again after an evaluation loop) gets the placement decided for it
at once; one seen once (an evaluation forward) keeps what is kept, so a
one-off step costs no kept copies.

[Note: Updates behind backward] An optimizer stepping in backward runs
behind it: backward goes on to the layers below while the updates of the
layers above wait for the worker, their gradients queued up to the
optimizer's ``max_grad_backlog_bytes`` (its ``held_host_bytes()``). The copies of
those parameters wait in the host tier for their updates, and a room too
small for them loses them (or the copies read ahead) before use: the update
reads them again, and the step moves more than the plan predicted. So the
room counts them: as many bytes as the gradients the optimizers may hold
queued, the worker that speculates updates in backward too (see [Note:
Speculated updates] in _speculated.py: on the anchor model of
docs/optimizer.md its uncounted 50 MiB backlog left a room of 160 MiB, its
worker read one update ahead and missed 30-48 reads a step, at 2.33 s a step;
a quarter of the budget as backlog, counted, leaves 336 MiB: 1.97 s, one run
alternating), and the updates streamed into the next forward as many bytes
as that backlog's bound (those updates read their state ahead beside the
forward's reads; on the anchor the streamed loop took 2.84 s a step with no
room for them and 2.09 with a quarter of the budget, the step in backward
1.56, one run alternating). Measured on the 1B ViT (bf16 weights, 8-bit moments, split masters,
batch 1, a 700 MiB budget and its default 175 MiB backlog, which the worker
filled): without them, a plan keeping 555 MiB beside a room of 145 MiB
predicted 11.7 GiB a step and moved 13.6 (the streamed weights read 3-4
times a step instead of twice), against 12.6 GiB with nothing kept, and was
dropped; with them, a plan keeping 380 MiB beside a room of 320 MiB
predicted 12.1 GiB and moved 12.0, and was kept. A plan counting only the
streamed ones (a smaller room, 282 MiB, keeping 418) moved 12.4 GiB: the
parameters waiting are not a fair share of what streams.

[Note: Auto prefetch depth] The depth is the smallest whose predicted stall
is within 1% of the step's compute of the least any depth reaches (at least
2 where uses wait at every depth: the drive is the bottleneck), predicted
from the drive's rate over the last step's reads (bytes over the seconds some
read was in flight: the rate of the drive, not of one transfer waiting behind
others) and the compute time between uses (the clock given to ``on_use`` stops
while the training thread stalls, so a stall does not pass for compute), up
to as deep as the room left for copies in flight allows (see
``tierstore.scheduling.choose_depth`` and [Note: Not as deep as the room
allows]). It is chosen again each step, so it follows the drive and the
compute as they change.

[Note: Reads ahead beside the updates] The deepest auto depth counts only
the room the step's other copies leave: the updates in progress (two of the
largest, one stepping and one read ahead) and the parameters waiting behind
backward for theirs. Before, with no placement it counted the whole budget,
and under a small one reads ahead evicted those waiting parameters and each
other: transformers' Llama at 0.94B parameters (bf16 weights, 8-bit moments,
split masters, stepping in backward, a 512 MiB budget, the embedding and
head a 262 MB unit) read its weights 3-4 times a step at the depth chosen
(5.3-5.7 GB against 3.8 on the first step, which reads on demand) and its
optimizer state 1.05-1.12 times; counting them, 4.0 GB and 1.0 times, and
the steps went from 6.7-6.8 s to 5.8-6.7 s.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tierstore import Tier, TierStore, TierTypeError
from tierstore.memory import TierPool
from tierstore.scheduling import Placement, StepTrace, choose_depth, plan_placement, room_bytes, size_text
from tierstore.scheduling import LaterUses, PrefetchPolicy

from ._budget import HostBudget
from ._contract import OPTIMIZER_PREFIX, NotCopyable
from .policies import check_prefetch_depth

MAX_AUTO_DEPTH = 16
KEEP_BELOW = 0.97  # a placement is kept when its step moved less than this share of the baseline's bytes
RETRY_AFTER_STEPS = 8  # a dropped placement is tried again after this many steps, twice as many after each drop
MAX_RETRY_AFTER_STEPS = 1024


class Trial(enum.Enum):
    """Where a placement is in its trial (see [Note: A placement on trial])."""

    BASELINE = "a step without a placement is measured"
    SETTLING = "the plan's kept copies are loaded"
    MEASURED = "a step with the placement is measured"
    DECIDED = "kept or dropped"


AUTO_START_DEPTH = 2  # prefetch_depth="auto" before a step has been measured


def check_options(prefetch_depth: object, placement: object) -> None:
    """What offload_model and offload_fsdp check of these two arguments."""
    if prefetch_depth is not None:
        check_prefetch_depth(prefetch_depth)
    if not isinstance(placement, bool):
        raise TierTypeError(f"placement must be True or False, not {placement!r}")


MAX_TRACES_REMEMBERED = 8
MAX_FORWARDS_PER_STEP = 16  # see [Note: Several forwards, one backward]


class StepStarts:
    """Which forwards of a model start a step.

    [Note: Several forwards, one backward] A step (what the prefetch trace
    records, and the placement plans for) starts at a forward of the model,
    except one under grad that follows another under grad with no backward
    between: a loss over two views of a batch, or a siamese pair, calls the
    model twice before its one backward, and the step is both forwards and
    the backward (up to MAX_FORWARDS_PER_STEP forwards, for a model called
    under grad that is never differentiated). Otherwise the trace would
    alternate between "a forward" and "a forward and a backward", prefetch
    would follow the wrong one each step, and the placement's trial would see
    neither repeat.
    """

    def __init__(self) -> None:
        self.awaiting_backward = 0  # forwards under grad since the last backward

    def forward(self) -> bool:
        """A forward of the model (not one rerun inside backward) begins: True when it starts a step."""
        grad = torch.is_grad_enabled()
        if grad and 0 < self.awaiting_backward < MAX_FORWARDS_PER_STEP:
            self.awaiting_backward += 1
            return False
        self.awaiting_backward = int(grad)
        return True

    def backward(self) -> None:
        """A backward of the model ran."""
        self.awaiting_backward = 0


def _remember(memory: dict, key: tuple, value: object) -> None:
    """Put ``key`` last in ``memory`` (insertion order: least recent first), forgetting the least recent beyond
    MAX_TRACES_REMEMBERED."""
    memory.pop(key, None)
    memory[key] = value
    while len(memory) > MAX_TRACES_REMEMBERED:
        del memory[next(iter(memory))]


class UnitSchedule(NotCopyable):
    """What the units of one model tell of their use, and where it goes: the read-ahead its prefetch policy names
    (``policy``, with the placement's clock), the stalls and learned reads counted in ``stats``, and which units
    hold each parameter (``units`` by name, ``key_units``: a parameter's store key -> the units that hold it).
    The levels below an offload's front (a unit, a parameter, the pass) are given this, not the front; the front
    makes the policy and the placer once its units exist."""

    def __init__(self, store: TierStore, stats: Any) -> None:
        self.store = store
        self.stats = stats
        self.units: dict[str, Any] = {}
        self.key_units: dict[str, tuple[str, ...]] = {}
        self.policy: PrefetchPolicy | None = None
        self.placer: Placer | None = None

    def prefetch_after(self, unit: Any, tier: Tier) -> None:
        """``unit`` is about to be used: read ahead the units the policy names."""
        assert self.policy is not None and self.placer is not None
        for name in self.policy.on_use(unit.name, self.placer.clock()):
            for r in self.units[name].params:
                self.store.prefetch(r.key, tier)
                self.stats.prefetches_issued += 1

    def backward_starts(self) -> None:
        assert self.policy is not None
        self.policy.backward_starts()

    def add_stall(self, unit: Any, since: float) -> None:
        """``unit`` waited for its parameters from ``since`` until now."""
        by_unit = self.stats.stall_seconds_by_unit
        by_unit[unit.name] = by_unit.get(unit.name, 0.0) + time.perf_counter() - since

    def unit_of(self, r: Any) -> Any:
        """The unit that owns the parameter record ``r`` (the first that holds it)."""
        return self.units[self.key_units[r.key][0]]

    def learned(self, unit: Any, r: Any) -> None:
        """``unit`` was seen to read ``r``: its uses count ``r`` from now on."""
        self.key_units[r.key] = (*self.key_units.get(r.key, ()), unit.name)
        assert self.policy is not None
        self.policy.unit_bytes[unit.name] = unit.nbytes
        self.stats.reads_learned += 1

    def unit_keys(self) -> dict[str, list[tuple[str, int]]]:
        """Unit name -> (store key, bytes) of the parameters its uses hold."""
        return {u.name: [(r.key, TierPool.capacity_for(r.nbytes)) for r in u.params]
                for u in self.units.values() if u.params}


class Placer:
    """The placement and the prefetch depth of one offloaded model (see the notes above)."""

    def __init__(self, store: TierStore, policy: PrefetchPolicy, later: LaterUses, *,
                 held_beside: Callable[[], int] = lambda: 0,
                 unit_keys: Callable[[], Mapping[str, Sequence[tuple[str, int]]]], place: bool,
                 auto_depth: bool, grad_of: Callable[[str], tuple[str, int] | None] | None = None) -> None:
        self.store = store
        self.host = HostBudget(store)  # see [Note: Splitting the host budget]
        self.prefetch_policy = policy
        self.later = later
        # bytes of the host tier the model's consumers may hold beside its units (see [Note: Updates behind
        # backward])
        self.held_beside = held_beside
        self.unit_keys = unit_keys  # unit name -> (store key, bytes) of the parameters its uses hold
        # parameter key -> (store key, bytes) of the gradient kept for an optimizer stepping after backward, or None
        self.grad_of = grad_of or (lambda key: None)
        self.place = place
        self.auto_depth = auto_depth
        self.placement: Placement | None = None
        self.tried: Placement | None = None  # the last plan made, kept or not (its lower bound holds either way)
        self.verdict: str | None = None  # what the trial measured and decided
        # Traces are told apart by key: (the units in order, the optimizer's state keys, stepping in backward).
        self._trial = Trial.DECIDED
        self._trial_key: tuple | None = None  # the trace whose placement is on trial
        self._baseline_bytes = 0
        # key -> placement, verdict; the traces seen: the last MAX_TRACES_REMEMBERED of each (a model whose trace
        # differs every step, a mixture of experts, would otherwise grow them without end)
        self._decided: dict[tuple, tuple[Placement | None, str | None]] = {}
        self._seen: dict[tuple, None] = {}
        self._retry: dict[tuple, tuple[int, int]] = {}  # key -> (the step to try its dropped placement again, drops)
        self._last_key: tuple | None = None  # the trace of the step before
        self._drive_before = self._drive()
        self._sizes: dict[str, int] = {}
        self._fixed_max_bytes = policy.max_bytes  # prefetch_bytes given by the user

    def clock(self) -> float:
        """Seconds of compute so far: wall time less the training thread's stalls."""
        return time.perf_counter() - self.store.stats.counter("stall_seconds")

    def start_step(self) -> None:
        """After ``policy.start_step()``: plan again if the trace or the optimizer changed, tune the depth."""
        now = self._drive()
        read_bytes, written_bytes, read_seconds = (a - b for a, b in zip(now, self._drive_before))
        self._drive_before = now
        moved = read_bytes + written_bytes
        if self.prefetch_policy.steps < 2:  # nothing recorded yet
            return
        if self.place:
            self._try_placement(moved)
        if self.auto_depth and read_bytes and read_seconds > 0:
            self.prefetch_policy.depth = self._tuned_depth(read_bytes / read_seconds)

    def _drive(self) -> tuple[float, float, float]:
        """(bytes read, bytes written, seconds some read was in flight) of the drive so far."""
        stats = self.store.stats
        return stats.path("nvme->host")[0], stats.path("host->nvme")[0], stats.counter("read_busy_seconds")

    def _try_placement(self, moved: int) -> None:
        """One step of [Note: A placement on trial]; ``moved``: the drive bytes of the step that just ended, whose
        trace ``policy.trace`` is now."""
        key = (tuple(self.prefetch_policy.trace or ()), len(self.later.after), self.later.in_backward,
               self.later.grads_to_step)
        # At the first call the step before is the one that recorded the trace: the one that just ended repeated
        # it unless it recorded another.
        again = key == self._last_key if self._last_key is not None else self.prefetch_policy.traces_recorded == 1
        seen = key in self._seen
        self._last_key = key
        _remember(self._seen, key, None)
        if key != self._trial_key:
            if self._trial_key is not None and not again:
                return  # another trace's step during a trial (an evaluation forward): its bytes are not the trial's
            retry = self._retry.get(key)
            if key in self._decided and again and retry is not None and self.prefetch_policy.steps >= retry[0]:
                self._trial_key, self._trial = key, Trial.BASELINE  # its dropped placement is tried again
                self._set(None)
            elif key in self._decided:  # a trace seen before (training again after an evaluation)
                self._trial_key, self._trial = None, Trial.DECIDED
                placement, self.verdict = self._decided[key]
                self._set(placement)
            elif again or (seen and not self._decided and self._trial_key is None):
                # It repeats (two steps running, or, with nothing decided yet, every other step): try it.
                self._trial_key, self._trial = key, Trial.BASELINE
                self._set(None)
            # else seen once (maybe a one-off: an evaluation forward): what is kept stays until it repeats
            return
        if self._trial is Trial.BASELINE:
            self._baseline_bytes = moved
            budget = self.budget()
            self.tried = plan_placement(self.step_trace(), budget_bytes=budget, room_bytes=self.room(budget))
            if not self.tried.resident:  # nothing to try: no key is worth its bytes beside the room
                self._decide(key, None, f"no placement: nothing fits beside the {size_text(self.tried.room_bytes)} "
                                        f"left for copies in flight")
                return
            self._set(self.tried)
            self._trial = Trial.SETTLING
        elif self._trial is Trial.SETTLING:
            self._trial = Trial.MEASURED
        elif self._trial is Trial.MEASURED:
            kept = moved < KEEP_BELOW * self._baseline_bytes
            verdict = (f"placement {'kept' if kept else 'dropped'}: a step moved {size_text(moved)} with it, "
                       f"{size_text(self._baseline_bytes)} without")
            if kept:
                self._retry.pop(key, None)
            else:
                drops = self._retry.get(key, (0, 0))[1] + 1
                after = min(MAX_RETRY_AFTER_STEPS, RETRY_AFTER_STEPS * 2 ** (drops - 1))
                _remember(self._retry, key, (self.prefetch_policy.steps + after, drops))
                verdict += f"; tried again after {after} steps"
            self._decide(key, self.placement if kept else None, verdict)

    def _decide(self, key: tuple, placement: Placement | None, verdict: str) -> None:
        self._trial_key, self._trial = None, Trial.DECIDED
        self.verdict = verdict
        _remember(self._decided, key, (placement, verdict))
        self._set(placement)

    def _set(self, placement: Placement | None) -> None:
        """Keep what ``placement`` keeps (nothing for None), reads ahead within its room."""
        self.placement = placement
        resident = placement.resident if placement is not None else frozenset()
        self.store.keep(self, resident, Tier.HOST)
        # Reads ahead count only what streams, within their share of the room.
        self.prefetch_policy.unit_bytes.update({g: sum(n for k, n in keys if k not in resident)
                                        for g, keys in self.unit_keys().items()})
        if self._fixed_max_bytes is None:
            self.prefetch_policy.max_bytes = self._params_readahead()

    def _size(self, key: str) -> int:
        if key not in self._sizes:
            self._sizes[key] = TierPool.capacity_for(self.store.info(key)["nbytes"])
        return self._sizes[key]

    def step_trace(self) -> StepTrace:
        """The last recorded step as uses of store keys: each unit's parameters where the trace uses it, each
        optimizer update (a parameter with its state) after its parameter's last use when the optimizer steps
        in backward, else after the whole trace; a kept gradient made by its last use and read by its update, and
        used once more at the end where its update is speculated (kept until the step all the same)."""
        units = self.unit_keys()
        events: list[tuple[str, ...]] = []
        nbytes: dict[str, int] = {}
        for u in self.prefetch_policy.trace or []:
            keys = units.get(u, ())
            events.append(tuple(k for k, _ in keys))
            nbytes.update(keys)
        states: dict[str, list[str]] = {}
        for k, param_key in self.later.after.items():
            states.setdefault(param_key, []).append(k)
            nbytes[k] = self._size(k)
        last = {k: i for i, event in enumerate(events) for k in event}
        updates: dict[int, list[tuple[str, ...]]] = {}
        transient: set[str] = set()
        kept_last: set[str] = set()  # gradients kept until the step, not read there where the update stands
        for param_key, keys in states.items():
            at = last.get(param_key, len(events)) if self.later.in_backward else len(events)
            grad = None if self.later.in_backward and not self.later.grads_to_step else self.grad_of(param_key)
            if grad is not None and param_key in last:  # made by its last backward use, read by its update
                transient.add(grad[0])
                nbytes[grad[0]] = grad[1]
                events[last[param_key]] += (grad[0],)
                keys = [*keys, grad[0]]
                if at < len(events):  # updated in backward, kept until the step all the same
                    updates.setdefault(len(events), []).append((grad[0],))
                    kept_last.add(grad[0])
            updates.setdefault(at, []).append((param_key, *keys))
        ordered: list[tuple[str, ...]] = []
        forward_uses = self.prefetch_policy.forward_uses
        forward_events = None
        for i, event in enumerate(events):
            if i == forward_uses:
                forward_events = len(ordered)
            ordered.append(event)
            ordered.extend(updates.get(i, ()))
        ordered.extend(updates.get(len(events), ()))
        for k in states:
            nbytes.setdefault(k, self._size(k))
        changed = frozenset(states) | frozenset(self.later.after) | frozenset(transient)
        kinds = {k: "gradients" if k in transient else k.rsplit("/", 1)[-1] if k.startswith(OPTIMIZER_PREFIX)
                 else "weights" for k in nbytes}
        # Speculated updates write what they change home each step, kept resident or not (see [Note: Written home
        # all the same] in tierstore/_placement.py).
        speculated = self.later.in_backward and self.later.grads_to_step
        groups = {param_key: frozenset((param_key, *keys)) for param_key, keys in states.items()}
        written = {k: group for group in groups.values() for k in group} if speculated else {}
        return StepTrace(events=tuple(ordered), nbytes=nbytes, changed=changed, kinds=kinds,
                         forward_events=forward_events, transient=frozenset(transient), written=written,
                         kept_last=frozenset(kept_last))

    def budget(self) -> int:
        """The host budget less what other models' placements keep in it (models offloaded into one store share
        its budget: the first to plan keeps what it chooses, the next plans in what is left)."""
        mine = self.placement.resident if self.placement is not None else frozenset()
        others = self.store.kept(Tier.HOST) - mine
        return max(0, self.host.total_bytes - sum(self._size(k) for k in others))

    def room(self, host: int | None = None) -> int:
        """Bytes of ``host`` (the host budget) left for copies in flight (see
        ``tierstore.scheduling.room_bytes``), parameters waiting for updates behind backward among them (see
        [Note: Updates behind backward])."""
        host = self.host.total_bytes if host is None else host
        return room_bytes(host, largest_unit_bytes=self._largest_unit(), units_in_flight=self._units_in_flight(),
                          largest_update_bytes=self._largest_update(), behind_bytes=self.held_beside())

    def _largest_update(self) -> int:
        """The most bytes one optimizer update holds: a parameter with its state."""
        by_param: dict[str, int] = {}
        for k, param_key in self.later.after.items():
            by_param[param_key] = by_param.get(param_key, self._size(param_key)) + self._size(k)
        return max(by_param.values(), default=0)

    def _largest_unit(self) -> int:
        return max((sum(n for _, n in keys) for keys in self.unit_keys().values()), default=0)

    def _units_in_flight(self) -> int:
        """Units in the host tier at once for compute and read-ahead at a depth the user fixed: the one
        computing, the one before it (its hold ends as the next reads are issued) and the depth ahead. An auto
        depth is chosen within the room instead, so it asks for one computing and one ahead."""
        return 2 if self.auto_depth else self.prefetch_policy.depth + 2

    def _params_readahead(self) -> int | None:
        """The parameters' read-ahead bound: half the room, or a fixed depth's units if more (the room was made
        for them)."""
        half = self.readahead_room()
        if half is None or self.auto_depth:
            return half
        return max(half, self.prefetch_policy.depth * self._largest_unit())

    def readahead_room(self) -> int | None:
        """Bytes that reads ahead of use may fill (the parameters' and the optimizer's each): half the room."""
        return self.placement.room_bytes // 2 if self.placement is not None else None


    def _tuned_depth(self, drive_bytes_per_second: float) -> int:
        uses, clock = self.prefetch_policy.last_step
        if not uses or uses != self.prefetch_policy.trace:
            return self.prefetch_policy.depth
        kept = self.store.kept(Tier.HOST)
        units = self.unit_keys()
        streamed = [sum(n for k, n in units.get(g, ()) if k not in kept) for g in uses]
        reads = [n / drive_bytes_per_second for n in streamed]
        compute = [max(0.0, b - a) for a, b in zip(clock, clock[1:])] + [0.0]
        # As many of the largest streamed unit as the room holds beside the one computing, the updates in
        # progress and the parameters waiting for updates behind backward ([Note: Reads ahead beside the updates]).
        room = self.placement.room_bytes if self.placement else self.host.total_bytes
        room -= 2 * self._largest_update() + self.held_beside()
        largest = max(streamed, default=0)
        fits = room // largest - 1 if largest else MAX_AUTO_DEPTH
        return choose_depth(reads, compute, max_depth=max(1, min(MAX_AUTO_DEPTH, fits)))

    def close(self) -> None:
        self._set(None)


__all__ = ["AUTO_START_DEPTH", "Placer", "UnitSchedule", "check_options"]
