"""Byte-budgeted pools of page-aligned, pre-faulted buffers, one per memory tier.

[Note: Allocate once, reuse] First touch of fresh memory costs about as much
as reading the drive, and reads into a few recycled small buffers run far
slower than reads into memory already faulted in. So a pool keeps freed
buffers by size and hands them out again; it gives memory back only when a
request of another size would otherwise not fit in the budget.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ._types import Tier

PAGE_BYTES = 4096


def align_up(n: int, alignment: int = PAGE_BYTES) -> int:
    return (n + alignment - 1) // alignment * alignment


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose data starts on a page boundary, pre-faulted."""
    raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=pin)
    offset = (-raw.data_ptr()) % PAGE_BYTES
    buf = raw[offset:offset + nbytes]
    buf.zero_()
    return buf


@dataclass(eq=False)
class Buffer:
    """A reusable block of tier memory; ``data`` is a flat uint8 tensor of ``capacity`` bytes."""

    data: torch.Tensor
    capacity: int
    tier: Tier
    # Work that still reads or writes this buffer (a CUDA event); it must finish before reuse.
    pending: list = field(default_factory=list)

    def view(self, shape: torch.Size, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=self.data.device)
        return self.data[:nbytes].view(dtype).view(shape)

    def wait_pending(self) -> None:
        for event in self.pending:
            event.synchronize()
        self.pending.clear()


class TierPool:
    """Hands out buffers of one tier without ever holding more than ``budget_bytes``."""

    def __init__(self, tier: Tier, budget_bytes: int, device: torch.device, *, pin: bool = False) -> None:
        self.tier = tier
        self.budget_bytes = budget_bytes
        self.device = device
        self.pin = pin
        self._lock = threading.Lock()
        self._free: dict[int, list[Buffer]] = {}
        self.held_bytes = 0  # live + pooled
        self.live_bytes = 0
        self.peak_held_bytes = 0

    @staticmethod
    def capacity_for(nbytes: int) -> int:
        return align_up(max(nbytes, 1))

    def try_alloc(self, nbytes: int) -> Buffer | None:
        """A buffer of at least ``nbytes``, or None if the budget cannot hold one now."""
        cap = self.capacity_for(nbytes)
        with self._lock:
            bucket = self._free.get(cap)
            reused = bucket.pop() if bucket else None
            if reused is not None:
                self.live_bytes += cap
        if reused is not None:
            reused.wait_pending()
            return reused
        with self._lock:
            if self.held_bytes + cap > self.budget_bytes:
                self._trim_locked(self.held_bytes + cap - self.budget_bytes)
                if self.held_bytes + cap > self.budget_bytes:
                    return None
            self.held_bytes += cap
            self.live_bytes += cap
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        try:
            buf = Buffer(self._new(cap), cap, self.tier)
        except BaseException:
            with self._lock:
                self.held_bytes -= cap
                self.live_bytes -= cap
            raise
        return buf

    def _new(self, cap: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return aligned_empty(cap, pin=self.pin)
        return torch.empty(cap, dtype=torch.uint8, device=self.device)

    def _trim_locked(self, want: int) -> None:
        for cap in sorted(self._free, reverse=True):
            bucket = self._free[cap]
            while bucket and want > 0:
                buf = bucket.pop()
                buf.wait_pending()
                self.held_bytes -= cap
                want -= cap
            if not bucket:
                del self._free[cap]
            if want <= 0:
                return

    def free(self, buf: Buffer) -> None:
        with self._lock:
            self.live_bytes -= buf.capacity
            self._free.setdefault(buf.capacity, []).append(buf)

    def clear(self) -> None:
        with self._lock:
            self._trim_locked(self.held_bytes)
