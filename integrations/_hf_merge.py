"""A peft LoRA model saved merged into its base, one base weight at a time."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tierstore import TierTypeError, UnsupportedError
from tierstore.files import TensorSource

from ._base import OffloadBase
from ._hf_pretrained import base_name, hf_offload, is_adapter, is_peft, read_value, write_weights
from .checkpoint import model_tensors, tensor_source


def save_merged(model: nn.Module | OffloadBase, save_directory: str | os.PathLike, *,
                max_shard_size: int | str = "50GB") -> None:
    """Save a peft LoRA model merged into its base, as ``model.merge_and_unload().save_pretrained(...)`` would,
    without the base in memory: each base weight is borrowed from the store, its active adapters' product added
    as peft's merge adds it, and written; the model itself is left as it is (adapters unmerged). The files are
    the base model's (``from_pretrained`` of the base class loads them)."""
    model, off = hf_offload(model)
    if not is_peft(model):
        raise TierTypeError(f"save_merged takes a peft model (get_peft_model), not {type(model).__name__}")
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, m in layers.items():
        variant = any(a in getattr(m, "lora_variant", {}) or m.lora_bias.get(a) for a in m.active_adapters)
        if type(m) is not LoraLinear or variant:
            raise UnsupportedError(f"save_merged merges plain LoRA on Linear (and GPT-2's Conv1D) layers; {name} "
                                      f"is a {type(m).__name__}{' with a LoRA variant or bias' if variant else ''}")
    if any(type(m).__name__ == "ModulesToSaveWrapper" for m in model.modules()):
        raise UnsupportedError("save_merged: modules_to_save are not merged; save the adapter instead")
    base = model.get_base_model()
    type(base).save_pretrained(base, save_directory, state_dict={}, max_shard_size=max_shard_size)
    tensors, _ = model_tensors(model, off)
    sources = []
    for name, v in tensors.items():
        if is_adapter(name):
            continue
        module, _, leaf = name.rpartition(".")
        out = base_name(name)
        layer = layers.get(module.removesuffix(".base_layer")) if module.endswith(".base_layer") else None
        source = tensor_source(off.store, out, v)
        if layer is not None and leaf == "weight":
            source = _merged_source(source, layer, lambda name: read_value(off, tensors[name]),
                                    module.removesuffix(".base_layer"))
        sources.append(source)
    write_weights(os.fspath(save_directory), sources, max_shard_size)


def _merged_source(source: TensorSource, layer: Any, value: Any, layer_name: str) -> TensorSource:
    """``source`` with ``layer``'s active adapters merged in, computed as peft's ``Linear.get_delta_weight`` and
    ``merge`` compute them (in fp32 on the CPU for bf16/fp16 adapters, added in the weight's dtype)."""

    @contextmanager
    def borrow() -> Iterator[torch.Tensor]:
        with source.borrow() as w:
            merged = w.clone()
        for a in layer.active_adapters:
            if a not in layer.lora_A:
                continue
            weight_a = value(f"{layer_name}.lora_A.{a}.weight")
            weight_b = value(f"{layer_name}.lora_B.{a}.weight")
            dtype = weight_b.dtype
            if dtype in (torch.float16, torch.bfloat16):
                weight_a, weight_b = weight_a.float(), weight_b.float()
            delta = weight_b @ weight_a
            if layer.fan_in_fan_out:
                delta = delta.T
            delta = (delta * layer.scaling[a]).to(dtype)
            merged += delta
        yield merged

    return TensorSource(source.name, source.shape, source.dtype, borrow)


__all__ = ["save_merged"]
