"""Counters of bytes, seconds, hits and stalls, read out as one plain dict."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from ._timeline import Timeline
from ._types import Tier


class StoreStats:
    """Thread-safe counters; :meth:`snapshot` returns them as a plain dict."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread = threading.local()
        self.timeline: Timeline | None = None
        self.reset()

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        """Waits on this thread inside the block are a helper's (an optimizer worker's), which the
        training loop does not wait for directly: counted as background_wait_seconds, not stall."""
        before = getattr(self._thread, "background", False)
        self._thread.background = True
        try:
            yield
        finally:
            self._thread.background = before

    def add_wait(self, start: float, end: float, **labels: Any) -> None:
        """A wait for data from ``start`` to ``end`` on this thread: stall, or a background wait."""
        background = getattr(self._thread, "background", False)
        self.add("background_wait_seconds" if background else "stall_seconds", end - start)
        if self.timeline is not None:
            self.timeline.add("wait" if background else "stall", "background wait" if background else "stall",
                              start, end, **labels)

    def reset(self) -> None:
        with self._lock:
            self._paths: dict[str, dict[str, float]] = {}
            self._counters: dict[str, float] = {
                "hits": 0, "misses": 0, "get_calls": 0, "stall_seconds": 0.0, "background_wait_seconds": 0.0,
                "queue_wait_seconds": 0.0, "io_calls": 0, "evictions": 0, "write_backs": 0, "budget_waits": 0,
                "prefetches": 0, "prefetch_skipped": 0, "late_prefetches": 0, "kept_evictions": 0,
                "read_busy_seconds": 0.0, "write_busy_seconds": 0.0, "fenced_waits": 0, "fenced_wait_seconds": 0.0,
                "updates_streamed": 0, "updates_speculated": 0, "speculated_kept": 0, "speculated_undone": 0,
                "gradients_coded": 0,
            }
            self._busy: dict[str, tuple[int, float]] = {}  # "read"/"write" -> (calls in flight, since when)

    def io_begins(self, what: str, queued_seconds: float) -> None:
        """An I/O call of kind ``what`` ("read" or "write") starts after ``queued_seconds`` in the queue: the
        seconds during which at least one is in flight count as ``{what}_busy_seconds``, so bytes over them is the
        drive's rate, however many overlap. One lock for all of it: this runs for every block."""
        with self._lock:
            self._counters["queue_wait_seconds"] += queued_seconds
            n, since = self._busy.get(what, (0, 0.0))
            self._busy[what] = (n + 1, time.perf_counter() if n == 0 else since)

    def io_ends(self, what: str, calls: int) -> None:
        """The call :meth:`io_begins` counted is done, after ``calls`` syscalls."""
        with self._lock:
            self._counters["io_calls"] += calls
            n, since = self._busy[what]
            self._busy[what] = (n - 1, since)
            if n == 1:
                self._counters[f"{what}_busy_seconds"] += time.perf_counter() - since

    def add_transfer(self, src: Tier, dst: Tier, nbytes: int, seconds: float, label: str | None = None) -> None:
        """A finished transfer of ``nbytes`` that took ``seconds`` (ending now, on this thread)."""
        key = f"{src.label}->{dst.label}"
        if self.timeline is not None:
            end = time.perf_counter()
            self.timeline.add(key, "transfer", end - seconds, end, key=label, bytes=nbytes)
        with self._lock:
            p = self._paths.setdefault(key, {"count": 0, "bytes": 0, "seconds": 0.0})
            p["count"] += 1
            p["bytes"] += nbytes
            p["seconds"] += seconds

    def add(self, counter: str, amount: float = 1) -> None:
        with self._lock:
            self._counters[counter] += amount

    def counter(self, name: str) -> float:
        with self._lock:
            return self._counters[name]

    def path(self, key: str) -> tuple[float, float]:
        """(bytes, seconds) moved so far over one tier-to-tier path, such as "nvme->host"."""
        with self._lock:
            p = self._paths.get(key)
            return (p["bytes"], p["seconds"]) if p else (0, 0.0)

    def snapshot(self) -> dict[str, Any]:
        """Every counter, plus per tier-to-tier path its count, bytes, seconds and GB/s."""
        with self._lock:
            paths = {}
            for key, p in sorted(self._paths.items()):
                gbps = p["bytes"] / p["seconds"] / 1e9 if p["seconds"] > 0 else 0.0
                paths[key] = {**p, "gbps": gbps}
            out: dict[str, Any] = dict(self._counters)
            out["paths"] = paths
            out["bytes_read_nvme"] = sum(p["bytes"] for k, p in paths.items() if k.startswith("nvme->"))
            out["bytes_written_nvme"] = sum(p["bytes"] for k, p in paths.items() if k.endswith("->nvme"))
            return out
