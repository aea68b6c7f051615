"""Copies of tensors in private files on the drive, mapped back into memory.

[Note: Tensors mapped from a file] A caller that must hold many tensors at once (a whole state dict that a
saver walks: ``torch.save``, torch.distributed.checkpoint, a framework's checkpoint) would hold more than the
host budget, or than the machine's RAM, if each were an ordinary copy. A mapped copy is written to a file of
its own under the swap directory, then mapped (``MAP_SHARED``) as the tensor's storage: its pages are the
page cache's, read from the file when touched and dropped by the kernel when memory is short (clean ones at
once, written ones after their write-back), so they count in the RSS only while the kernel has room for them.
The file has no name (``O_TMPFILE``; where refused, a name unlinked at once) and mode 0600: nothing is left on
the drive when the tensor is freed, the process killed included, and no other user can read it. No descriptor
stays open (torch maps the file through ``/proc/self/fd`` and closes its own), so a state dict of thousands of
tensors holds thousands of mappings, not of open files. Writes into the tensor go to the file (a load into a
mapped tensor stays out of the anonymous memory as well).

The bytes are written with ``pwrite`` (a full drive is an error here, not a SIGBUS at a later page fault), in
``_CHUNK_BYTES`` pieces.

[Note: Mapped pages given back] The kernel drops a mapped copy's pages only when memory is short, and until
then each page a saver has read counts in the process's RSS: a save of a state several times the host budget
would show the whole state in the RSS (and in a container's memory limit) though none of it needs to stay.
So while mapped copies live, a thread (``_Trimmer``) unmaps their pages from the process every
``TRIM_SECONDS`` (``madvise(MADV_DONTNEED)``): for a ``MAP_SHARED`` file mapping that changes no byte (the page
stays in the page cache, written ones are written back there) and a later read faults the page in again from
the cache. A copy is trimmed only while the thread holds it (its storage cannot be unmapped meanwhile) and
only where its storage is still the mapping it was made with. The thread ends once no copy lives.

[Note: Loaded pages given back] A load reads a checkpoint mapped from its file (``torch.load(mmap=True)``,
safetensors' reader) and writes each tensor into the store; the pages it read stay in the RSS, as above, until
memory is short. Once a tensor is in the store, :func:`give_back_pages` asks the kernel to reclaim its pages
where they are mapped from a file (``madvise(MADV_PAGEOUT)``, Linux 5.4 and later): a hint that changes no
byte (a clean page is read again from its file when touched; a page written since it was mapped stays, or goes
to swap). Anonymous memory is left alone (without swap it could not go; with swap, paging it out would only
cost).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import weakref

import torch

from ._types import StoreFullError, TierIOError

_CHUNK_BYTES = 64 * 2**20
TRIM_SECONDS = 0.05
_MADV_DONTNEED = 4
_MADV_PAGEOUT = 21
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class _Trimmer:
    """Gives back the pages of the live mapped copies every ``TRIM_SECONDS`` (see [Note: Mapped pages given back]).
    ``add`` is called by any thread making a copy; the trimming thread alone walks the copies, under the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: dict[int, tuple[weakref.ref, int, int]] = {}  # id -> (the tensor, its address, its bytes)
        self._thread: threading.Thread | None = None

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        with self._lock:
            self._copies[id(t)] = (weakref.ref(t), storage.data_ptr(), storage.nbytes())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mapped-copies-trimmer", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        stop = threading.Event()
        while not stop.wait(TRIM_SECONDS):
            with self._lock:
                for key, (ref, address, nbytes) in list(self._copies.items()):
                    t = ref()  # held while trimmed: its storage is not unmapped meanwhile
                    if t is None or t.untyped_storage().data_ptr() != address:
                        del self._copies[key]
                        continue
                    _libc.madvise(address, nbytes, _MADV_DONTNEED)
                    del t
                if not self._copies:
                    self._thread = None
                    return


_trimmer = _Trimmer()
# a forked child (a DataLoader's worker) has none of the thread, and maybe a lock held at the fork: its own
os.register_at_fork(after_in_child=lambda: globals().__setitem__("_trimmer", _Trimmer()))


def _private_file(directory: str) -> int:
    """A file under ``directory`` that no name reaches, readable and writable by this user only."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError) as e:  # no O_TMPFILE on this platform or filesystem
        if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    for i in range(1000):
        path = os.path.join(directory, f"mapped-{os.getpid()}-{i}.tmp")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        os.unlink(path)
        return fd
    raise TierIOError(f"cannot create a file for a mapped copy under {directory!r}")


def mapped_copy(directory: str, tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` (a CPU tensor) in a private file under ``directory``, mapped back into memory (see
    [Note: Tensors mapped from a file]). Raises StoreFullError where the drive fills, TierIOError on another
    I/O error; nothing stays on the drive either way."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    fd = _private_file(directory)
    try:
        done = 0
        while done < nbytes:
            try:
                done += os.pwrite(fd, data[done:done + _CHUNK_BYTES], done)
            except OSError as e:
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                raise (StoreFullError if full else TierIOError)(
                    f"a mapped copy of {nbytes / 2**20:.1f} MiB could not be written under {directory!r}: "
                    f"{e.strerror}" + (": free space there or choose another nvme_path" if full else "")) from e
        # torch maps the file and lets go of the descriptor (a mmap object would keep one open per tensor)
        storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
    finally:
        os.close(fd)  # the mapping keeps the file
    copy = torch.empty((0,), dtype=torch.uint8).set_(storage).view(tensor.dtype).view(tensor.shape)
    _trimmer.add(copy)
    return copy


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process mapped from files (not anonymous memory, the heap or the stack)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi))
    return out


def give_back_pages(tensors: list[torch.Tensor]) -> None:
    """Ask the kernel to reclaim the pages of these CPU tensors (the caller holds them) where a file backs them:
    see [Note: Loaded pages given back]. Tensors in anonymous memory, or on a device, are left as they are."""
    spans = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    if not spans:
        return
    files = _file_mappings()
    for lo, hi in spans:
        start, stop = -(-lo // _PAGE) * _PAGE, hi // _PAGE * _PAGE  # whole pages within the storage only
        if stop > start and any(a <= lo and hi <= b for a, b in files):
            _libc.madvise(start, stop - start, _MADV_PAGEOUT)


__all__ = ["give_back_pages", "mapped_copy"]
