"""transformers' and peft's files of an offloaded model, one tensor at a time: ``save_pretrained`` (a peft model's
adapter as peft saves it, reading none of the frozen base it does not keep), peft's ``load_adapter`` without the
base in memory, and base weights loaded from a transformers checkpoint (see [Note: Saving the transformers way,
tensor by tensor] in hf.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from tierstore import CheckpointError, TierValueError, parse_bytes
from tierstore.files import TensorSource, read_raw, safetensors_entries, write_safetensors_file

from ._base import OffloadBase
from .checkpoint import load_safetensors, load_tensors, model_and_offload, model_tensors, tensor_source

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model.save_pretrained`` is transformers' or peft's."""
    owner = next((c for c in type(model).__mro__ if "save_pretrained" in c.__dict__), None)
    return owner is not None and owner.__module__.startswith(("transformers.", "peft."))


def methods_for(model: nn.Module, off: OffloadBase) -> dict[str, Any]:
    """What ``offload_model`` installs on a transformers or peft ``model`` instance (``remove()`` takes them off):
    ``save_pretrained`` (tensor by tensor), and a peft model's ``load_adapter`` (its frozen base never read)."""
    if not is_hf_model(model):
        return {}
    methods: dict[str, Any] = {"save_pretrained": partial(save_pretrained, off)}
    if is_peft(model):
        methods["load_adapter"] = partial(load_adapter, off)
    return methods


def load_adapter(model: nn.Module | OffloadBase, *args: Any, **kwargs: Any) -> Any:
    """peft's ``model.load_adapter(...)`` (how ``Trainer`` resumes a peft model) of an offloaded peft model,
    without the base in memory: peft takes ``model.state_dict()`` to learn the model's keys and shapes, which
    would read every offloaded tensor; here those values are left unread (meta tensors of their shapes) while
    peft loads the adapter, which then goes into the store as any ``load_state_dict`` does."""
    model, off = hf_offload(model)
    with off.state_dict_unread():
        return type(model).load_adapter(model, *args, **kwargs)


def is_peft(model: nn.Module) -> bool:
    return any(c.__module__.startswith("peft.") and c.__name__ == "PeftModel" for c in type(model).__mro__)


def hf_offload(model: nn.Module | OffloadBase) -> tuple[nn.Module, OffloadBase]:
    model, off = model_and_offload(model)
    if off is None:
        raise TierValueError(f"{type(model).__name__} is not offloaded: call offload_model(model, store) first")
    return model, off


# ---- save_pretrained -------------------------------------------------------------------------
def save_pretrained(model: nn.Module | OffloadBase, save_directory: str | os.PathLike, *,
                    state_dict: dict[str, Any] | None = None, max_shard_size: int | str = "50GB",
                    **kwargs: Any) -> None:
    """``model.save_pretrained(save_directory, ...)`` of an offloaded transformers or peft model, one tensor at a
    time (see [Note: Saving the transformers way, tensor by tensor]); ``offload_model`` makes it the model's
    ``save_pretrained``. The same files as transformers' (and peft's) own; ``state_dict=`` given is saved by
    theirs as it is, and ``push_to_hub`` is refused (save, then upload the directory)."""
    model, off = hf_offload(model)
    original = partial(type(model).save_pretrained, model, save_directory)
    if state_dict is not None:
        return original(state_dict=state_dict, max_shard_size=max_shard_size, **kwargs)
    if kwargs.get("push_to_hub"):
        raise TierValueError("save_pretrained(push_to_hub=True) of an offloaded model: save it, then upload the "
                             "directory (huggingface_hub's upload_folder)")
    if is_peft(model):
        return original(state_dict=_adapter_state_dict(model, off, kwargs), **kwargs)
    original(state_dict={}, max_shard_size=max_shard_size, **kwargs)  # everything but the tensors
    if not kwargs.get("is_main_process", True):
        return
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    tensors, _ = model_tensors(model, off)
    sources = [tensor_source(off.store, name, v) for name, v in tensors.items() if name not in ignore]
    write_weights(os.fspath(save_directory), sources, max_shard_size, kwargs.get("variant"))


def read_value(off: OffloadBase, v: Any) -> torch.Tensor:
    """The value of a tensor of ``model_tensors``: a store key's, read from the store, or the tensor's."""
    return off.store.read(v) if isinstance(v, str) else v.detach()


