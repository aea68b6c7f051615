"""The prefetch scheduler: a pure policy over a recorded trace of group uses.

It knows nothing of torch modules or files. The integration tells it when a
step starts and which group is about to be used; it answers which groups to
prefetch now, and, knowing the future order, which copy to evict (the one
whose next use is farthest: Belady's choice).

[Note: Trace then replay] The first step records the order in which groups are
used (forward, then backward in its real order, recomputation included). A
later step that follows the trace keeps the next ``depth`` groups (or the next
``max_bytes``) in flight. A use that departs from the trace switches to
on-demand fetching for the rest of the step and records a new trace, used from
the next step on; nothing fails or waits because of a departure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence


@dataclass
class PrefetchPolicy:
    """Decides what to prefetch and what to evict from a trace of group uses."""

    depth: int
    max_bytes: int | None = None
    group_bytes: dict[Hashable, int] = field(default_factory=dict)
    trace: list[Hashable] | None = None
    _recording: list[Hashable] = field(default_factory=list)
    _pos: int = 0
    _on_trace: bool = False
    departures: int = 0
    steps: int = 0

    def start_step(self) -> None:
        """A new step begins: keep the last recorded trace if the step that made it completed."""
        if self._recording and (not self._on_trace or self._pos != len(self.trace or [])):
            self.trace = self._recording
        self._recording = []
        self._pos = 0
        self._on_trace = self.trace is not None
        self.steps += 1

    def on_use(self, group: Hashable) -> list[Hashable]:
        """``group`` is about to be used; returns the groups to prefetch now (in use order)."""
        self._recording.append(group)
        if not self._on_trace:
            return []
        assert self.trace is not None
        if self._pos < len(self.trace) and self.trace[self._pos] == group:
            self._pos += 1
            return self.lookahead()
        self._on_trace = False  # departed: on-demand for the rest of this step
        self.departures += 1
        return []

    @property
    def on_trace(self) -> bool:
        return self._on_trace

    def lookahead(self) -> list[Hashable]:
        """The next groups the trace says will be used, bounded by depth and bytes."""
        if not self._on_trace or self.trace is None or self.depth == 0:
            return []
        out: list[Hashable] = []
        total = 0
        for g in self.trace[self._pos:]:
            if len(out) >= self.depth:
                break
            nbytes = self.group_bytes.get(g, 0)
            if self.max_bytes is not None and out and total + nbytes > self.max_bytes:
                break
            if g not in out:
                out.append(g)
                total += nbytes
        return out

    def next_use_distance(self, group: Hashable) -> float:
        """How many uses from now ``group`` is next needed (inf if not in the rest of the trace)."""
        if not self._on_trace or self.trace is None:
            return float("inf")
        try:
            return self.trace.index(group, self._pos)
        except ValueError:
            return float("inf")

    def victim_order(self, candidates: Sequence[Hashable]) -> list[Hashable]:
        """Candidates ordered farthest next use first (Belady); ties keep their given order."""
        return sorted(candidates, key=lambda g: -self.next_use_distance(g))


def group_victim_order(policy: PrefetchPolicy, key_group: dict[str, Hashable]) -> Callable[[object, list[str]], list[str]]:
    """A store victim order (see ``TierStore.set_victim_order``) from ``policy``: keys whose group is
    next used farthest from now go first; keys of no group count as never used again."""

    def order(tier: object, keys: list[str]) -> list[str]:
        far = {g: policy.next_use_distance(g) for g in {key_group.get(k) for k in keys} if g is not None}
        return sorted(keys, key=lambda k: -far.get(key_group.get(k), float("inf")))

    return order
