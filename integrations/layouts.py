"""OffloadedAdamW's state layouts (see [Note: Compressed optimizer state]), public for tools and benchmarks:
the choices (:data:`MOMENTS`, :data:`MASTERS`), :class:`StateLayout` (a choice checked, and the bytes a
parameter's state takes), and the arithmetic one update runs, to measure or check it apart from a model:
:func:`split_master`, :func:`encode_state`, :func:`packed_size`, :func:`compressed_update`, torch's own AdamW
update (:func:`adamw_update`), and :func:`native_kernel_built` (whether the compressed update's C kernel is
built on this machine; the same bits come from torch operations without it)."""

from ._adamw import adamw_update
from ._layouts import (
    MASTERS,
    MIN_COMPRESSED,
    MOMENTS,
    StateLayout,
    compressed_update,
    encode_state,
    packed_size,
    split_master,
)
from ._native import kernel


def native_kernel_built() -> bool:
    """Whether the compressed update's C kernel is built and loaded here (it is built at first use)."""
    return kernel() is not None


__all__ = ["MASTERS", "MIN_COMPRESSED", "MOMENTS", "StateLayout", "adamw_update", "compressed_update",
           "encode_state", "native_kernel_built", "packed_size", "split_master"]
