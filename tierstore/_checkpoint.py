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
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ._ownership import describe, lock, reclaim, unlock
from ._types import CheckpointError, CheckpointIntegrityError, TierIOError, TierStoreError

FORMAT = "tierstore-checkpoint"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
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
        raise TypeError(f"dtype {dtype} cannot be saved in safetensors; convert it to one of "
                        f"{', '.join(str(d) for d in _DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise TierStoreError(f"unknown safetensors dtype {name!r}; known: {', '.join(_BY_NAME)}") from None


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a view (a write into them is a write into ``t``)."""
    if not t.is_contiguous():  # reshape would copy, and bytes read into the copy would be lost
        raise ValueError("a checkpoint tensor's bytes are taken of contiguous tensors only")
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_safetensors(path: str, sources: list[TensorSource], file_label: str,
                       metadata: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Write one safetensors file, borrowing one tensor at a time; returns the manifest entries."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for s in sources:
        if s.name in header:
            raise ValueError(f"tensor name {s.name!r} appears twice in {file_label}")
        header[s.name] = {"dtype": dtype_name(s.dtype), "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    base = 8 + len(raw)
    try:
        return _write_body(path, sources, file_label, header, raw, base)
    except OSError as e:  # a full disk, a lost mount: name the file and what to do (nothing was committed)
        raise TierIOError(f"writing checkpoint file {path} failed: {e.strerror or e}; the previous checkpoint at "
                          f"that path is untouched. Free space there (or choose another path) and save again") from e


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
        _write_safetensors(tmp, list(sources), os.path.basename(path), metadata or {})
        os.rename(tmp, path)
        _fsync_dir(os.path.dirname(path))
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
        raise FileNotFoundError(f"cannot write checkpoint {path}: directory {parent} does not exist; create it first")
    prefix = os.path.basename(path) + ".tmp-"
    reclaimed = reclaim(parent, (prefix,), beside=True)
    if reclaimed:
        warnings.warn(f"checkpoint {path}: {describe(reclaimed)}", stacklevel=3)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    _staging_locks[tmp] = lock(tmp, beside=True)
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
            raise ValueError(f"bad checkpoint file name {name!r}")
    os.makedirs(directory, exist_ok=True)
    manifest: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION, "metadata": metadata or {},
                                "tensors": {}}
    for name, sources in files.items():
        manifest["tensors"][name] = _write_safetensors(os.path.join(directory, name), list(sources), name,
                                                       (file_metadata or {}).get(name, {}))
    with open(os.path.join(directory, MANIFEST), "xb") as f:
        f.write(encode_manifest(manifest))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(directory)
    _stage("manifest")
    return manifest


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
    raise FileNotFoundError(f"no checkpoint at {path} (no {MANIFEST} there or in {path}.prev)")


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
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
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


def read_manifest(path: str | os.PathLike, subdirectory: str | None = None) -> tuple[str, dict[str, Any]]:
    """(directory, manifest) of the checkpoint at ``path`` (of its part in ``subdirectory``, if given)."""
    directory = resolve(path)
    if subdirectory is not None:
        directory = os.path.join(directory, subdirectory)
        if not os.path.isfile(os.path.join(directory, MANIFEST)):
            raise FileNotFoundError(f"checkpoint {path} has no part {subdirectory!r}")
    where = os.path.join(directory, MANIFEST)
    with open(where, "rb") as f:
        return directory, decode_manifest(f.read(), where)


def verify_tensor(directory: str, name: str, entry: dict[str, Any], *, chunk_bytes: int = 16 * 1024**2) -> None:
    """Check that tensor ``name``'s bytes are in their file and match their CRC, reading them in chunks."""
    file = os.path.join(directory, entry["file"])
    try:
        f = open(file, "rb")
    except OSError as e:
        raise CheckpointError(f"checkpoint tensor {name!r}: cannot open {file}: {e.strerror}") from None
    with f:
        f.seek(entry["offset"])
        crc, left = 0, entry["nbytes"]
        while left:
            block = f.read(min(left, chunk_bytes))
            if not block:
                raise CheckpointIntegrityError(f"checkpoint tensor {name!r}: {file} is truncated "
                                               f"({entry['nbytes'] - left} of {entry['nbytes']} bytes)")
            crc = zlib.crc32(block, crc)
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
    mv = _read_exact(file, entry["offset"], out, f"checkpoint tensor {name!r}")
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


def _read_exact(file: str, offset: int, out: torch.Tensor, what: str) -> memoryview:
    """Fill ``out`` (a CPU tensor) with its bytes from ``file`` at ``offset``, in the file's (row-major) order
    whatever ``out``'s layout (a channels_last store copy); the bytes read, as a memoryview."""
    if not out.is_contiguous():
        tmp = torch.empty(out.shape, dtype=out.dtype)
        mv = _read_exact(file, offset, tmp, what)
        out.copy_(tmp)
        return mv
    mv = _bytes_of(out)
    with open(file, "rb") as f:
        f.seek(offset)
        got = f.readinto(mv) if len(mv) else 0
    if got != len(mv):
        raise CheckpointIntegrityError(f"{what}: {file} is truncated ({got} of {len(mv)} bytes)")
    return mv


def read_tensor(directory: str, name: str, entry: dict[str, Any]) -> torch.Tensor:
    out = torch.empty(entry["shape"], dtype=dtype_from_name(entry["dtype"]))
    read_into(directory, name, entry, out)
    return out


__all__ = ["TensorSource", "commit", "decode_manifest", "discard", "dtype_from_name", "dtype_name",
           "encode_manifest", "new_directory", "read_into", "read_manifest", "read_raw", "read_safetensors",
           "read_tensor", "resolve", "safetensors_entries", "verify_tensor", "write_checkpoint", "write_files",
           "write_safetensors_file"]
