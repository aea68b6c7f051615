"""Placement: which store keys stay in the host tier for the whole run, and which stream from the drive.

A pure policy over one step's trace of key uses and the budget; it knows
nothing of torch modules or files. The integration builds the trace and
tells the store which keys to keep (``TierStore.keep``); the store's victim
order and prefetches then leave those copies alone.

[Note: Placement from the trace] Once prefetch hides the drive, a step costs
its bytes moved over the drive's rate, so the lever left is the bytes. A key
that streams costs, each step, one read per use its copy does not survive to
(a copy survives a gap when the other streamed bytes used from its last use
to this one, those used with it included, fit the working room beside it)
and one write when the step changes it. A key kept resident costs nothing
after its first read, and a changed one is written home only when it has to
go (a checkpoint flushes it). So the keys that save
the most bytes per byte of budget are kept: parameters used far apart in
forward and backward (two reads and a write each step: 3 bytes a byte), then
optimizer state and parameters used close together (a read and a write: 2),
then frozen parameters (a read: 1 or 2). The rest stream through
``room_bytes`` of the budget, left for copies in flight (units being
computed, prefetches, the optimizer's read-ahead). A greedy fill by that
density (a fractional knapsack, exact up to the last key that does not fit).

[Note: Written home all the same] An update speculated in backward keeps
the version of every key it changes on the drive until the step decides
(see [Note: Speculated updates] in integrations/_speculated.py), so a key
it changes that is kept resident is written home once a step all the same:
keeping it saves its reads (and writes) streaming would cost, less that
write. A weight used far apart then saves 2 bytes a byte instead of 3, the
optimizer state 1 instead of 2. Such keys are the trace's ``written``; the
prediction counts their write, and the fill orders keys by what they save.
On the anchor model of docs/optimizer.md (the loop that speculates) the
prediction left out 0.47 GB a step of weights written home so, and counted
each kept gradient that spills as written and read back, where it is only
written (see [Note: Transient keys]): 5.27 GiB a step predicted against
4.83-4.95 moved; counting both as they are, 5.02, the same copies kept.
A parameter whose whole state stays resident is not speculated and writes
nothing: the prediction counts no write of a key whose group (the keys its
update changes) is all kept; the fill, key by key, orders such keys as if
written; the lower bound counts no write home, which a placement keeping
whole groups avoids.

[Note: The lower bound] Whatever is not in the tier at some point of a step
must be read at least once in it, and written once if the step changes it,
and at most ``budget_bytes`` can stay: filling the budget with the densest
keys at those least costs gives a bound no placement can beat, 2 x (state -
budget) when every key changes each step. The prediction differs from it by
the room and by keys read twice.

[Note: The predicted step] Prefetch hides the drive behind compute only
where there are bytes to move: the forward reads what streams of the weights
(few, under a placement), while the optimizer's state is read and written
from the first backward use on. The state cannot be read during the forward
instead, for want of room to hold it until backward (the budget holds the
kept copies then), nor its writes held back into the next forward. So the
step is predicted as its two phases one after the other, each bound by its
compute or its bytes over the drive's rate:
max(forward compute, forward bytes / rate) + max(the rest of the compute,
the rest of the bytes / rate). ViT-large, fp32, a third of its state as
host budget, torch's fused AdamW, measured here: in one run the single bound
max(compute, bytes / rate) said 1.98 s, and a traced step's forward took
0.49 s with the drive busy for 0.10 s of it; in another, the single bound
said 2.13 s, this prediction 2.55 s, and the step took 2.61 s. Where the
trace has no backward (or its forward is not known), the single bound is
the prediction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from ._types import TierValueError

MIB = 1024**2

# Share of the host budget left for copies in flight (units computing, prefetches, the optimizer's read-ahead)
# when the smallest working set is less. Measured on ViT-large, fp32, batch 8, a third of the state as budget:
# at depth 4, one run each (A/B against no placement), room 0.15 moved 5.5 GiB a step in 4.33 s, 0.22 5.2 GiB in
# 3.61 s, 0.3 5.3 GiB in 3.21 s, 0.45 5.6 GiB in 3.42 s (no placement: 6.5 GiB, 4.2-4.6 s). With the depth auto
# and the I/O threads' CPU cut by half, two to four models in one process taking steps in turn (three runs, 5-8
# steps each, medians): 0.2 moved 5.05-5.07 GiB a step against 0.3's 5.26-5.27, in 3.56/4.15/4.21 s against
# 3.74/4.04/4.18 (the same within the noise); 0.18 moved 5.14 GiB and stalled 40% longer than 0.3, 0.15 stalled
# three times as long and stepped 18% slower. Less room moves fewer bytes until too little is left in flight to
# keep the drive busy.
ROOM_SHARE = 0.2


@dataclass(frozen=True, kw_only=True)
class StepTrace:
    """One step's uses of store keys, in order."""

    events: tuple[tuple[str, ...], ...]
    """Each event is the keys used together: a unit's forward or backward, one optimizer update."""
    nbytes: Mapping[str, int]
    """Bytes of budget each key takes in the tier (its buffer's size)."""
    changed: frozenset[str] = frozenset()
    """Keys the step writes (trained parameters, optimizer state)."""
    kinds: Mapping[str, str] = field(default_factory=dict)
    """Key -> what it is ("weights", "exp_avg", ...), for the summary; 'other' when missing."""
    forward_events: int | None = None
    """How many of the first events are the forward (the rest: backward and the optimizer); None if not known."""
    transient: frozenset[str] = frozenset()
    """Keys made at their first use and dropped after their last (gradients kept for the optimizer): never kept
    resident, read nothing at their first use, carried to no next step (see [Note: Transient keys])."""
    written: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Key -> the keys changed with it (its parameter's update): written home every step even where kept
    resident, unless all of them are (see [Note: Written home all the same])."""
    kept_last: frozenset[str] = frozenset()
    """Transient keys whose last use only keeps them (a speculated update's gradient, kept until the step decides
    and not read where the update stands): what spills before it is written, not read back."""

    def __post_init__(self) -> None:
        if self.forward_events is not None and not 0 <= self.forward_events <= len(self.events):
            raise TierValueError(f"forward_events={self.forward_events} must be within the {len(self.events)} events")
        for event in self.events:
            for k in event:
                if k not in self.nbytes:
                    raise TierValueError(f"key {k!r} is used in the trace but has no size in nbytes")
        bad = [k for k, n in self.nbytes.items() if n < 0]
        if bad:
            raise TierValueError(f"negative sizes for {bad[:4]}")
        unsized = sorted({x for k, group in self.written.items() for x in (k, *group) if x not in self.nbytes})
        if unsized:
            raise TierValueError(f"written keys {unsized[:4]} have no size in nbytes")
        if not self.kept_last <= self.transient:
            raise TierValueError(f"kept_last keys {sorted(self.kept_last - self.transient)[:4]} are not transient")

    def uses(self) -> dict[str, list[int]]:
        """Key -> the events that use it, in order (a key used twice in one event counts once)."""
        out: dict[str, list[int]] = {}
        for i, event in enumerate(self.events):
            for k in dict.fromkeys(event):
                out.setdefault(k, []).append(i)
        return out


@dataclass(frozen=True, kw_only=True)
class Placement:
    """What :func:`plan_placement` decided, with the bytes a step is predicted to move."""

    resident: frozenset[str]
    budget_bytes: int
    room_bytes: int
    resident_by_kind: dict[str, int]
    """Bytes kept resident, by kind."""
    moved_by_kind: dict[str, int]
    """Bytes a step is predicted to read and write, by kind."""
    bytes_per_step: int
    lower_bound_bytes: int
    forward_bytes: int | None = None
    """Of ``bytes_per_step``, what the forward reads; None where the trace does not say which events it is."""

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident_by_kind.values())

    def predicted_step_seconds(self, compute_seconds: float, drive_bytes_per_second: float,
                               forward_compute_seconds: float | None = None) -> float:
        """The step's time under this placement (see [Note: The predicted step]): with the forward's share of
        the compute, its two phases one after the other; without, max(compute, bytes moved / the drive's rate)."""
        if forward_compute_seconds is None or self.forward_bytes is None:
            return max(compute_seconds, self.bytes_per_step / drive_bytes_per_second)
        forward = max(forward_compute_seconds, self.forward_bytes / drive_bytes_per_second)
        rest = max(compute_seconds - forward_compute_seconds,
                   (self.bytes_per_step - self.forward_bytes) / drive_bytes_per_second)
        return forward + rest

    def summary(self, compute_seconds: float | None = None, drive_bytes_per_second: float | None = None,
                forward_compute_seconds: float | None = None) -> str:
        mib = size_text

        kinds = sorted(set(self.resident_by_kind) | set(self.moved_by_kind))
        lines = [f"placement: {mib(self.resident_bytes)} resident of a {mib(self.budget_bytes)} host budget "
                 f"({mib(self.room_bytes)} left for copies in flight)",
                 "  resident: " + ", ".join(f"{k} {mib(self.resident_by_kind[k])}" for k in kinds
                                            if k in self.resident_by_kind),
                 "  moved per step: " + ", ".join(f"{k} {mib(self.moved_by_kind.get(k, 0))}" for k in kinds),
                 f"  bytes per step: {mib(self.bytes_per_step)} predicted, {mib(self.lower_bound_bytes)} lower bound "
                 f"({self.bytes_per_step / max(self.lower_bound_bytes, 1):.2f}x)"]
        if compute_seconds is not None and drive_bytes_per_second:
            step = self.predicted_step_seconds(compute_seconds, drive_bytes_per_second, forward_compute_seconds)
            if forward_compute_seconds is None or self.forward_bytes is None:
                how = f"compute {compute_seconds:.3f} s"
            else:
                how = (f"forward: compute {forward_compute_seconds:.3f} s, reads {mib(self.forward_bytes)}; then "
                       f"compute {compute_seconds - forward_compute_seconds:.3f} s, "
                       f"{mib(self.bytes_per_step - self.forward_bytes)} moved")
            lines.append(f"  predicted step: {step:.3f} s ({how}; drive {drive_bytes_per_second / 1e9:.2f} GB/s)")
        return "\n".join(lines)


def layered_trace(layers: int, *, weight_bytes: int, state_bytes: Mapping[str, int],
                  optimizer_in_backward: bool = True) -> StepTrace:
    """A model of ``layers`` equal units (a transformer's blocks): forward in order, backward in reverse, each
    unit's update (its weights and each kind of state in ``state_bytes``) right after its backward, or all after
    backward. Every key changes each step."""
    if layers < 1:
        raise TierValueError(f"layers={layers} must be >= 1")
    weights = [f"w{i}" for i in range(layers)]
    updates = {w: (w, *(f"{kind}{w}" for kind in state_bytes)) for w in weights}
    events: list[tuple[str, ...]] = [(w,) for w in weights]
    for w in reversed(weights):
        events.append((w,))
        if optimizer_in_backward:
            events.append(updates[w])
    if not optimizer_in_backward:
        events.extend(updates[w] for w in weights)
    nbytes = {w: weight_bytes for w in weights} | {f"{k}{w}": n for w in weights for k, n in state_bytes.items()}
    kinds = {w: "weights" for w in weights} | {f"{k}{w}": k for w in weights for k in state_bytes}
    return StepTrace(events=tuple(events), nbytes=nbytes, changed=frozenset(nbytes), kinds=kinds,
                     forward_events=layers)


def size_text(n: float) -> str:
    """A byte count for people: '1.25 GiB', '340.0 MiB', '12.0 KiB', '512 B'."""
    for unit, scale in (("GiB", 1024**3), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:.0f} B"


def count_text(n: float) -> str:
    """A count for people, never read as 0: '1.20B', '85.6M', '213.5K', '512'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return f"{n:.0f}"


def moved_bytes(trace: StepTrace, streamed: set[str] | frozenset[str], room_bytes: int) -> dict[str, int]:
    """Key -> bytes a step reads and writes of it when the keys of ``streamed`` stream (see [Note: Placement
    from the trace]); keys not streamed move nothing but their write home where ``trace.written`` has them."""
    return _moves(trace, streamed, room_bytes)[0]


def _moves(trace: StepTrace, streamed: set[str] | frozenset[str], room_bytes: int) -> tuple[dict[str, int], int]:
    """:func:`moved_bytes`, and the bytes of it read by the forward's events (0 when not known).

    [Note: Transient keys] A gradient kept for an optimizer that steps after
    backward exists from the backward that makes it to the step: it takes room
    as any streamed copy does, but its first use reads nothing and nothing of
    it is carried to the next step. Between two of its uses it goes to the
    drive and back (written, then read) when what else the room holds in
    between does not leave it room, as a streamed key's copy would be dropped.
    Before a last use that only keeps it (``kept_last``: the gradient of an
    update speculated in backward, kept until the step decides) it is written
    and not read back, and nothing moves where the use before it read it back
    from the drive (the copy there is current): on the anchor model of
    docs/optimizer.md counting that read too predicted 0.69 GiB a step of
    reads that never came.
    """
    streamed = frozenset(streamed) | trace.transient  # never kept: always in the room
    # before[i]: streamed bytes used in events 0 .. i-1
    before = [0]
    for event in trace.events:
        before.append(before[-1] + sum(trace.nbytes[k] for k in dict.fromkeys(event) if k in streamed))
    total = before[-1]
    forward_events = trace.forward_events or 0
    out: dict[str, int] = {}
    forward = 0

    def written(k: str) -> bool:  # written home this step all the same: some key of its update streams
        return k in trace.written and any(g in streamed for g in trace.written[k])

    for k, at in trace.uses().items():
        n = trace.nbytes[k]
        if k not in streamed:
            if written(k):
                out[k] = n
            continue
        if k in trace.transient:
            spills = [before[i + 1] - before[prev] - n > room_bytes for prev, i in zip(at, at[1:])]
            if k in trace.kept_last and spills:  # the last spill writes it (unless it is on the drive already)
                last = spills.pop()
                out[k] = 2 * n * sum(spills) + n * (last and not any(spills[-1:]))
            else:
                out[k] = 2 * n * sum(spills)
            continue
        reads = 0
        for j, i in enumerate(at):
            # What else the room holds from the previous use to this one: the streamed bytes of both uses' events
            # (what is used with it) and of those between, less its own; the first use's previous one is the
            # last of the step before (cyclic).
            prev = at[j - 1]
            if len(at) == 1:
                between = total - n
            elif j:
                between = before[i + 1] - before[prev] - 2 * n
            else:
                between = total - before[prev] + before[i + 1] - 2 * n
            if between + n > room_bytes:
                reads += 1
                forward += n if i < forward_events else 0
        # never evicted: never written either, unless it is written home all the same
        out[k] = n * (reads + (k in trace.changed)) if reads else n * written(k)
    return out, forward


def lower_bound_bytes(trace: StepTrace, budget_bytes: int) -> int:
    """See [Note: The lower bound]."""
    # A transient key may cost nothing (it fits beside the rest): left out, the bound stays a bound.
    # Keys written home all the same are not: a placement keeping all of their group writes none of them.
    least = {k: trace.nbytes[k] * (2 if k in trace.changed else 1) for k in trace.uses() if k not in trace.transient}
    left, saved = budget_bytes, 0.0
    for k in sorted(least, key=lambda k: -least[k] / max(trace.nbytes[k], 1)):
        n = trace.nbytes[k]
        if left <= 0 or n == 0:
            continue
        take = min(n, left)
        saved += least[k] * take / n
        left -= take
    return max(0, sum(least.values()) - math.floor(saved))


def plan_placement(trace: StepTrace, *, budget_bytes: int, room_bytes: int) -> Placement:
    """Keep the keys that save the most bytes per byte, within ``budget_bytes - room_bytes``."""
    if budget_bytes < 0 or room_bytes < 0:
        raise TierValueError(f"budget_bytes={budget_bytes} and room_bytes={room_bytes} must be >= 0")
    room_bytes = min(room_bytes, budget_bytes)  # the room is part of the budget
    keys = [k for k in trace.uses() if k not in trace.transient]  # a transient key is never kept
    alone = moved_bytes(trace, frozenset(keys), room_bytes)  # each key's cost with everything streaming
    # What keeping each saves: its cost streaming, less its write where it is written home all the same (as if
    # its group were not all kept: the fill is by key).
    saves = {k: alone[k] - trace.nbytes[k] * (k in trace.written) for k in keys}
    capacity = max(0, budget_bytes - room_bytes)
    resident: set[str] = set()
    used = 0
    for k in sorted(keys, key=lambda k: (-saves[k] / max(trace.nbytes[k], 1), -trace.nbytes[k], k)):
        n = trace.nbytes[k]
        if saves[k] > 0 and used + n <= capacity:
            resident.add(k)
            used += n
    streamed = frozenset(keys) - resident
    moved, forward = _moves(trace, streamed, room_bytes)
    resident_by_kind: dict[str, int] = {}
    moved_by_kind: dict[str, int] = {}
    for k in [*keys, *(k for k in trace.uses() if k in trace.transient)]:
        kind = trace.kinds.get(k, "other")
        if k in resident:
            resident_by_kind[kind] = resident_by_kind.get(kind, 0) + trace.nbytes[k]
        if k not in resident or moved.get(k):  # a resident key moves where it is written home all the same
            moved_by_kind[kind] = moved_by_kind.get(kind, 0) + moved.get(k, 0)
    return Placement(resident=frozenset(resident), budget_bytes=budget_bytes, room_bytes=room_bytes,
                     resident_by_kind=resident_by_kind, moved_by_kind=moved_by_kind,
                     bytes_per_step=sum(moved.values()), lower_bound_bytes=lower_bound_bytes(trace, budget_bytes),
                     forward_bytes=None if trace.forward_events is None else forward)


def room_bytes(budget_bytes: int, *, largest_unit_bytes: int, largest_update_bytes: int,
               units_in_flight: int = 2, behind_bytes: int = 0) -> int:
    """Bytes of the budget to leave for copies in flight: ``units_in_flight`` of the largest unit (one
    computing, the rest read ahead or just used: 2, or a prefetch depth the user fixed plus two), two of the largest
    optimizer update (one stepping, one read ahead) and ``behind_bytes`` of parameters waiting for updates that
    run behind backward (see [Note: Updates behind backward]), or ROOM_SHARE of the budget if more; never more
    than the budget."""
    need = units_in_flight * largest_unit_bytes + 2 * largest_update_bytes + behind_bytes
    return min(budget_bytes, max(need, int(budget_bytes * ROOM_SHARE)))


DEPTH_TOLERANCE = 0.01  # of the step's compute: a deeper read-ahead must save more stall than this to be chosen


def choose_depth(read_seconds: Sequence[float], compute_seconds: Sequence[float], *, max_depth: int) -> int:
    """How many uses ahead to prefetch: the smallest depth whose predicted stall (:func:`predicted_stall`) is
    within DEPTH_TOLERANCE of the step's compute of the least any depth up to ``max_depth`` reaches; at least 2
    where uses wait for reads at every depth (the drive is the bottleneck: one read waits behind the one in
    flight, so the drive never waits for the next use to issue it).

    [Note: Not as deep as the room allows] Reading further ahead than the
    least stall needs hides nothing more and costs: the reads ahead hold room
    (ViT-large moved 1.6% more bytes a step at depth 13 than at 4, copies
    evicted before use and read again) and take the drive ahead of the
    optimizer's reads and writes, which a model of the parameters' reads does
    not see. Measured there (fp32, a third of the state as budget, the
    optimizer stepping in backward, one process taking turns, 6 steps each):
    depth 4 3.52 s a step, 8 3.56 s, 13 (the deepest the room allowed, which
    the depth chose before whenever some read was late at every depth: the
    first units of a step always are) 3.88 s.

    ``read_seconds[i]``: the drive's time for what use i reads; ``compute_seconds[i]``: the time from use i
    to use i+1.
    """
    n = len(read_seconds)
    if len(compute_seconds) != n:
        raise TierValueError("read_seconds and compute_seconds must have one entry per use")
    if max_depth < 1:
        raise TierValueError(f"max_depth={max_depth} must be >= 1")
    if not any(read_seconds):
        return 1
    stalls = [predicted_stall(read_seconds, compute_seconds, depth) for depth in range(1, max_depth + 1)]
    tolerance = max(1e-6, DEPTH_TOLERANCE * sum(compute_seconds))
    depth = next(d for d, stall in enumerate(stalls, 1) if stall <= min(stalls) + tolerance)
    # The first use waits for its own read at any depth; later ones waiting at every depth: the drive is behind.
    behind = min(stalls) - read_seconds[0] > tolerance
    return min(max_depth, 2) if depth == 1 and behind else depth


def predicted_stall(read_seconds: Sequence[float], compute_seconds: Sequence[float], depth: int) -> float:
    """Seconds the uses wait for their reads when use i's reads are issued as use i - depth starts (the first
    ``depth`` uses' when the step starts) and the drive serves them one after another in that order."""
    starts: list[float] = []
    drive_free = stall = 0.0
    for i, read in enumerate(read_seconds):
        issued = starts[i - depth] if i >= depth else 0.0
        drive_free = max(issued, drive_free) + read
        ready = starts[-1] + compute_seconds[i - 1] if i else 0.0
        starts.append(max(ready, drive_free))
        stall += starts[-1] - ready
    return stall


__all__ = ["DEPTH_TOLERANCE", "ROOM_SHARE", "Placement", "StepTrace", "choose_depth", "layered_trace",
           "lower_bound_bytes", "moved_bytes", "plan_placement", "predicted_stall", "room_bytes", "size_text"]
