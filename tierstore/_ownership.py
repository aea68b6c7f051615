"""Who owns a swap or checkpoint-staging directory, and reclaiming those whose owner is gone.

[Note: Owned directories] A directory a live process writes into holds a
lock file on which that process keeps an exclusive ``flock`` for as long as
it uses the directory. The kernel drops the lock when the process dies, by
any signal, SIGKILL included, so "can I take the lock?" is the question of
whether the owner is gone, and it cannot be wrong about a live process on
this machine. A swap directory is made under a hidden name, locked, then
renamed to ``tierstore-*``: every ``tierstore-*`` directory a current store
made is locked from its first moment. A lock file itself is made under a
name of its own, locked, and then linked in, so no process ever finds a live
owner's lock file unlocked (two ranks starting on one path, each reclaiming
what the dead left, would otherwise remove each other's new directory). The
lock file also records the
owner (pid, the process's start time, the boot id, the host) for a person.
A checkpoint's staging directory keeps its lock file beside it
(``<dir>.lock``), since the directory itself becomes the checkpoint.
Directories with no lock file (made by an older version, or by a process
killed while making one) are reclaimed only once nothing in them has been
written for ``STALE_SECONDS``, since a live writer touches its files.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

LOCK_FILE = ".owner.lock"
SWAP_PREFIX = "tierstore-"
_NEW_SWAP_PREFIX = ".tierstore-new-"
_NEW_LOCK_INFIX = ".new-"  # a lock file being made: <lock file name>.new-XXXX, beside it
STALE_SECONDS = 600.0


@dataclass(frozen=True)
class Reclaimed:
    """A directory removed because its owner was gone."""

    path: str
    nbytes: int


def _process_start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _owner_record() -> dict[str, object]:
    pid = os.getpid()
    return {"pid": pid, "start_ticks": _process_start_ticks(pid), "boot_id": _boot_id(),
            "host": socket.gethostname(), "created": time.time()}


def lock_path(directory: str, *, beside: bool = False) -> str:
    """Where ``directory``'s lock file is: inside it, or ``beside`` it (``<directory>.lock``)."""
    return directory + ".lock" if beside else os.path.join(directory, LOCK_FILE)


def lock(directory: str, *, beside: bool = False) -> int:
    """Take ``directory``'s lock and write its owner record; returns the fd that holds the lock (keep it open,
    :func:`unlock` it when done).

    A new lock file is made under a name of its own, locked, and only then linked in: were it created under
    its name and locked after, another process reclaiming directories could take the lock in between, find
    the owner "gone" and remove the directory being made."""
    path = lock_path(directory, beside=beside)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + _NEW_LOCK_INFIX, dir=os.path.dirname(path))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else has this file open
        try:
            os.link(tmp, path)
        except FileExistsError:  # a lock file of an earlier owner: take that one's lock, if it is free
            os.close(fd)
            fd = -1
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(_owner_record()).encode())  # who owns it, for a person reading it
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return fd


def unlock(directory: str, fd: int, *, beside: bool = False) -> None:
    """Remove ``directory``'s lock file and let go of the lock."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock_path(directory, beside=beside))
    os.close(fd)


def make_swap_directory(base: str) -> tuple[str, int]:
    """A new private (0700) ``tierstore-*`` directory under ``base``, locked from its first moment; returns
    (path, lock fd)."""
    while True:
        tmp = tempfile.mkdtemp(prefix=_NEW_SWAP_PREFIX, dir=base)
        try:
            fd = lock(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = os.path.join(base, SWAP_PREFIX + os.path.basename(tmp)[len(_NEW_SWAP_PREFIX):])
        try:
            os.rename(tmp, final)  # fails rather than replace a non-empty directory of that name
            return final, fd
        except OSError:
            unlock(tmp, fd)
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(final):
                raise


def owner_gone(directory: str, *, beside: bool = False, now: float | None = None) -> bool:
    """Whether the process that owned ``directory`` is gone (see [Note: Owned directories])."""
    try:
        fd = os.open(lock_path(directory, beside=beside), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return _quiet_since(directory) < (now if now is not None else time.time()) - STALE_SECONDS
    except OSError:
        return False
    return _free(fd)


def _unlocked(path: str) -> bool:
    """Whether nobody holds a lock on the file at ``path``."""
    try:
        return _free(os.open(path, os.O_RDWR | os.O_CLOEXEC))
    except OSError:
        return False


def _free(fd: int) -> bool:
    """Whether the lock on the file open at ``fd`` could be taken (a live process holds it otherwise); closes
    ``fd``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def _quiet_since(directory: str) -> float:
    """The latest modification time of ``directory`` and the files in it (never quiet if it has just gone: a
    store that is making its directory renames it from the hidden name before locking is visible)."""
    try:
        latest = os.stat(directory).st_mtime
    except FileNotFoundError:
        return float("inf")
    for entry in _walk(directory):
        with contextlib.suppress(OSError):
            latest = max(latest, entry.stat(follow_symlinks=False).st_mtime)
    return latest


def _walk(directory: str) -> Iterator[os.DirEntry]:
    with contextlib.suppress(OSError), os.scandir(directory) as it:
        for entry in it:
            yield entry
            if entry.is_dir(follow_symlinks=False):
                yield from _walk(entry.path)


def _disk_bytes(directory: str) -> int:
    total = 0
    for entry in _walk(directory):
        with contextlib.suppress(OSError):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def reclaim(parent: str, prefixes: tuple[str, ...], *, beside: bool = False,
            now: float | None = None) -> list[Reclaimed]:
    """Remove the directories in ``parent`` named with one of ``prefixes`` whose owner is gone (and, with
    locks ``beside`` them, lock files whose directory has gone)."""
    out: list[Reclaimed] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return out
    for name in sorted(names):
        path = os.path.join(parent, name)
        if not name.startswith(prefixes) or os.path.islink(path):
            continue
        if beside and ".lock" + _NEW_LOCK_INFIX in name and os.path.isfile(path):
            if _unlocked(path):  # its maker was killed before linking it in
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            continue
        if beside and name.endswith(".lock") and os.path.isfile(path):
            directory = path[:-len(".lock")]
            if not os.path.exists(directory) and owner_gone(directory, beside=True, now=now):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # killed between committing its directory and removing its lock
            continue
        if os.path.isdir(path) and owner_gone(path, beside=beside, now=now):
            nbytes = _disk_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                out.append(Reclaimed(path, nbytes))
                if beside:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(lock_path(path, beside=True))
    return out


def reclaim_swap(base: str) -> list[Reclaimed]:
    """Swap directories under ``base`` left by stores whose process is gone."""
    return reclaim(base, (SWAP_PREFIX, _NEW_SWAP_PREFIX))


def describe(reclaimed: list[Reclaimed]) -> str:
    total = sum(r.nbytes for r in reclaimed)
    return (f"removed {len(reclaimed)} director{'y' if len(reclaimed) == 1 else 'ies'} left by processes that are "
            f"gone, {total / 2**20:.1f} MiB freed: " + ", ".join(os.path.basename(r.path) for r in reclaimed))


__all__ = ["LOCK_FILE", "Reclaimed", "describe", "lock", "lock_path", "make_swap_directory", "owner_gone",
           "reclaim", "reclaim_swap", "unlock"]
