"""The process's C allocator, set once so that memory tensors free goes back to the system.

[Note: Giving freed memory back] torch allocates CPU tensors with glibc's
malloc. glibc serves a request above its mmap threshold with a mapping of its
own, returned to the system on free; below it, from heaps that keep what is
freed. The threshold starts at 128 KiB, but every time a mapped block is freed
glibc raises it to that block's size (up to 32 MiB), so after the first few
steps the gradients, activations and temporaries of a training step all come
from the heaps, which grow to the largest step's worth and stay there: RSS
grows with the model although every tier is within its budget. The store
fixes the threshold when it is created (``mallopt(M_MMAP_THRESHOLD)``, what
the environment variable ``MALLOC_MMAP_THRESHOLD_`` does at start-up), which
also stops the adjustment. It is a setting of the whole process, made once;
``StoreConfig(malloc_mmap_threshold_bytes=None)`` leaves the allocator alone,
and so does any C library that is not glibc.

The default, 128 KiB (glibc's own starting value), keeps RSS within the
budgets whatever the sizes of a model's tensors, at a cost in compute: every
tensor above it is a fresh mapping whose pages are faulted in at each use.
Measured here (each in a fresh process): 671M parameters built on meta, host
budget 512 MiB, 2 steps: the whole process peaked at 873 MiB with 2
micro-batches and clipping and 1005 MiB stepping in backward, against 1298
and 1504 left alone; a resident ViT-large step (medians of 4) took 3.07-3.29 s
against 2.47-2.77 left alone. A larger threshold trades the two: at 8 MiB the
671M run peaked at 896 and 1034 MiB and the ViT-large step took 2.42-2.49 s,
but a model of 10.5M parameters (4 MiB weights, below it) then kept 1.4-1.7x
the memory the budgets allow (those blocks stay in the heaps); at 32 MiB the
671M run peaked as if left alone. Set ``malloc_mmap_threshold_bytes`` to 8 MiB
for speed where the model's tensors are larger than that, None to leave the
allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_M_MMAP_THRESHOLD = -3  # from glibc's malloc.h
_lock = threading.Lock()
_set_to: int | None = None


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (see [Note: Giving freed memory back]); False where the C library
    is not glibc or refused the value. Idempotent: a second store with the same setting changes nothing."""
    global _set_to
    with _lock:
        if _set_to == nbytes:
            return True
        libc = _libc()
        if libc is None:
            return False
        ok = bool(libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(nbytes)))
        if ok:
            _set_to = nbytes
        return ok


def mmap_threshold() -> int | None:
    """The threshold a store set in this process, or None if none did."""
    return _set_to
