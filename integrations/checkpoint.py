"""Save and resume offloaded training: parameters and AdamW state streamed from the store to safetensors.

A checkpoint is a directory: ``model.safetensors`` (every parameter and
persistent buffer under its ``state_dict`` name, loadable with plain
``safetensors``), ``optimizer.safetensors`` (``<param>/exp_avg``,
``<param>/exp_avg_sq`` and, for bf16/fp16 parameters, ``<param>/master``)
and ``manifest.json`` (each tensor's file, offset, shape, dtype and CRC32,
the step counts, hyper-parameters, the prefetch trace and your ``extra``).
Tensors are borrowed from the store one at a time in the host tier, so a
model far larger than RAM is saved within the host budget. The commit is
atomic: see [Note: Atomic checkpoint commit] in ``tierstore/_checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tierstore import CheckpointError, Tier, TierStore, TierStoreError, TierTypeError, TierValueError
from tierstore.files import (
    MANIFEST,
    PinnedCheckpoint,
    TensorSource,
    commit,
    discard,
    dtype_from_name,
    dtype_name,
    new_directory,
    read_into,
    read_manifest,
    read_raw,
    read_tensor,
    safetensors_entries,
    verify_tensor,
    write_checkpoint,
    write_files,
    write_safetensors_file,
)

from ._layouts import StateLayout
from ._base import OffloadBase, offloaded_of
from .fsdp import FSDPOffload
from .optim import OffloadedAdamW

Offloaded = OffloadBase

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


def model_and_offload(model: nn.Module | Offloaded) -> tuple[nn.Module, Offloaded | None]:
    if isinstance(model, OffloadBase):
        return model.model, model
    if not isinstance(model, nn.Module):
        raise TierTypeError(f"expected an nn.Module, an OffloadedModel or an FSDPOffload, not {type(model).__name__}")
    return model, offloaded_of(model)


def _store_source(store: TierStore, key: str, name: str) -> TensorSource:
    info = store.info(key)

    @contextmanager
    def borrow() -> Iterator[torch.Tensor]:
        t = store.get(key, Tier.HOST)
        try:
            yield t
        finally:
            store.release(key, Tier.HOST)

    return TensorSource(name, tuple(info["shape"]), info["dtype"], borrow)


def _plain_source(name: str, tensor: torch.Tensor) -> TensorSource:
    @contextmanager
    def borrow() -> Iterator[torch.Tensor]:
        yield tensor.detach().cpu().contiguous()

    return TensorSource(name, tuple(tensor.shape), tensor.dtype, borrow)


def tensor_source(store: TierStore | None, name: str, v: Any) -> TensorSource:
    """What saves one tensor of :func:`model_tensors`: a store key borrowed from the host tier, or the tensor."""
    return _store_source(store, v, name) if isinstance(v, str) and store is not None else _plain_source(name, v)


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mname, module in model.named_modules():
        for bname, b in module._buffers.items():
            if b is not None and bname not in module._non_persistent_buffers_set:
                yield (f"{mname}.{bname}" if mname else bname), b


def _placement(off: Offloaded | None, value: Any) -> str:
    """Where a tensor of :func:`model_tensors` lives: the wrapper's home tier for store keys."""
    return off.home.label if isinstance(value, str) and off is not None else "resident"


def model_tensors(model: nn.Module, off: Offloaded | None) -> tuple[dict[str, Any], dict[str, str]]:
    """name -> (store key or the tensor itself), and alias -> saved name for tied parameters."""
    offloaded = {id(p): key for _, key, p in off.named_offloaded()} if off is not None else {}
    seen: dict[int, str] = {}
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases[name] = seen[id(p)]
            continue
        seen[id(p)] = name
        tensors[name] = offloaded.get(id(p), p)
    for name, b in _persistent_buffers(model):
        tensors[name] = b
    return tensors, aliases


