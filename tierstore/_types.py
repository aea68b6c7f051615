"""The vocabulary that crosses module boundaries: tiers, copy states, errors."""

from __future__ import annotations

import enum
from typing import Protocol


class Tier(enum.IntEnum):
    """A level of the memory hierarchy; a smaller value is a faster tier."""

    DEVICE = 0
    HOST = 1
    NVME = 2

    @classmethod
    def parse(cls, value: Tier | str) -> Tier:
        """Accept a Tier or its name in any case ('nvme', 'HOST', ...)."""
        if isinstance(value, Tier):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        choices = ", ".join(t.name.lower() for t in cls)
        raise TierValueError(f"unknown tier {value!r}; choose one of: {choices}")

    @property
    def label(self) -> str:
        return self.name.lower()


class TierStoreError(RuntimeError):
    """Base class of every error tierstore raises. Each is also the builtin error a caller would catch for its
    kind: a bad argument is also a ``ValueError``, a wrong type a ``TypeError``, an unknown key a ``KeyError``."""


class TierValueError(TierStoreError, ValueError):
    """An argument, setting or input that cannot be used; the message says what to pass instead."""


class TierTypeError(TierStoreError, TypeError):
    """An argument of a type that cannot be used; the message names the types that can."""


class TierKeyError(TierStoreError, KeyError):
    """No such key in the store, parameter of the model or state of the optimizer."""


class UnsupportedError(TierStoreError, NotImplementedError):
    """Something tierstore does not do (a kind of adapter it cannot merge, a device that pins nothing)."""


class TierOSError(TierStoreError, OSError):
    """A call into the operating system, or a tool it runs (the C compiler), failed; names the call."""


class UnknownSettingError(TierStoreError, TypeError, ValueError):
    """A setting the store's config does not have: the same error from ``TierStore(**settings)``, ``from_dict``
    and a config file (a ``TypeError`` as for any unknown keyword, a ``ValueError`` as for any bad value)."""


class StoreClosedError(TierStoreError):
    """The store was used after close()."""


class StoreInUseError(TierStoreError):
    """``close()`` of a store that holds values only it keeps (an offloaded model's trained weights) which cannot
    be given back now; nothing was closed, and the message says what to call first."""


class StoreUser(Protocol):
    """What keeps values in a store that exist nowhere else (an offloaded model), told when the store closes so
    that nothing is lost: ``close()`` asks every user for ``close_refusal()`` first and closes nothing when one
    refuses, then calls ``store_closing()`` on each, which gives its values back and detaches. Both are called on
    the thread that calls ``close()``, without the store's lock (they use the store's public methods)."""

    def close_refusal(self, claimed: dict[str, int]) -> str | None:
        """Why its values cannot be given back now (more than the memory free to hold them, a forward running),
        saying what to call first; None when they can. ``claimed``: memory (device name -> bytes) the users
        asked before it will take for theirs; one that can give its values back adds its own."""
        ...

    def store_closing(self) -> None:
        """Give the values back (out of the store) and stop using it."""
        ...


class FencedWriteError(TierStoreError):
    """Work queued to change a key failed (see ``TierStore.fence``): the key's value cannot be trusted."""


class TierBudgetError(TierStoreError):
    """A tier cannot hold a request within its byte budget."""


class RoomYieldedError(TierBudgetError):
    """An allocation of a thread that gives way (``TierStore.giving_way``) stopped, because another thread was
    waiting for room in the same tier (see [Note: Waiting for room])."""


class TierIOError(TierStoreError):
    """A read or write of the NVMe tier failed; names the key and the file."""


class StoreFullError(TierIOError):
    """The filesystem under nvme_path has too little free space."""


class IntegrityError(TierIOError):
    """Bytes read back from the NVMe tier do not match their checksum."""


class CheckpointError(TierStoreError):
    """A checkpoint cannot be loaded as it is (a damaged or edited manifest, a missing file, a tensor that does
    not match the model); names the file and the entry. Raised before anything is loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint (no manifest) where one was asked for."""


class CheckpointWriteError(CheckpointError, TierIOError):
    """A checkpoint could not be written (a full disk, a lost mount); names the file and the bytes it needed. The
    previous checkpoint at that path is untouched."""


class CheckpointIntegrityError(CheckpointError, IntegrityError):
    """A checkpoint's bytes do not match the checksum its manifest records."""
