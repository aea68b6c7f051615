"""The process's resident set size and its peak, with a resettable peak on Linux."""

from __future__ import annotations

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


def peak_rss_bytes() -> int:
    """Peak RSS since start or since the last :func:`reset_peak_rss` (current RSS where VmHWM is unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return psutil.Process().memory_info().rss


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


__all__ = ["peak_rss_bytes", "reset_peak_rss", "rss_bytes", "write_kernel_control"]