def save_checkpoint(path: str, model: nn.Module | Offloaded, optimizer: OffloadedAdamW | None = None, *,
                    extra: dict[str, Any] | None = None, weights: bool = True) -> dict[str, Any]:
    """Save ``model``'s parameters (and ``optimizer``'s state) to directory ``path``, atomically.

    ``extra`` is any JSON-serialisable dict (your epoch, data position...),
    returned by :func:`load_checkpoint`. With ``weights=False`` only the
    optimizer's state is saved (the weights are saved elsewhere, as
    ``save_pretrained`` saves them); load it with ``strict=False``. Overwrites an earlier checkpoint at
    ``path`` only once the new one is complete. With FSDP2 (:func:`offload_fsdp`)
    every rank calls it with the same ``path`` (on a filesystem all ranks
    see): each writes its shards to ``path/rank<r>``, and rank 0 commits the
    whole directory once all have written. Returns the (rank's) manifest.
    """
    model, off = model_and_offload(model)
    if off is not None and off.in_forward_or_backward():
        raise TierStoreError("cannot save a checkpoint inside forward or backward; save between steps")
    if off is not None and off.broken is not None:
        raise TierStoreError(f"cannot save a checkpoint of values that mix two steps: {off.broken}")
    tensors, aliases = model_tensors(model, off) if weights else ({}, {})
    store = off.store if off is not None else None
    sources = [tensor_source(store, name, v) for name, v in tensors.items()]
    files = {MODEL_FILE: sources}
    metadata: dict[str, Any] = {
        "aliases": aliases,
        "placement": {name: _placement(off, v) for name, v in tensors.items()},
        "extra": extra or {},
    }
    if off is not None:
        metadata["trace"] = off.prefetch_policy.trace
    if optimizer is not None:
        if off is not None and optimizer.offloaded is not off:
            raise TierValueError("the optimizer belongs to a different model")
        files[OPTIMIZER_FILE] = [_store_source(optimizer.store, key, f"{name}/{what}")
                                 for name, what, key in optimizer.state_tensors()]
        metadata["optimizer"] = {"param_groups": optimizer.group_states(), "steps": dict(optimizer.steps),
                                 "state_layout": optimizer.layout.as_dict()}
    file_metadata = {MODEL_FILE: {"format": "pt"}}
    if not isinstance(off, FSDPOffload):
        return write_checkpoint(path, files, metadata=metadata, file_metadata=file_metadata)
    return _save_sharded(path, off, files, metadata, file_metadata)


def _part(rank: int) -> str:
    return f"rank{rank:05d}"


def _save_sharded(path: str, off: FSDPOffload, files: dict, metadata: dict, file_metadata: dict) -> dict[str, Any]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    metadata.update(rank=rank, world_size=world, sharded={
        sh.name: {"shape": list(sh.param.shape), "dim": _shard_dim(sh.param)} for sh in off.params.values()})
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = new_directory(path)
        except OSError as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    tmp = box[0]
    error: BaseException | None = None
    manifest: dict[str, Any] = {}
    try:
        manifest = write_files(os.path.join(tmp, _part(rank)), files, metadata=metadata,
                               file_metadata=file_metadata)
    except BaseException as e:  # every rank must learn of it before rank 0 commits
        error = e
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, None if error is None else f"rank {rank}: {error!r}")
    failed = [e for e in errors if e is not None]
    if rank == 0:
        try:
            if not failed:
                write_files(tmp, {}, metadata={"world_size": world, "parts": [_part(r) for r in range(world)],
                                               "extra": metadata["extra"]})
                commit(tmp, path)
        finally:
            discard(tmp)
    dist.barrier()
    if error is not None:
        raise error
    if failed:
        raise TierStoreError(f"checkpoint {path} not written: " + "; ".join(failed))
    return manifest


def _shard_dim(param: torch.Tensor) -> int | None:
    from torch.distributed.tensor import Shard

    dims = [pl.dim for pl in getattr(param, "placements", ()) if isinstance(pl, Shard)]
    return dims[0] if dims else None


