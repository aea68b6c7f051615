"""A handle on pending work on one key of the store."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from ._types import Tier, TierStoreError


class Handle:
    """Pending work on one key: ``wait()`` blocks and re-raises a failure; ``done()`` polls."""

    def __init__(self, future: Future, key: str, tier: Tier,
                 reported: Callable[[BaseException], None] | None = None) -> None:
        self._future = future
        self.key = key
        self.tier = tier
        self._reported = reported  # told of a failure wait() raised, so the key's next get() does not again

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        try:
            self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException as e:
            if self._reported is not None:
                self._reported(e)
            if isinstance(e, TierStoreError):
                raise
            raise TierStoreError(f"{self.key!r} -> {self.tier.label}: {e!r}") from e

    @property
    def skipped(self) -> bool:
        """True if a prefetch was dropped because its tier was full of held copies."""
        return self._future.done() and self._future.exception() is None and self._future.result() is False

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"Handle({self.key!r}, {self.tier.label}, {state})"
