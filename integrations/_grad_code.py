"""A speculated update's kept gradient, coded against the first moment the update read and made.

[Note: A kept gradient coded against its moments] An update made in backward before the clip is known keeps its
gradient until ``step()`` decides (see [Note: Speculated updates] in _speculated.py), and where the host tier has
no room for it the gradient is written to the drive: 4 bytes a parameter a step in fp32 that the loop stepping in
backward never writes, read back only where the update is undone. The update itself holds most of that
gradient's bits: AdamW's first moment became ``m' = lerp(m, g, 1 - beta1)``, so ``m + (m' - m) / (1 - beta1)``
(the prediction) is ``g`` but for the rounding of ``m'``, a few units in the last place of ``g`` where ``|m|`` is
not much larger than ``|g|``. Both moments stay readable until ``step()`` decides: the one before is the kept
version (see [Note: Kept versions] in tierstore/_versions.py), the one after is the state. So the kept gradient
is stored as one signed byte an element, the difference of the bit patterns of ``g`` and of the prediction (-127
marks +0.0, which ReLU and masked tokens make common; -128 an element kept whole, its 4 bytes after the codes, in
element order), and decoding computes the same prediction from the same bits (the kernel's arithmetic, one
IEEE operation each) and adds: exactly the gradient, whatever its values (NaN and infinities are kept whole). On
the anchor model of docs/optimizer.md 0.1-0.8% of the elements are kept whole.

Who does what: the worker copies the moment before each update (into one of two buffers it reuses: fresh ones
cost 300,000 page faults a step there, more than the coding) and holds the moment after it and the gradient for
the coder, a thread of its own, which codes (5 ms for 4M elements here) and puts the code in the store in place of
the gradient (``GradientStore.keep_coded``). Coded on the worker, the anchor's step took 2.61-2.67 s against 2.25
without coding: the worker's updates are the step's longest path there. Where the coder is still busy with both
buffers the worker does not wait: that gradient is kept as it is. Decoding happens where the update is undone,
on the worker (it may read the fenced moment after the update, then restores the one before it), and anything
else that reads a coded gradient's values (``p.grad`` beyond its norm and products by a number, a second
backward adding to it) undoes the speculated updates first, which decodes it.

It is ``OffloadedAdamW(code_grads=True)``, off by default: once the speculated worker read ahead as far as the
worker stepping in backward (see [Note: Updates behind backward] in _placing.py) the anchor's step was bound by
the drive and the CPU both on this 2-core machine, and the coder's CPU cost more than its bytes saved (one run,
alternating: 2.05-2.12 s a step coded, 1.82-1.84 kept as they are, 0.3-0.4 GB a step more; the step in backward
1.63-1.66 s).

A gradient is coded only where the code can stand for it until it goes: an fp32 gradient of an update whose first
moment is fp32 (torch's arithmetic: ``layout.is_plain``), not maximized, with ``keep_grads=False`` (a committed
update's gradient goes at ``step()``, and a kept one would outlive the moment it decodes from), of at least
``MIN_CODED`` elements (on the anchor model coding its biases made 45 writes of 4 KiB a step) and at most
``_adamw.WHOLE_MAX`` elements (the copy of the moment and the code's buffer are outside the tier budgets, as the
update's temporaries are: two sets, 24 MiB each at most), where the kernel is built (torch operations for it cost
more than the bytes they save: the anchor's step took 4.4 s against 2.3), and not FSDP2's gradient shards; where
more than a quarter of the elements would be kept whole, the gradient is kept as it is.
"""

from __future__ import annotations

import ctypes

import torch

from . import _native
from ._adamw import WHOLE_MAX

_ESCAPED_SHARE = 4  # at most one element in this many kept whole, else the gradient stays as it is
MIN_CODED = 4096  # elements: a smaller gradient is kept as it is (its code would be one more small write)


_cache: dict[int, tuple] = {}  # id(the kernel) -> (it, its two functions or None)


def _functions() -> tuple | None:
    fn = _native.kernel(warn=False)
    if id(fn) in _cache:
        return _cache[id(fn)][1]
    code = _native.function("tierstore_grad_code",
                            [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64)
    decode = _native.function("tierstore_grad_decode",
                              [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_float, ctypes.c_void_p], None)
    found = None if code is None or decode is None else (code, decode)
    _cache[id(fn)] = (fn, found)
    return found


def available() -> bool:
    """Whether gradients can be coded here (the native kernel is built)."""
    return _functions() is not None


def codable(grad: torch.Tensor, exp_avg: torch.Tensor) -> bool:
    """Whether ``grad`` may be coded against ``exp_avg`` (see [Note: A kept gradient coded against its moments])."""
    return (grad.dtype == exp_avg.dtype == torch.float32 and MIN_CODED <= grad.numel() == exp_avg.numel() <= WHOLE_MAX
            and grad.is_contiguous() and exp_avg.is_contiguous())


def _inverse(beta1: float) -> float:
    return 1.0 / (1.0 - beta1)


class Coder:
    """Codes gradients on one thread into buffers it keeps: fresh ones of this size cost more in page faults than
    the coding itself (measured on the anchor model: 300,000 faults a step, 0.5 s of system time)."""

    def __init__(self) -> None:
        self._before = torch.empty(0)
        self._out = torch.empty(0, dtype=torch.uint8)

    def snapshot(self, exp_avg: torch.Tensor) -> torch.Tensor:
        """A copy of the first moment before the update, valid until the next call."""
        n = exp_avg.numel()
        if self._before.numel() < n:
            self._before = torch.empty(n)
        before = self._before[:n]
        before.copy_(exp_avg.view(-1))
        return before

    def code(self, grad: torch.Tensor, before: torch.Tensor, after: torch.Tensor, beta1: float) -> torch.Tensor | None:
        """``grad`` coded against the first moment ``before`` and ``after`` the update (uint8, valid until the next
        call), or None where too many of its elements would be kept whole (or the kernel is not built)."""
        fns = _functions()
        if fns is None:
            return None
        n = grad.numel()
        cap = n // _ESCAPED_SHARE
        if self._out.numel() < n + 4 * cap:
            self._out = torch.empty(n + 4 * cap, dtype=torch.uint8)
        out = self._out
        escaped = fns[0](n, grad.data_ptr(), before.data_ptr(), after.data_ptr(), _inverse(beta1), out.data_ptr(),
                         out.data_ptr() + n, cap)
        return None if escaped < 0 else out[:n + 4 * escaped]


def decode(coded: torch.Tensor, before: torch.Tensor, after: torch.Tensor, beta1: float,
           out: torch.Tensor) -> None:
    """Into ``out`` (fp32, contiguous, the gradient's elements): the gradient ``Coder.code`` coded from the same
    moments."""
    fns = _functions()
    assert fns is not None, "a gradient was coded, so the kernel is built"
    n = out.numel()
    assert coded.numel() >= n and before.numel() == after.numel() == n and out.is_contiguous()
    fns[1](n, coded.data_ptr(), coded.data_ptr() + n, before.data_ptr(), after.data_ptr(), _inverse(beta1),
           out.data_ptr())


__all__ = ["Coder", "available", "codable", "decode"]
