"""Checkpoint files: safetensors written tensor by tensor, a JSON manifest, and an atomic commit.

Mechanism only: it knows tensors by name and a way to borrow each one in
host memory; the integrations decide which tensors a model and an
optimizer have and where they come from.

[Note: A manifest that vouches for itself] The manifest's first line is
``{"sha256": "<hex>",`` and the hex is the SHA-256 of every byte after that
line: a manifest with any byte changed, even one that still parses, fails
the check and never loads. It stays plain JSON (the first line opens the
object). Version 1 manifests (no checksum) still load.

[Note: Atomic checkpoint commit] Everything is written into a sibling
directory ``<path>.tmp-<random>``: the safetensors files, then the manifest
(last, so a directory with a manifest is complete); every file and the
directory are fsynced. Then, if ``<path>`` exists it is renamed to
``<path>.prev``, the new directory is renamed to ``<path>``, the parent is
fsynced and ``<path>.prev`` is removed. A process killed at any moment
leaves ``<path>`` complete (old or new) or, between the two renames, no
``<path>`` but a complete ``<path>.prev``, which :func:`resolve` picks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ._ownership import describe, lock, reclaim, unlock
from ._types import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    TierIOError,
    TierStoreError,
    TierTypeError,
    TierValueError,
)

FORMAT = "tierstore-checkpoint"
FORMAT_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)
# [Note: Every byte covered] Each tensor's bytes carry a CRC32 in the
# manifest; from version 3 each file's safetensors header (its length and
# JSON, up to the first tensor) carries a SHA-256 there too (``headers``), so
# every byte of a checkpoint is checked before anything loads, and a reader of
# the plain files, which trusts the header, gets the names and tensors saved.
_HEAD = b'{"sha256": "'
MANIFEST = "manifest.json"

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}

# Test hook: called with a stage name at each step of a save (tests kill the process there).
crash_point: Callable[[str], None] | None = None


def _stage(name: str) -> None:
    if crash_point is not None:
        crash_point(name)


@dataclass(frozen=True)
class TensorSource:
    """A tensor to save: its name, shape and dtype, and ``borrow()``, a context manager that
    yields its bytes as a contiguous CPU tensor for as long as the write needs them."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    borrow: Callable[[], AbstractContextManager[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TierTypeError(f"dtype {dtype} cannot be saved in safetensors; convert it to one of "
                            f"{', '.join(str(d) for d in _DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise TierStoreError(f"unknown safetensors dtype {name!r}; known: {', '.join(_BY_NAME)}") from None


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a view (a write into them is a write into ``t``)."""
    if not t.is_contiguous():  # reshape would copy, and bytes read into the copy would be lost
        raise TierValueError("a checkpoint tensor's bytes are taken of contiguous tensors only")
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_safetensors(path: str, sources: list[TensorSource], file_label: str,
                       metadata: dict[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Write one safetensors file, borrowing one tensor at a time; returns the manifest entries and the header's
    size and checksum."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for s in sources:
        if s.name in header:
            raise TierValueError(f"tensor name {s.name!r} appears twice in {file_label}")
        header[s.name] = {"dtype": dtype_name(s.dtype), "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    base = 8 + len(raw)
    try:
        entries = _write_body(path, sources, file_label, header, raw, base)
        # See [Note: Every byte covered]: the header's checksum, beside the tensors' own.
        return entries, {"nbytes": base, "sha256": hashlib.sha256(struct.pack("<Q", len(raw)) + raw).hexdigest()}
    except OSError as e:  # a full disk, a lost mount: name the file and what to do (nothing was committed)
        raise _write_error(path, base + offset, e) from e


def _write_error(path: str, nbytes: int, e: OSError) -> CheckpointWriteError:
    return CheckpointWriteError(f"writing checkpoint file {path} ({nbytes} bytes) failed: {e.strerror or e}; the "
                                f"previous checkpoint at that path is untouched. Free space there (or choose another "
                                f"path) and save again")


def _write_body(path: str, sources: list[TensorSource], file_label: str, header: dict[str, Any], raw: bytes,
                base: int) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    with open(path, "xb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for s in sources:
            with s.borrow() as t:
                if tuple(t.shape) != tuple(s.shape) or t.dtype != s.dtype:
                    raise TierStoreError(f"{s.name}: expected {tuple(s.shape)} {s.dtype}, got "
                                         f"{tuple(t.shape)} {t.dtype}")
                mv = _bytes_of(t.contiguous())
                f.write(mv)
                crc = zlib.crc32(mv)
            lo, hi = header[s.name]["data_offsets"]
            entries[s.name] = {"file": file_label, "offset": base + lo, "nbytes": hi - lo,
                               "shape": list(s.shape), "dtype": dtype_name(s.dtype), "crc32": crc}
            _stage(f"tensor {file_label}:{s.name}")
        f.flush()
        os.fsync(f.fileno())
    _stage(f"file {file_label}")
    return entries


def write_safetensors_file(path: str | os.PathLike, sources: Iterable[TensorSource],
                           metadata: dict[str, str] | None = None) -> None:
    """One safetensors file at ``path``, written under a temporary name, fsynced, then renamed into place."""
    path = os.path.abspath(os.fspath(path))
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        _write_safetensors(tmp, list(sources), os.path.basename(path), metadata or {})  # fsynced
        _rename_into_place(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_staging_locks: dict[str, int] = {}  # staging directory -> the fd holding its lock (see [Note: Owned directories])


def new_directory(path: str | os.PathLike) -> str:
    """A fresh private temporary directory next to ``path`` to write a checkpoint into, locked by this process
    until :func:`commit` or :func:`discard`. Staging directories of earlier saves at ``path`` whose process died
    (killed during a save) are removed first, and said."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise CheckpointNotFoundError(f"cannot write checkpoint {path}: directory {parent} does not exist; create "
                                      f"it first")
    prefix = os.path.basename(path) + ".tmp-"
    reclaimed = reclaim(parent, (prefix,), beside=True)
    if reclaimed:
        warnings.warn(f"checkpoint {path}: {describe(reclaimed)}", stacklevel=3)
    try:
        tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    except OSError as e:
        raise _write_error(os.path.join(parent, prefix + "*"), 0, e) from e
    try:
        _staging_locks[tmp] = lock(tmp, beside=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(tmp, 0, e) from e
    return tmp


def _let_go(tmp: str) -> None:
    fd = _staging_locks.pop(tmp, None)
    if fd is not None:
        unlock(tmp, fd, beside=True)


def discard(tmp: str) -> None:
    """Remove a staging directory that will not be committed."""
    shutil.rmtree(tmp, ignore_errors=True)
    _let_go(tmp)


def write_files(directory: str, files: dict[str, Iterable[TensorSource]], *, metadata: dict[str, Any] | None = None,
                file_metadata: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """Write ``files`` (file name -> tensors), then the manifest, into ``directory``; everything fsynced."""
    for name in files:
        if os.sep in name or name in (MANIFEST, "", ".", ".."):
            raise TierValueError(f"bad checkpoint file name {name!r}")
    os.makedirs(directory, exist_ok=True)
    manifest: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION, "metadata": metadata or {},
                                "tensors": {}, "headers": {}}
    for name, sources in files.items():
        manifest["tensors"][name], manifest["headers"][name] = _write_safetensors(
            os.path.join(directory, name), list(sources), name, (file_metadata or {}).get(name, {}))
    raw = encode_manifest(manifest)
    where = os.path.join(directory, MANIFEST)
    try:
        with open(where, "xb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(directory)
    except OSError as e:
        raise _write_error(where, len(raw), e) from e
    _stage("manifest")
    return manifest


def fsync_tree(path: str) -> None:
    """fsync ``path`` (a file), or every file and directory under it: what others wrote into a directory that
    :func:`commit` is to make a checkpoint (transformers' ``Trainer`` writes its own files)."""
    paths = [path] if os.path.isfile(path) else \
        [p for d, _, names in os.walk(path) for p in (*(os.path.join(d, n) for n in names), d)]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_file(tmp: str, path: str) -> None:
    """Make the file written at ``tmp`` the one at ``path``: fsynced, renamed over it, and the directory fsynced,
    so that a process killed at any moment leaves ``path`` whole (old or new)."""
    fsync_tree(tmp)
    _rename_into_place(tmp, path)


def _rename_into_place(tmp: str, path: str) -> None:
    """Rename the fsynced file ``tmp`` over ``path`` and fsync the directory: the rename is on the drive too."""
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def commit(tmp: str, path: str | os.PathLike) -> None:
    """Make the complete checkpoint in ``tmp`` the one at ``path`` (see [Note: Atomic checkpoint commit])."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.chmod(tmp, 0o755 & ~_umask())
    _fsync_dir(tmp)
    prev = path + ".prev"
    if os.path.exists(path):
        if os.path.exists(prev):
            shutil.rmtree(prev)
            _stage("removed stale prev")
        os.rename(path, prev)
        _fsync_dir(parent)
        _stage("renamed old")
    os.rename(tmp, path)
    _fsync_dir(parent)
    _let_go(tmp)  # held until the staging directory is gone: no other save may reclaim it before
    _stage("renamed new")
    shutil.rmtree(prev, ignore_errors=True)
    _stage("done")


def write_checkpoint(path: str | os.PathLike, files: dict[str, Iterable[TensorSource]], *,
                     metadata: dict[str, Any] | None = None,
                     file_metadata: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """Write ``files`` (file name -> tensors) and a manifest to directory ``path``, atomically.

    See [Note: Atomic checkpoint commit]. ``metadata`` (JSON) goes into the
    manifest; ``file_metadata`` into each safetensors header. Returns the manifest.
    """
    tmp = new_directory(path)
    try:
        manifest = write_files(tmp, files, metadata=metadata, file_metadata=file_metadata)
        commit(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    return manifest


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def resolve(path: str | os.PathLike) -> str:
    """The directory holding the last complete checkpoint saved at ``path``."""
    path = os.path.abspath(os.fspath(path))
    for candidate in (path, path + ".prev"):
        if os.path.isfile(os.path.join(candidate, MANIFEST)):
            return candidate
    raise CheckpointNotFoundError(f"no checkpoint at {path} (no {MANIFEST} there or in {path}.prev)")


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes (see [Note: A manifest that vouches for itself])."""
    body = json.dumps(manifest, indent=1).encode()
    assert body.startswith(b"{\n") and "sha256" not in manifest
    rest = body[1:]
    return _HEAD + hashlib.sha256(rest).hexdigest().encode() + b'",' + rest


def decode_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """The manifest in ``raw`` (the bytes of file ``where``), its checksum and its entries checked."""
    if raw.startswith(_HEAD):
        digest, sep, rest = raw[len(_HEAD):len(_HEAD) + 64], raw[len(_HEAD) + 64:len(_HEAD) + 66], raw[len(_HEAD) + 66:]
        if sep != b'",' or hashlib.sha256(rest).hexdigest().encode() != digest:
            raise CheckpointError(f"{where}: the manifest does not match its checksum: it was changed or damaged "
                                  f"after it was written. Load the previous checkpoint or save a new one")
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{where}: not a readable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a {FORMAT} manifest")
    version = manifest.get("version")
    if version not in _READABLE_VERSIONS or (version != 1) != raw.startswith(_HEAD):
        raise CheckpointError(f"{where}: manifest version {version!r} cannot be read here (this version of "
                              f"tierstore reads versions {', '.join(map(str, _READABLE_VERSIONS))})")
    manifest.pop("sha256", None)
    _check_manifest(manifest, where)
    return manifest


def _check_manifest(manifest: dict[str, Any], where: str) -> None:
    """Every entry has the fields a load uses, of the right types and consistent sizes."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {what}; the manifest is not one tierstore wrote")

    if not isinstance(manifest.get("metadata"), dict) or not isinstance(manifest.get("tensors"), dict):
        raise bad("no metadata or tensors")
    for file, entries in manifest["tensors"].items():
        if not isinstance(entries, dict) or os.sep in file or file in (MANIFEST, "", ".", ".."):
            raise bad(f"bad file entry {file!r}")
        head = manifest.get("headers", {}).get(file) if isinstance(manifest.get("headers"), dict) else None
        if manifest.get("version", 1) >= 3 and (not isinstance(head, dict) or type(head.get("nbytes")) is not int
                                                 or head["nbytes"] < 8 or not isinstance(head.get("sha256"), str)):
            raise bad(f"no header checksum for {file}")
        for name, e in entries.items():
            ints = ("offset", "nbytes", "crc32")
            if (not isinstance(e, dict) or e.get("file") != file or e.get("dtype") not in _BY_NAME
                    or any(type(e.get(k)) is not int or e[k] < 0 for k in ints)
                    or not isinstance(e.get("shape"), list)
                    or any(type(d) is not int or d < 0 for d in e["shape"])):
                raise bad(f"entry {name!r} of {file} is malformed")
            numel = 1
            for d in e["shape"]:
                numel *= d
            if numel * torch.empty((), dtype=_BY_NAME[e["dtype"]]).element_size() != e["nbytes"]:
                raise bad(f"entry {name!r} of {file}: {e['nbytes']} bytes for shape {e['shape']} {e['dtype']}")


class PinnedCheckpoint(str):
    """A checkpoint's directory (the str) with its files held open (see [Note: A load reads what it checked])."""

    fds: dict[str, int]

    def __new__(cls, directory: str, fds: dict[str, int]) -> PinnedCheckpoint:
        pinned = super().__new__(cls, directory)
        pinned.fds = fds
        return pinned

    def close(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> PinnedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# How often a load opens a checkpoint again when a save replaced it while it was being opened.
_PIN_ATTEMPTS = 5


def read_manifest(path: str | os.PathLike, subdirectory: str | None = None) -> tuple[PinnedCheckpoint, dict[str, Any]]:
    """(directory, manifest) of the checkpoint at ``path`` (of its part in ``subdirectory``, if given), with its
    files held open and their headers checked.

    [Note: A load reads what it checked] A save replaces a checkpoint by
    renaming directories and removing the old one (see [Note: Atomic
    checkpoint commit]), so files opened by name at two moments may belong to
    two checkpoints. The directory is opened once, its manifest and every file
    it names are opened through that handle and held open: every check and
    every read of a load goes through those handles, so a rename or a removal
    by a concurrent save changes nothing of what this load reads (the old
    checkpoint, whole). A save that replaced the directory while it was being
    opened is met by opening the checkpoint at ``path`` again.
    """
    for _ in range(_PIN_ATTEMPTS):
        directory = resolve(path)
        if subdirectory is not None:
            directory = os.path.join(directory, subdirectory)
            if not os.path.isfile(os.path.join(directory, MANIFEST)) and os.path.isdir(os.path.dirname(directory)):
                raise CheckpointNotFoundError(f"checkpoint {path} has no part {subdirectory!r}")
        try:
            return _pin(directory)
        except _Vanished as gone:
            if gone.file is not None and not _replaced(path, subdirectory, directory, gone.inode):
                raise CheckpointError(f"checkpoint {path}: cannot open {os.path.join(directory, gone.file)}: it "
                                      f"is missing; the checkpoint is incomplete. Load the previous checkpoint "
                                      f"or save a new one") from None
            continue  # renamed or removed by a save meanwhile: the checkpoint now at ``path`` is whole
    raise CheckpointError(f"checkpoint {path}: a save to this path replaced it {_PIN_ATTEMPTS} times while it was "
                          f"being opened; load again once the save is done")


class _Vanished(Exception):
    """A file of a checkpoint being opened was not there (``file`` None: the directory or its manifest)."""

    def __init__(self, file: str | None, inode: tuple[int, int] | None) -> None:
        super().__init__(file)
        self.file, self.inode = file, inode


def _replaced(path: str | os.PathLike, subdirectory: str | None, directory: str, inode: tuple[int, int] | None
              ) -> bool:
    """Whether the checkpoint at ``path`` is no longer the directory (of ``inode``) that was being opened."""
    try:
        now = resolve(path)
        if subdirectory is not None:
            now = os.path.join(now, subdirectory)
        st = os.stat(now)
    except FileNotFoundError:
        return True
    return now != directory or (st.st_dev, st.st_ino) != inode


def _pin(directory: str) -> tuple[PinnedCheckpoint, dict[str, Any]]:
    where = os.path.join(directory, MANIFEST)
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except NotADirectoryError:
        raise CheckpointError(f"{directory} is not a checkpoint directory") from None
    except FileNotFoundError:
        raise _Vanished(None, None) from None
    st = os.fstat(dfd)
    fds: dict[str, int] = {}
    opening: str | None = None
    try:
        mfd = os.open(MANIFEST, os.O_RDONLY, dir_fd=dfd)
        try:
            raw = b"".join(iter(lambda: os.read(mfd, 1 << 20), b""))
        finally:
            os.close(mfd)
        manifest = decode_manifest(raw, where)
        for opening in manifest["tensors"]:
            fds[opening] = os.open(opening, os.O_RDONLY, dir_fd=dfd)
        pinned = PinnedCheckpoint(directory, fds)
    except BaseException as e:
        for fd in fds.values():
            os.close(fd)
        if isinstance(e, FileNotFoundError):
            raise _Vanished(opening, (st.st_dev, st.st_ino)) from None
        raise
    finally:
        os.close(dfd)
    for file, head in manifest.get("headers", {}).items():  # see [Note: Every byte covered]
        got = os.pread(pinned.fds[file], head["nbytes"], 0)
        if len(got) != head["nbytes"] or hashlib.sha256(got).hexdigest() != head["sha256"]:
            pinned.close()
            raise CheckpointIntegrityError(f"{os.path.join(directory, file)}: its safetensors header does not match "
                                           f"the checksum the manifest records; the file is corrupt")
    return pinned, manifest


@contextmanager
def _file_fd(directory: str, file: str, what: str) -> Iterator[int]:
    """An fd of ``file`` of a checkpoint ``directory`` for the block: the pinned one if any, else one opened and
    closed here."""
    if isinstance(directory, PinnedCheckpoint) and file in directory.fds:
        yield directory.fds[file]
        return
    path = os.path.join(directory, file)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"{what}: cannot open {path}: {e.strerror}") from None
    try:
        yield fd
    finally:
        os.close(fd)


def verify_tensor(directory: str, name: str, entry: dict[str, Any], *, chunk_bytes: int = 16 * 1024**2) -> None:
    """Check that tensor ``name``'s bytes are in their file and match their CRC, reading them in chunks."""
    file = os.path.join(directory, entry["file"])
    with _file_fd(directory, entry["file"], f"checkpoint tensor {name!r}") as fd:
        crc, done, left = 0, 0, entry["nbytes"]
        while left:
            block = os.pread(fd, min(left, chunk_bytes), entry["offset"] + done)
            if not block:
                raise CheckpointIntegrityError(f"checkpoint tensor {name!r}: {file} is truncated "
                                               f"({done} of {entry['nbytes']} bytes)")
            crc = zlib.crc32(block, crc)
            done += len(block)
            left -= len(block)
    if crc != entry["crc32"]:
        raise CheckpointIntegrityError(f"checkpoint tensor {name!r}: checksum mismatch in {file} at byte "
                                       f"{entry['offset']}; the file is corrupt")


def read_into(directory: str, name: str, entry: dict[str, Any], out: torch.Tensor) -> None:
    """Read tensor ``name`` described by manifest ``entry`` into ``out`` (a CPU tensor), checking its CRC."""
    if list(out.shape) != entry["shape"] or dtype_name(out.dtype) != entry["dtype"]:
        raise CheckpointError(f"checkpoint tensor {name!r} is {entry['shape']} {entry['dtype']}, but the "
                             f"model expects {list(out.shape)} {dtype_name(out.dtype)}: wrong model or config")
    file = os.path.join(directory, entry["file"])
    what = f"checkpoint tensor {name!r}"
    with _file_fd(directory, entry["file"], what) as fd:
        mv = _read_exact(file, entry["offset"], out, what, fd=fd)
    if zlib.crc32(mv) != entry["crc32"]:
        raise CheckpointIntegrityError(f"checkpoint tensor {name!r}: checksum mismatch in {file} at byte "
                             f"{entry['offset']}; the file is corrupt")


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (any writer's), as CPU tensors."""
    return {name: read_raw(name, entry) for name, entry in _header_entries(os.fspath(path)).items()}


def safetensors_entries(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Where each tensor of a safetensors checkpoint lies, reading only headers: ``path`` is one
    ``.safetensors`` file, a ``model.safetensors.index.json`` (the sharded layout transformers writes) or a
    directory holding one of them. name -> {"file", "offset", "nbytes", "shape", "dtype"}."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for candidate in ("model.safetensors.index.json", "model.safetensors"):
            if os.path.exists(os.path.join(path, candidate)):
                path = os.path.join(path, candidate)
                break
        else:
            raise CheckpointError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")
    if path.endswith(".json"):
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: not a safetensors index with a weight_map ({e})") from None
        out: dict[str, dict[str, Any]] = {}
        for file in sorted(set(weight_map.values())):
            shard = _header_entries(os.path.join(os.path.dirname(path), file))
            out.update((name, e) for name, e in shard.items() if weight_map.get(name) == file)
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise CheckpointError(f"{path}: the index names tensors its files lack: {missing[:5]}")
        return out
    return _header_entries(path)


_MAX_HEADER_BYTES = 100 * 2**20  # as the safetensors format caps it


def _header_entries(file: str) -> dict[str, dict[str, Any]]:
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            size = os.fstat(f.fileno()).st_size
            if n is None or n > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointIntegrityError(f"{file} is not a safetensors file (bad header length)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {e.strerror}") from None
    except ValueError as e:
        raise CheckpointIntegrityError(f"{file}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointIntegrityError(f"{file}: the safetensors header is not a JSON object")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        why = _bad_entry(info, size - 8 - n)
        if why:
            raise CheckpointIntegrityError(f"{file}: tensor {name!r} {why}")
        lo, hi = info["data_offsets"]
        out[name] = {"file": file, "offset": 8 + n + lo, "nbytes": hi - lo, "shape": list(info["shape"]),
                     "dtype": info["dtype"]}
    return out


def _bad_entry(info: Any, data_bytes: int) -> str | None:
    """Why a safetensors header entry cannot be read (checked before anything is allocated from it), or None."""
    if not isinstance(info, dict):
        return "has no dtype, shape and data_offsets"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _BY_NAME:
        return f"has an unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        return f"has a bad shape {shape!r}"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        return f"has data_offsets {offsets!r} outside the file's {data_bytes} data bytes"
    nbytes = math.prod(shape) * torch.empty((), dtype=_BY_NAME[dtype]).element_size()
    if nbytes != offsets[1] - offsets[0]:
        return f"has {offsets[1] - offsets[0]} bytes for shape {shape} {dtype} ({nbytes} bytes)"
    return None


def read_raw(name: str, entry: dict[str, Any]) -> torch.Tensor:
    """The tensor ``entry`` describes, as stored (no checksum: safetensors files of other writers carry none)."""
    out = torch.empty(entry["shape"], dtype=_BY_NAME[entry["dtype"]])
    if out.numel() * out.element_size() != entry["nbytes"]:
        raise CheckpointIntegrityError(f"{entry['file']}: tensor {name!r} has {entry['nbytes']} bytes for shape "
                                       f"{entry['shape']} {entry['dtype']}")
    _read_exact(entry["file"], entry["offset"], out, f"{entry['file']}: tensor {name!r}")
    return out


def _read_exact(file: str, offset: int, out: torch.Tensor, what: str, fd: int | None = None) -> memoryview:
    """Fill ``out`` (a CPU tensor) with its bytes from ``file`` (through ``fd`` if given) at ``offset``, in the
    file's (row-major) order whatever ``out``'s layout (a channels_last store copy); the bytes read, as a
    memoryview."""
    if not out.is_contiguous():
        tmp = torch.empty(out.shape, dtype=out.dtype)
        mv = _read_exact(file, offset, tmp, what, fd)
        out.copy_(tmp)
        return mv
    mv = _bytes_of(out)
    if fd is None:
        with open(file, "rb") as f:
            f.seek(offset)
            got = f.readinto(mv) if len(mv) else 0
    else:
        got = 0
        while got < len(mv):
            n = os.preadv(fd, [mv[got:]], offset + got)
            if n == 0:
                break
            got += n
    if got != len(mv):
        raise CheckpointIntegrityError(f"{what}: {file} is truncated ({got} of {len(mv)} bytes)")
    return mv


def read_tensor(directory: str, name: str, entry: dict[str, Any]) -> torch.Tensor:
    out = torch.empty(entry["shape"], dtype=dtype_from_name(entry["dtype"]))
    read_into(directory, name, entry, out)
    return out


__all__ = ["PinnedCheckpoint", "TensorSource", "commit", "decode_manifest", "discard", "dtype_from_name", "dtype_name",
           "encode_manifest", "new_directory", "read_into", "read_manifest", "read_raw", "read_safetensors",
           "read_tensor", "resolve", "safetensors_entries", "verify_tensor", "write_checkpoint", "write_files",
           "write_safetensors_file"]
