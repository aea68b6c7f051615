"""The tiers' memory (public API of the core): what an offload above the store sizes and lays out tensors by.

- :class:`TierPool` is a tier's budgeted pool (``TierPool.capacity_for(n)``: the bytes a tensor of ``n`` bytes
  takes there) and :data:`PAGE_BYTES` its unit; :func:`aligned_empty` a page-aligned, pre-faulted buffer;
- :func:`dense_strides` and :func:`contiguous_strides` are the layouts the store keeps a tensor's bytes in;
- :func:`set_mmap_threshold` is the allocator setting a store makes (see [Note: Giving freed memory back]),
  for code that measures beside a store under the same setting;
- :func:`give_back_pages` asks the kernel to reclaim the pages of tensors a load has consumed where a file backs
  them (see [Note: Loaded pages given back]).
"""

from ._allocator import set_mmap_threshold
from ._copies import contiguous_strides, dense_strides
from ._mapped import give_back_pages
from ._memory import PAGE_BYTES, TierPool, aligned_empty

__all__ = ["PAGE_BYTES", "TierPool", "aligned_empty", "contiguous_strides", "dense_strides", "give_back_pages",
           "set_mmap_threshold"]