def load_checkpoint(path: str, model: nn.Module | Offloaded, optimizer: OffloadedAdamW | None = None, *,
                    strict: bool = True) -> dict[str, Any]:
    """Load a checkpoint saved by :func:`save_checkpoint` into ``model`` (and ``optimizer``); returns ``extra``.

    All or nothing: first the manifest's own checksum, every file, every
    tensor's shape, dtype and CRC and the optimizer's groups and steps are
    checked (under FSDP2, on every rank, and every rank learns of any
    failure); any problem is a :class:`~tierstore.CheckpointError` naming the
    file and the entry, raised before the model, the optimizer or the store
    changes. Then offloaded parameters are written into the store tensor by
    tensor (within the host budget) and stay where the wrapper keeps them.
    With ``strict``, a parameter missing from the checkpoint or a tensor the
    model lacks is an error.
    """
    model, off = model_and_offload(model)
    error: BaseException | None = None
    try:
        load = _check_load(path, model, off, optimizer, strict)
    except BaseException as e:  # under FSDP2 every rank must learn of it before any loads
        error = e
    if isinstance(off, FSDPOffload):
        import torch.distributed as dist

        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else f"rank {dist.get_rank()}: {error}")
        failed = [e for e in errors if e is not None]
        if failed and error is None:
            raise CheckpointError(f"checkpoint {path} not loaded: " + "; ".join(failed))
    if error is not None:
        raise error
    with load[0]:  # its files stay open until the load is done (see [Note: A load reads what it checked])
        return _apply_load(model, off, optimizer, *load)


def _apply_load(model: nn.Module, off: Offloaded | None, optimizer: OffloadedAdamW | None, directory: str,
                manifest: dict[str, Any], tensors: dict[str, Any], entries: dict[str, Any]) -> dict[str, Any]:
    """Write what :func:`_check_load` checked into the model, the store and the optimizer."""
    meta = manifest["metadata"]
    placement = meta.get("placement", {})
    moved = [n for n, v in tensors.items() if n in placement and placement[n] != _placement(off, v)]
    if moved:
        warnings.warn(f"{len(moved)} tensors (e.g. {moved[0]!r}) were saved from another tier than the one the "
                      f"model now keeps them in; they are loaded where the model keeps them", stacklevel=3)
    store = off.store if off is not None else None
    done = 0
    for name, v in tensors.items():
        if name not in entries:
            continue
        try:
            if isinstance(v, str) and store is not None:
                _load_into_store(store, v, directory, name, entries[name])
            else:
                with torch.no_grad():
                    v.copy_(read_tensor(directory, name, entries[name]))
        except CheckpointError as e:  # checked a moment ago: the drive gave back other bytes this time
            raise type(e)(f"{e}. The load stopped part-way, after {done} tensors of the model: it holds a mix of "
                          f"its values and the checkpoint's (no copy holds other bytes). Load again") from e
        done += 1
    if off is not None:
        off.zero_grad()
        if meta.get("trace") is not None:
            off.prefetch_policy.trace = list(meta["trace"])
    if optimizer is not None:
        _load_optimizer(optimizer, directory, manifest["tensors"].get(OPTIMIZER_FILE, {}), meta["optimizer"])
    if store is not None:
        store.flush()
    return meta.get("extra", {})