def write_weights(directory: str, sources: list[TensorSource], max_shard_size: int | str,
                  variant: str | None = None) -> None:
    """``sources`` as transformers writes a model's weights: one file, or shards of at most ``max_shard_size``
    bytes (a larger tensor alone) with their index; each tensor borrowed while its bytes are written."""
    limit = parse_bytes(max_shard_size, name="max_shard_size")
    name = WEIGHTS_NAME if not variant else f"model.{variant}.safetensors"
    shards: list[list[TensorSource]] = [[]]
    for s in sources:
        if shards[-1] and sum(x.nbytes for x in shards[-1]) + s.nbytes > limit:
            shards.append([])
        shards[-1].append(s)
    stem = name.removesuffix(".safetensors")
    for f in os.listdir(directory):  # what an earlier save left that this one will not replace
        if f.startswith(stem) and f.endswith((".safetensors", ".safetensors.index.json")):
            os.unlink(os.path.join(directory, f))
    if len(shards) == 1:
        write_safetensors_file(os.path.join(directory, name), shards[0], {"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors_file(os.path.join(directory, file), shard, {"format": "pt"})
        weight_map.update(dict.fromkeys((s.name for s in shard), file))
    index = {"metadata": {"total_size": sum(s.nbytes for s in sources)}, "weight_map": weight_map}
    index_name = WEIGHTS_INDEX_NAME if not variant else f"model.safetensors.index.{variant}.json"
    with open(os.path.join(directory, index_name), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


class _Unread:
    """A frozen offloaded tensor's place in the state dict :func:`_adapter_state_dict` shows peft: its store key,
    read only if peft keeps the tensor."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


def _adapter_state_dict(model: nn.Module, off: OffloadBase, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The state dict to give peft's ``save_pretrained``: every tensor of the model but its frozen offloaded ones,
    and of those only what peft keeps of them (embedding layers it saves, say), each read once. peft filters a
    whole state dict into a new dict of its values (``_filter_state_dict_for_adapter_name``), so any dict whose
    values are the base's tensors, however lazily read, would bring the whole base into memory: peft is first
    shown one whose frozen values are stand-ins, and what it keeps of them is what is read. A peft method that
    computes with a frozen base tensor while picking its state (none of LoRA's) gets the lazily read dict."""
    from peft.utils import get_peft_model_state_dict

    tensors, aliases = model_tensors(model, off)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    shown = {n: _Unread(v) if isinstance(v, str) and n in frozen else v for n, v in tensors.items()}
    shown.update({alias: shown[name] for alias, name in aliases.items()})
    adapters = kwargs.get("selected_adapters") or list(model.peft_config)
    try:
        kept = {v.key for a in adapters for v in get_peft_model_state_dict(
            model, state_dict=shown, adapter_name=a,
            save_embedding_layers=kwargs.get("save_embedding_layers", "auto")).values() if isinstance(v, _Unread)}
    except (AttributeError, TypeError):  # it computed with a stand-in
        return _LazyStateDict(model, off)
    return {n: read_value(off, v.key if isinstance(v, _Unread) else v) for n, v in shown.items()
            if not isinstance(v, _Unread) or v.key in kept}


class _LazyStateDict(dict):
    """A model's state dict whose offloaded values are read from the store only when taken: peft picks its
    adapter's entries out of a whole state dict, and the frozen base it leaves is never read."""

    def __init__(self, model: nn.Module, off: OffloadBase) -> None:
        tensors, aliases = model_tensors(model, off)
        super().__init__(tensors)
        self.update({alias: tensors[name] for alias, name in aliases.items()})
        self._off = off

    def __getitem__(self, key: str) -> Any:
        return read_value(self._off, super().__getitem__(key))

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def items(self) -> Iterator[tuple[str, Any]]:  # type: ignore[override]
        return ((k, self[k]) for k in self.keys())

    def values(self) -> Iterator[Any]:  # type: ignore[override]
        return (self[k] for k in self.keys())

    def pop(self, key: str, *default: Any) -> Any:
        if key not in self:
            return default[0] if default else super().pop(key)
        value = self[key]
        super().pop(key)
        return value


def load_base_weights(path: str | os.PathLike, model: nn.Module | OffloadBase, *, strict: bool = True) -> list[str]:
    """Pretrained weights as the base model's ``save_pretrained`` wrote them (one file, or shards and their
    index) loaded into an offloaded peft model built on meta, one tensor at a time, through the host budget; the
    adapters keep their values. For a model without adapters, :func:`~tierstore.integrations.load_safetensors`.
    ``strict``: a base weight missing from the files, or a tensor the base lacks, is an error (nothing loaded)."""
    model, off = hf_offload(model)
    if not is_peft(model):
        return load_safetensors(path, off, strict=strict)
    found = safetensors_entries(path)
    tensors, aliases = model_tensors(model, off)
    base = [n for n in (*tensors, *aliases) if not is_adapter(n)]
    by_file = {base_name(n): n for n in base}
    entries = {by_file[f]: (e["shape"], partial(read_raw, f, e)) for f, e in found.items() if f in by_file}
    loaded = {aliases.get(n, n) for n in entries}
    missing = sorted(n for n in tensors if not is_adapter(n) and n not in loaded)
    unexpected = sorted(f for f in found if f not in by_file)
    if strict and (missing or unexpected):
        raise CheckpointError(f"loading {path} into the base of {type(model).__name__}: missing "
                              f"{[base_name(n) for n in missing[:5]]}, unexpected {unexpected[:5]} (nothing was "
                              f"loaded; strict=False loads what matches)")
    return load_tensors(model, entries, strict=False, source=os.fspath(path), where="the file")


def base_name(name: str) -> str:
    """A peft model's name of a base tensor as the base model names it."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return any(f".{d}." in f".{name}" for d in _ADAPTER_MODULES)


_ADAPTER_MODULES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


__all__ = ["WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "base_name", "hf_offload", "is_adapter", "is_hf_model", "is_peft",
           "load_adapter", "load_base_weights", "methods_for", "read_value", "save_pretrained", "write_weights"]
