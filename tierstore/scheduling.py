"""Prefetch and placement: the policies an offload above the store drives (public API of the core).

- :class:`PrefetchPolicy` orders reads ahead of a recorded trace of unit uses, and :class:`LaterUses` and
  :func:`unit_victim_order` say which copies to evict first (Belady's order over the trace);
- :class:`StepTrace`, :func:`plan_placement` and :class:`Placement` choose what stays in the host tier for a
  whole run from one recorded step; :func:`room_bytes` is the host budget left for copies in flight, and
  :func:`choose_depth` the prefetch depth from measured read and compute times; :func:`layered_trace` is the
  trace of a model of equal layers, as ``tierstore plan`` plans it;
- :func:`size_text` and :func:`count_text` print sizes and counts as the placement reports them.
"""

from ._placement import (
    Placement,
    StepTrace,
    choose_depth,
    count_text,
    layered_trace,
    plan_placement,
    room_bytes,
    size_text,
)
from ._schedule import LaterUses, PrefetchPolicy, unit_victim_order

__all__ = ["LaterUses", "Placement", "PrefetchPolicy", "StepTrace", "choose_depth", "count_text", "layered_trace",
           "plan_placement", "room_bytes", "size_text", "unit_victim_order"]