def _check_load(path: str, model: nn.Module, off: Offloaded | None, optimizer: OffloadedAdamW | None,
                strict: bool) -> tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Everything a load will read, checked: (directory, manifest, the model's tensors, their entries)."""
    if isinstance(off, FSDPOffload):
        import torch.distributed as dist

        pinned, top = read_manifest(path)
        pinned.close()
        saved, world = top["metadata"].get("world_size"), dist.get_world_size()
        if saved != world:
            raise CheckpointError(f"checkpoint {path} was saved by {saved} ranks, this job has {world}; "
                                  "consolidate_checkpoint() it and load the full parameters instead")
        directory, manifest = read_manifest(path, _part(dist.get_rank()))
    else:
        directory, manifest = read_manifest(path)
    try:
        return _check_pinned(model, off, optimizer, strict, directory, manifest)
    except BaseException:
        directory.close()
        raise


def _check_pinned(model: nn.Module, off: Offloaded | None, optimizer: OffloadedAdamW | None, strict: bool,
                  directory: PinnedCheckpoint, manifest: dict[str, Any]
                  ) -> tuple[PinnedCheckpoint, dict[str, Any], dict[str, Any], dict[str, Any]]:
    where = os.path.join(directory, MANIFEST)
    meta = manifest["metadata"]
    if not isinstance(meta.get("extra", {}), dict) or not isinstance(meta.get("trace") or [], list):
        raise CheckpointError(f"{where}: malformed metadata (extra, trace)")
    entries = manifest["tensors"].get(MODEL_FILE, {})
    tensors, _ = model_tensors(model, off)
    missing = sorted(set(tensors) - set(entries))
    unexpected = sorted(set(entries) - set(tensors))
    if strict and (missing or unexpected):
        raise CheckpointError(f"checkpoint {directory} does not match the model: missing {missing[:5]}"
                              f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                              f"{'...' if len(unexpected) > 5 else ''} (load with strict=False to skip them)")
    store = off.store if off is not None else None
    reads = []
    for name, v in tensors.items():
        if name in entries:
            reads.append((name, entries[name], *_shape_dtype(store, v), MODEL_FILE))
    if optimizer is not None:
        reads += _check_optimizer(optimizer, directory, manifest)
    for name, entry, shape, dtype, file in reads:
        if tuple(entry["shape"]) != shape or entry["dtype"] != dtype_name(dtype):
            raise CheckpointError(f"{os.path.join(directory, file)}: tensor {name!r} is {entry['shape']} "
                                  f"{entry['dtype']}, but this model expects {list(shape)} {dtype_name(dtype)}: "
                                  f"wrong model or config")
    for name, entry, *_ in reads:
        verify_tensor(directory, name, entry)
    return directory, manifest, tensors, entries


def _check_optimizer(opt: OffloadedAdamW, directory: str, manifest: dict[str, Any]) -> list[tuple]:
    """The optimizer tensors a load will read, with the shapes the optimizer expects; its groups and steps
    checked."""
    where = os.path.join(directory, MANIFEST)
    meta = manifest["metadata"].get("optimizer")
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {directory} holds no optimizer state")
    try:  # checkpoints of before parameter groups kept one "hyperparameters" dict
        opt.check_group_states(meta["param_groups"] if "param_groups" in meta else [meta.get("hyperparameters")])
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    steps = meta.get("steps")
    if not isinstance(steps, dict) or not all(type(v) in (int, float) and v >= 1 for v in steps.values()):
        raise CheckpointError(f"{where}: malformed optimizer step counts")
    try:  # checkpoints of before compressed state name none: the fp32 layout
        saved = StateLayout.from_dict(meta.get("state_layout", {}))
    except (TypeError, ValueError):
        raise CheckpointError(f"{where}: unreadable optimizer state_layout {meta.get('state_layout')!r}") from None
    # split masters of the first version load as they are and are split again (see _load_optimizer)
    if saved != opt.layout and saved != dataclasses.replace(opt.layout, split="truncated"):
        what = saved.describe()
        raise CheckpointError(
            f"checkpoint {directory} holds optimizer state stored with {what}, and this OffloadedAdamW stores "
            f"{opt.layout.describe()}: build the optimizer with the saved layout to resume; to change layout, "
            f"save its state_dict() and pass it to the new optimizer's load_state_dict(sd, convert=True)")
    unknown = sorted(set(steps) - {name for name, _, _ in opt.state_tensors(dict.fromkeys(steps, 1.0))})
    if unknown:
        raise CheckpointError(f"checkpoint {directory} has optimizer state for unknown parameters {unknown[:5]}")
    entries = manifest["tensors"].get(OPTIMIZER_FILE, {})
    out = []
    for name, what, key in opt.state_tensors(steps):
        entry = entries.get(f"{name}/{what}")
        if entry is None:
            raise CheckpointError(f"{os.path.join(directory, OPTIMIZER_FILE)}: no optimizer tensor {name}/{what}")
        info = opt.store.info(key)
        out.append((f"{name}/{what}", entry, tuple(info["shape"]), info["dtype"], OPTIMIZER_FILE))
    return out


def _load_into_store(store: TierStore, key: str, directory: str, name: str, entry: dict[str, Any]) -> None:
    _write_into_store(store, key, lambda t: read_into(directory, name, entry, t))


def _write_into_store(store: TierStore, key: str, fill: Callable[[torch.Tensor], Any]) -> None:
    """``fill`` the host copy of ``key`` in place, then write it back to its home.

    A fill that raises (a read that fails its checksum) has left other bytes in the copy: a clean cached copy
    is dropped, so that the key reads its home's value again; where the host copy is the only one with the
    key's value (its home, or changed since it was written), the fill goes through a scratch tensor instead."""
    t = store.get(key, Tier.HOST)
    info = store.info(key)
    droppable = (info["home"] != Tier.HOST.label
                 and info["copies"].get(Tier.HOST.label, {}).get("state") == "clean")  # none for an empty tensor
    failed = False
    try:
        if droppable:
            fill(t)
        else:
            scratch = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
            fill(scratch)
            t.copy_(scratch)
        store.mark_dirty(key, Tier.HOST)
    except BaseException:
        failed = droppable
        raise
    finally:
        store.release(key, Tier.HOST)
        if failed:
            store.evict(key, Tier.HOST)
    store.write_back(key)


def _shape_dtype(store: TierStore | None, v: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a model tensor: a store key's, or the tensor's own."""
    if isinstance(v, str) and store is not None:
        info = store.info(v)
        return tuple(info["shape"]), info["dtype"]
    return tuple(v.shape), v.dtype


def _load_optimizer(opt: OffloadedAdamW, directory: str, entries: dict[str, Any], meta: dict[str, Any]) -> None:
    """Apply optimizer state that :func:`_check_optimizer` has checked."""
    opt.wait()  # surface a failed write-behind before overwriting
    opt.load_group_states(meta["param_groups"] if "param_groups" in meta else [meta["hyperparameters"]])
    saved = {k: float(v) for k, v in meta["steps"].items()}
    # The whole state is replaced: a parameter that had no state when saved starts afresh (masters from the
    # weights just loaded), as torch's load_state_dict leaves nothing of the steps after the save.
    opt.reset_state({name for name, _, _ in opt.named_items()} - set(saved))
    opt.steps = saved
    for name, what, key in opt.state_tensors():
        _load_into_store(opt.store, key, directory, f"{name}/{what}", entries[f"{name}/{what}"])
    if StateLayout.from_dict(meta.get("state_layout", {})).split == "truncated":
        opt._resplit_truncated()


def load_safetensors(path: str, model: nn.Module | Offloaded, *, strict: bool = True) -> list[str]:
    """Load pretrained weights from safetensors into a model, offloaded or not, one tensor at a time.

    ``path``: one ``.safetensors`` file, a ``model.safetensors.index.json`` (sharded, as transformers writes
    them) or a directory holding either. Each tensor is read, converted to its parameter's dtype (bf16 on disk
    into fp32 parameters, say), and written where the parameter lives (the store, through the host budget),
    so memory holds one tensor at a time. Names, shapes and (with ``strict``) missing or unexpected keys are
    checked first, as ``load_state_dict(strict=True)`` does, and any problem is one ``CheckpointError`` listing
    them, with nothing changed. Load before creating the model's ``OffloadedAdamW`` (its fp32 masters are
    taken from the parameters). Returns the names loaded.
    """
    entries = safetensors_entries(path)
    return load_tensors(model, {name: (e["shape"], lambda name=name, e=e: read_raw(name, e))
                                 for name, e in entries.items()}, strict=strict, source=path, where="the file")


def load_tensors(model: nn.Module | Offloaded, entries: dict[str, tuple[list[int], Callable[[], torch.Tensor]]],
                  *, strict: bool, source: str, where: str) -> list[str]:
    """Write ``entries`` (name -> (shape, a function reading the tensor)) into the model's tensors, wherever
    they live, after checking names and shapes; one tensor read at a time."""
    model, off = model_and_offload(model)
    # an optimizer of the model remakes its masters from the loaded values, where the offload can tell it
    if off is not None and off.consumers and not off.tells_loads:
        raise CheckpointError("load weights before creating the model's OffloadedAdamW: its fp32 masters and "
                              "moments were made from the parameters as they are now")
    tensors, aliases = model_tensors(model, off)
    by_saved = {}  # the name in the source -> the model's name (a tied parameter may be saved under either)
    for name in entries:
        target = aliases.get(name, name)
        if target in tensors and target not in by_saved.values():
            by_saved[name] = target
    missing = sorted(set(tensors) - set(by_saved.values()))
    unexpected = sorted(n for n in entries if n not in by_saved and aliases.get(n, n) not in tensors)
    store = off.store if off is not None else None

    shapes = {n: list(_shape_dtype(store, tensors[t])[0]) for n, t in by_saved.items()}
    mis_shaped = [f"{n}: {list(entries[n][0])} in {where}, {shapes[n]} in the model"
                  for n in by_saved if list(entries[n][0]) != shapes[n]]
    problems = [f"size mismatch for {m}" for m in mis_shaped]
    if strict:
        problems += ([f"missing key(s): {', '.join(missing)}"] if missing else []) + (
            [f"unexpected key(s): {', '.join(unexpected)}"] if unexpected else [])
    if problems:
        raise CheckpointError(f"loading {source}: " + "; ".join(problems) + " (nothing was loaded)")
    for saved, name in by_saved.items():
        value = entries[saved][1]()
        v = tensors[name]
        if isinstance(v, str) and store is not None:
            _write_into_store(store, v, lambda t, value=value: t.copy_(value))  # copy_ converts the dtype
        else:
            with torch.no_grad():
                v.copy_(value)
        del value
    if store is not None:
        store.flush()
    if off is not None:
        off.loaded([n for n in by_saved.values() if isinstance(tensors[n], str)])
    return list(by_saved.values())


def consolidate_checkpoint(path: str, out_file: str) -> list[str]:
    """Join the per-rank shards of an FSDP2 checkpoint into one safetensors file of full parameters.

    Streams one parameter at a time (memory: the largest full parameter).
    The file is written under a temporary name, fsynced, then renamed into place.
    Returns the names written.
    """
    directory, top = read_manifest(path)
    directory.close()
    parts = top["metadata"].get("parts")
    if not parts:
        raise TierStoreError(f"{directory} is not a sharded (FSDP2) checkpoint; its {MODEL_FILE} is already whole")
    manifests = [read_manifest(path, part) for part in parts]
    try:
        return _consolidate(manifests, out_file)
    finally:
        for pinned, _ in manifests:
            pinned.close()


def _consolidate(manifests: list[tuple[PinnedCheckpoint, dict[str, Any]]], out_file: str) -> list[str]:
    first = manifests[0][1]
    sharded = first["metadata"].get("sharded", {})
    sources = []
    for name, entry in first["tensors"][MODEL_FILE].items():
        info = sharded.get(name)
        if info is None or info["dim"] is None:  # replicated (buffers): rank 0's copy
            sources.append(_file_source(name, entry, manifests[0][0]))
            continue
        sources.append(_joined_source(name, info, manifests))
    write_safetensors_file(out_file, sources, {"format": "pt"})
    return [s.name for s in sources]


def _file_source(name: str, entry: dict[str, Any], directory: str) -> TensorSource:
    @contextmanager
    def borrow() -> Iterator[torch.Tensor]:
        yield read_tensor(directory, name, entry)

    return TensorSource(name, tuple(entry["shape"]), dtype_from_name(entry["dtype"]), borrow)


def _joined_source(name: str, info: dict[str, Any], manifests: list[tuple[str, dict[str, Any]]]) -> TensorSource:
    entries = [(d, m["tensors"][MODEL_FILE][name]) for d, m in manifests]
    dtype = dtype_from_name(entries[0][1]["dtype"])

    @contextmanager
    def borrow() -> Iterator[torch.Tensor]:
        shards = [s for s in (read_tensor(d, name, e) for d, e in entries) if s.numel()]
        yield torch.cat(shards, dim=info["dim"]) if shards else torch.empty(info["shape"], dtype=dtype)

    return TensorSource(name, tuple(info["shape"]), dtype, borrow)


def load_parameters(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's model file, checksums verified, tied names included (CPU tensors)."""
    directory, manifest = read_manifest(path)
    entries = manifest["tensors"].get(MODEL_FILE, {})
    with directory:
        out = {name: read_tensor(directory, name, e) for name, e in entries.items()}
    for alias, name in manifest["metadata"].get("aliases", {}).items():
        out[alias] = out[name]
    return out


__all__ = ["MODEL_FILE", "OPTIMIZER_FILE", "consolidate_checkpoint", "load_checkpoint", "load_parameters",
           "load_safetensors", "save_checkpoint"]
