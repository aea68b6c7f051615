"""A record of every transfer and every compute span, written as a Chrome trace that Perfetto opens.

[Note: Reading a timeline] Each thread is a row: the training thread shows
compute spans (forward and backward of each parameter group, optimizer
steps) and, in red, ``stall`` spans where compute waited on I/O; the I/O and
mover threads show each transfer (``nvme->host``, ``host->device``...) with
its key and bytes. A well-hidden read ends before the compute span that uses
it starts; a stall is a read that is still running when its compute wants it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Timeline:
    """Thread-safe list of spans; :meth:`write_chrome_trace` saves them as Trace Event JSON."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._threads: dict[int, str] = {}
        self._origin = time.perf_counter()

    def add(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        """A span from ``start`` to ``end`` (``time.perf_counter()`` seconds) on the calling thread."""
        thread = threading.current_thread()
        event = {"name": name, "cat": category, "ph": "X", "pid": os.getpid(), "tid": thread.ident,
                 "ts": (start - self._origin) * 1e6, "dur": max(0.0, end - start) * 1e6}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)
            self._threads.setdefault(thread.ident or 0, thread.name)

    @contextmanager
    def span(self, name: str, category: str, **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, category, start, time.perf_counter(), **args)

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def write_chrome_trace(self, path: str | os.PathLike) -> int:
        """Write the spans as Chrome Trace Event JSON (open it at ui.perfetto.dev); returns the event count."""
        with self._lock:
            events = list(self._events)
            names = [{"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid, "args": {"name": name}}
                     for tid, name in self._threads.items()]
        with open(path, "w") as f:
            json.dump({"traceEvents": names + events, "displayTimeUnit": "ms"}, f)
        return len(events)


__all__ = ["Timeline"]
