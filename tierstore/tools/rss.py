"""The process's resident set size and its peak, with a resettable peak on Linux."""

from __future__ import annotations

import threading
import time

import psutil


def write_kernel_control(path: str, value: str) -> bool:
    """Write ``value`` to a kernel control file under /proc; False where it is missing or not permitted."""
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where the kernel refuses."""
    return write_kernel_control("/proc/self/clear_refs", "5")


def _status_bytes(field: str) -> int | None:
    """A size this process's /proc/self/status gives (``VmHWM``, ``RssAnon``), or None where it gives none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak RSS since start or since the last :func:`reset_peak_rss` (current RSS where VmHWM is unknown)."""
    peak = _status_bytes("VmHWM")
    return rss_bytes() if peak is None else peak


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def anon_rss_bytes() -> int:
    """The part of the RSS that no file backs (``RssAnon``): what the kernel cannot drop, with no swap, while the
    process lives. Pages mapped from files (a mapped copy's: see [Note: Tensors mapped from a file]) count in the
    RSS but not here. The whole RSS where the kernel does not say."""
    anon = _status_bytes("RssAnon")
    return rss_bytes() if anon is None else anon


class AnonRssPeak:
    """The peak of :func:`anon_rss_bytes` while a ``with`` block runs, sampled on a thread every
    ``interval_seconds`` (and at the block's start and end); ``peak_bytes`` once it ends. A sample can miss a
    spike shorter than the interval."""

    def __init__(self, interval_seconds: float = 0.002) -> None:
        self.interval_seconds = interval_seconds
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, anon_rss_bytes())
            time.sleep(self.interval_seconds)

    def __enter__(self) -> "AnonRssPeak":
        self.peak_bytes = anon_rss_bytes()
        self._thread = threading.Thread(target=self._sample, name="anon-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, anon_rss_bytes())


__all__ = ["AnonRssPeak", "anon_rss_bytes", "peak_rss_bytes", "reset_peak_rss", "rss_bytes", "write_kernel_control"]
