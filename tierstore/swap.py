"""Swap directories and caches on disk (public API of the core): where a store puts its files by default,
where the project caches what it builds, and reclaiming what dead processes left (``tierstore gc``)."""

from ._config import default_nvme_path, user_cache_path
from ._ownership import Reclaimed, describe, reclaim_swap

__all__ = ["Reclaimed", "default_nvme_path", "describe", "reclaim_swap", "user_cache_path"]
