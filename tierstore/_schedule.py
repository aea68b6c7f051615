"""The prefetch scheduler: a pure policy over a recorded trace of unit uses.

It knows nothing of torch modules or files. The integration tells it when a
step starts and which unit is about to be used; it answers which units to
prefetch now, and, knowing the future order, which copy to evict (the one
whose next use is farthest: Belady's choice).

[Note: Trace then replay] The first step records the order in which units are
used (forward, then backward in its real order, recomputation included). A
later step that follows the trace keeps the next ``depth`` units (or the next
``max_bytes``) in flight. A use that departs from the trace switches to
on-demand fetching for the rest of the step and records a new trace, used from
the next step on; nothing fails or waits because of a departure.

[Note: Who uses a copy next] Eviction ranks every copy by its next use in one
order: a parameter's next use is its unit's next place in the trace; its
optimizer state is used right after the unit's last place in the step (its
backward); once backward is past it, a parameter and its state wait in the
optimizer's queue, whose position counts as the distance. Without the queue
those copies would look unused and go first, and the optimizer, which runs
behind backward, would read them back. The queue comes before the step's
backward: updates streamed into the next forward (``stream_update``) read
their state while that forward runs, and ranked by the backward to come their
reads ahead went first, to be read again two or three times (the 0.17B Llama
layer by layer: 8.5 bytes a parameter of state and 3.5 of gradients read a
step, against 4.2 and 1.9 after backward). A gradient kept for a step taken
after backward is ranked as its parameter's state: the next backward through
the unit adds to it, then the update reads it from the queue.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class PrefetchPolicy:
    """Decides what to prefetch and what to evict from a trace of unit uses."""

    depth: int
    max_bytes: int | None = None
    unit_bytes: dict[Hashable, int] = field(default_factory=dict)
    trace: list[Hashable] | None = None
    last_step: tuple[list[Hashable], list[float]] = field(default_factory=lambda: ([], []))
    """The uses of the last step that started and the clock at each (what ``on_use`` was given)."""
    _recording: list[Hashable] = field(default_factory=list)
    _clock: list[float] = field(default_factory=list)
    _pos: int = 0
    _on_trace: bool = False
    _last_index: tuple = (None, {})
    departures: int = 0
    steps: int = 0
    traces_recorded: int = 0
    """How many times a recorded step became the trace (a new one after each departure)."""
    forward_uses: int | None = None
    """How many of the trace's first uses are its forward: those before :meth:`backward_starts` (None if its step
    had no backward)."""
    _recording_forward: int | None = None

    def start_step(self) -> None:
        """A new step begins: keep the last recorded trace if the step that made it completed."""
        if self._recording and (not self._on_trace or self._pos != len(self.trace or [])):
            self.trace = self._recording
            self.forward_uses = self._recording_forward
            self.traces_recorded += 1
        self.last_step = (self._recording, self._clock)
        self._recording, self._clock, self._recording_forward = [], [], None
        self._pos = 0
        self._on_trace = self.trace is not None
        self.steps += 1

    def on_use(self, unit: Hashable, clock: float = 0.0) -> list[Hashable]:
        """``unit`` is about to be used (at ``clock``: seconds of compute so far); returns the units to prefetch
        now (in use order)."""
        self._recording.append(unit)
        self._clock.append(clock)
        if not self._on_trace:
            return []
        assert self.trace is not None
        if self._pos < len(self.trace) and self.trace[self._pos] == unit:
            self._pos += 1
            return self.lookahead()
        self._on_trace = False  # departed: on-demand for the rest of this step
        self.departures += 1
        return []

    def backward_starts(self) -> None:
        """The step's backward begins: the uses from here on are not its forward's."""
        if self._recording_forward is None:
            self._recording_forward = len(self._recording)

    @property
    def on_trace(self) -> bool:
        return self._on_trace

    def lookahead(self) -> list[Hashable]:
        """The next units the trace says will be used, bounded by depth and bytes."""
        if not self._on_trace or self.trace is None or self.depth == 0:
            return []
        out: list[Hashable] = []
        total = 0
        for g in self.trace[self._pos:]:
            if len(out) >= self.depth:
                break
            nbytes = self.unit_bytes.get(g, 0)
            if self.max_bytes is not None and out and total + nbytes > self.max_bytes:
                break
            if g not in out:
                out.append(g)
                total += nbytes
        return out

    def _now(self) -> int:
        """The trace index distances count from: that of the latest :meth:`on_use` (see next_use_distance)."""
        return max(self._pos - 1, 0)

    def next_use_distance(self, unit: Hashable) -> float:
        """How many uses from now ``unit`` is next needed (inf if not in the rest of the trace).

        The unit of the latest :meth:`on_use` is at distance 0: it is being fetched for use now, and
        must not look unused to an eviction that runs before it is held.
        """
        if not self._on_trace or self.trace is None:
            return float("inf")
        now = self._now()
        try:
            return self.trace.index(unit, now) - now
        except ValueError:
            return float("inf")

    def forward_use_distance(self, unit: Hashable) -> float:
        """How many uses from now the running forward next uses ``unit`` (inf if the step is off its trace, its
        forward is done or it uses ``unit`` no more)."""
        d = self.next_use_distance(unit)
        end = self.forward_uses if self.forward_uses is not None else len(self.trace or ())
        return d if self._now() + d < end else float("inf")

    def last_use_distance(self, unit: Hashable) -> float:
        """How many uses from now ``unit`` is used for the last time in this step (inf if no more)."""
        if not self._on_trace or self.trace is None:
            return float("inf")
        if self._last_index[0] is not self.trace:
            self._last_index = (self.trace, {g: i for i, g in enumerate(self.trace)})
        now = self._now()
        last = self._last_index[1].get(unit, -1)
        return last - now if last >= now else float("inf")

    def victim_order(self, candidates: Sequence[Hashable]) -> list[Hashable]:
        """Candidates ordered farthest next use first (Belady); ties keep their given order."""
        return sorted(candidates, key=lambda g: -self.next_use_distance(g))


@dataclass
class LaterUses:
    """Uses of store keys that the trace does not record: an optimizer's (see [Note: Who uses a copy next]).

    Written by the training thread when an optimizer is made; read by any thread that evicts, inside the store's
    lock."""

    after: dict[str, str] = field(default_factory=dict)
    """Key -> the parameter key after whose last use in a step it is used (optimizer state)."""
    grads: dict[str, str] = field(default_factory=dict)
    """Gradient key -> its parameter's key: a gradient kept from backward to the optimizer's step is used by the
    next backward through its parameter (which adds to it) and by the update (in a queue), as state is."""
    in_backward: bool = True
    """Whether the optimizer steps each parameter in backward, right after its last use (else after it)."""
    grads_to_step: bool = False
    """Whether each gradient is kept in the store until the step though updated in backward (speculated)."""


def unit_victim_order(policy: PrefetchPolicy, key_units: Mapping[str, Sequence[Hashable]],
                       later: LaterUses | None = None, *,
                       waiting: Callable[[], Mapping[str, int]] | None = None) -> Callable[[object, list[str]],
                                                                                          list[str]]:
    """A store victim order (see ``TierStore.set_victim_order``) from ``policy``: keys whose next use is
    farthest from now go first (Belady).

    The next use of a key is the nearest next use in the trace of the units that use it (``key_units``:
    parameters; a tied or shared parameter is used by several); else, for a key in ``waiting()`` (the keys an
    optimizer's queue or a step will use next, with how far away each use is; a snapshot, asked once an order),
    its position there; else, for a key of ``later.after`` or ``later.grads``, the last use in this step of its
    parameter's units, plus a half; else never (inf), and those go first of all. ``key_units`` may grow while it
    is installed.
    """
    inf = float("inf")

    def order(tier: object, keys: list[str]) -> list[str]:
        queued = waiting() if waiting is not None else {}
        after = later.after if later is not None else {}
        grads = later.grads if later is not None else {}
        memo: dict[tuple[str, Hashable], float] = {}

        def unit_distance(how: str, g: Hashable) -> float:
            if (how, g) not in memo:
                memo[how, g] = (policy.next_use_distance(g) if how == "next" else policy.last_use_distance(g))
            return memo[how, g]

        def nearest(how: str, k: str | None) -> float:
            units = key_units.get(k, ()) if k is not None else ()
            return min((unit_distance(how, g) for g in units), default=inf)

        def distance(k: str) -> float:
            if (d := nearest("next", k)) != inf:
                return d
            if k in queued:  # an update queued now reads it before its parameter's use in this step
                return queued[k]
            if (d := nearest("last", after.get(k) or grads.get(k))) != inf:
                return d + 0.5
            return inf

        return sorted(keys, key=lambda k: -distance(k))

    return order
