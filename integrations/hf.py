"""transformers and peft with an offloaded model: ``save_pretrained``, ``Trainer``'s checkpoints and resume, and
merging LoRA adapters, each moving one tensor at a time through the host budget.

[Note: Saving the transformers way, tensor by tensor] transformers'
``save_pretrained`` takes ``model.state_dict()`` (every value read into
memory at once), and safetensors' writer builds each file in memory before
it writes it; ``Trainer`` saves ``torch.save(optimizer.state_dict())``. An
offloaded model bigger than RAM would die at its first checkpoint. So:

- ``model.save_pretrained(directory)`` of a model ``offload_model`` wrapped
  is :func:`save_pretrained`: transformers writes everything but the tensors
  (config, generation config: it is given an empty state dict), then the
  tensors are written as transformers names and shards them
  (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and their
  index past ``max_shard_size``), each borrowed from the store in the host
  tier while its bytes are written. A peft model saves its adapter as peft
  does, from a state dict of every tensor but the frozen base's, of which only
  what peft keeps is read (see :func:`_adapter_state_dict`). The files are plain safetensors:
  ``from_pretrained`` and peft load them.
- :func:`stream_checkpoints` makes a ``Trainer`` save an ``OffloadedAdamW``'s
  state with :func:`~tierstore.integrations.save_checkpoint` (weights left to
  ``save_pretrained``) in ``checkpoint-N/tierstore_optimizer``, and on
  ``resume_from_checkpoint`` load the weights with
  :func:`~tierstore.integrations.load_safetensors` (adapters as peft loads
  them: ``load_adapter`` of an offloaded peft model reads none of the frozen
  base) and the state with :func:`~tierstore.integrations.load_checkpoint`.
- :func:`save_merged` writes a peft LoRA model merged into its base, each
  base weight plus its adapters' product computed as peft's merge computes
  it, one weight at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from tierstore import CheckpointError, TierTypeError, TierValueError, UnsupportedError, parse_bytes
from tierstore.files import (
    TensorSource,
    commit,
    discard,
    new_directory,
    read_raw,
    safetensors_entries,
    write_safetensors_file,
)

from ._base import OffloadBase
from .checkpoint import (
    load_checkpoint,
    load_safetensors,
    load_tensors,
    model_and_offload,
    model_tensors,
    save_checkpoint,
    tensor_source,
)
from .offload import add_model_methods
from .optim import OffloadedAdamW

OPTIMIZER_DIR = "tierstore_optimizer"
SCHEDULER_NAME = "scheduler.pt"  # as Trainer names it
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CHECKPOINT_PREFIX = "checkpoint"  # Trainer's checkpoint-N directories
TRAINER_STATE_NAME = "trainer_state.json"  # as Trainer names it
# Where a Trainer checkpoint is written before it takes its name (see [Note: A Trainer checkpoint appears whole]):
# not a checkpoint-N name, so Trainer's resume never picks it.
STAGING_NAME = ".tierstore-checkpoint"


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
    if _is_peft(model):
        methods["load_adapter"] = partial(load_adapter, off)
    return methods


def load_adapter(model: nn.Module | OffloadBase, *args: Any, **kwargs: Any) -> Any:
    """peft's ``model.load_adapter(...)`` (how ``Trainer`` resumes a peft model) of an offloaded peft model,
    without the base in memory: peft takes ``model.state_dict()`` to learn the model's keys and shapes, which
    would read every offloaded tensor; here those values are left unread (meta tensors of their shapes) while
    peft loads the adapter, which then goes into the store as any ``load_state_dict`` does."""
    model, off = _offloaded(model)
    with off.state_dict_unread():
        return type(model).load_adapter(model, *args, **kwargs)


def _is_peft(model: nn.Module) -> bool:
    return any(c.__module__.startswith("peft.") and c.__name__ == "PeftModel" for c in type(model).__mro__)


def _offloaded(model: nn.Module | OffloadBase) -> tuple[nn.Module, OffloadBase]:
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
    model, off = _offloaded(model)
    original = partial(type(model).save_pretrained, model, save_directory)
    if state_dict is not None:
        return original(state_dict=state_dict, max_shard_size=max_shard_size, **kwargs)
    if kwargs.get("push_to_hub"):
        raise TierValueError("save_pretrained(push_to_hub=True) of an offloaded model: save it, then upload the "
                             "directory (huggingface_hub's upload_folder)")
    if _is_peft(model):
        return original(state_dict=_adapter_state_dict(model, off, kwargs), **kwargs)
    original(state_dict={}, max_shard_size=max_shard_size, **kwargs)  # everything but the tensors
    if not kwargs.get("is_main_process", True):
        return
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    tensors, _ = model_tensors(model, off)
    sources = [tensor_source(off.store, name, v) for name, v in tensors.items() if name not in ignore]
    write_weights(os.fspath(save_directory), sources, max_shard_size, kwargs.get("variant"))


def _read(off: OffloadBase, v: Any) -> torch.Tensor:
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
    return {n: _read(off, v.key if isinstance(v, _Unread) else v) for n, v in shown.items()
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
        return _read(self._off, super().__getitem__(key))

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
    model, off = _offloaded(model)
    if not _is_peft(model):
        return load_safetensors(path, off, strict=strict)
    found = safetensors_entries(path)
    tensors, aliases = model_tensors(model, off)
    base = [n for n in (*tensors, *aliases) if not _is_adapter(n)]
    by_file = {base_name(n): n for n in base}
    entries = {by_file[f]: (e["shape"], partial(read_raw, f, e)) for f, e in found.items() if f in by_file}
    loaded = {aliases.get(n, n) for n in entries}
    missing = sorted(n for n in tensors if not _is_adapter(n) and n not in loaded)
    unexpected = sorted(f for f in found if f not in by_file)
    if strict and (missing or unexpected):
        raise CheckpointError(f"loading {path} into the base of {type(model).__name__}: missing "
                              f"{[base_name(n) for n in missing[:5]]}, unexpected {unexpected[:5]} (nothing was "
                              f"loaded; strict=False loads what matches)")
    return load_tensors(model, entries, strict=False, source=os.fspath(path), where="the file")


def base_name(name: str) -> str:
    """A peft model's name of a base tensor as the base model names it."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _is_adapter(name: str) -> bool:
    return any(f".{d}." in f".{name}" for d in _ADAPTER_MODULES)


_ADAPTER_MODULES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


# ---- Trainer ---------------------------------------------------------------------------------
def stream_checkpoints(trainer: Any) -> Any:
    """Make transformers' ``trainer`` save and resume its offloaded model and ``OffloadedAdamW`` one tensor at a
    time (see [Note: Saving the transformers way, tensor by tensor]); returns ``trainer``.

    One line after building the Trainer: ``stream_checkpoints(trainer)``. Its checkpoints then hold the model as
    ``save_pretrained`` writes it (adapters only, for a peft model), ``tierstore_optimizer/`` (the optimizer's
    state, checksummed) and the scheduler, RNG and trainer state as Trainer writes them; ``resume_from_checkpoint``
    reads them back the same way. Without it, Trainer's ``torch.save(optimizer.state_dict())`` reads the whole
    optimizer state into memory at each checkpoint.
    """
    if getattr(trainer, "_tierstore_streams", False):
        return trainer
    model, off = _offloaded(trainer.model)
    save_state, load_state = trainer._save_optimizer_and_scheduler, trainer._load_optimizer_and_scheduler
    load_weights = trainer._load_from_checkpoint

    def optimizer() -> OffloadedAdamW | None:
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
        return opt if isinstance(opt, OffloadedAdamW) else None

    def save_optimizer_and_scheduler(output_dir: str) -> None:
        opt = optimizer()
        if opt is None:
            return save_state(output_dir)
        save_checkpoint(os.path.join(output_dir, OPTIMIZER_DIR), off, opt, weights=False)
        if trainer.args.should_save and trainer.lr_scheduler is not None:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def load_optimizer_and_scheduler(checkpoint: str | None) -> None:
        opt = optimizer()
        if checkpoint is None or opt is None or not os.path.isdir(os.path.join(checkpoint, OPTIMIZER_DIR)):
            return load_state(checkpoint)
        load_checkpoint(os.path.join(checkpoint, OPTIMIZER_DIR), off, opt, strict=False)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if trainer.lr_scheduler is not None and os.path.isfile(scheduler):
            trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def load_from_checkpoint(resume_from_checkpoint: str, model_: nn.Module | None = None) -> None:
        whole = any(os.path.isfile(os.path.join(resume_from_checkpoint, f))
                    for f in (WEIGHTS_NAME, WEIGHTS_INDEX_NAME))
        if (model_ is None or model_ is model) and whole and not _is_peft(model):
            load_safetensors(resume_from_checkpoint, off)
            return None
        return load_weights(resume_from_checkpoint, model_)

    trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler
    trainer._load_optimizer_and_scheduler = load_optimizer_and_scheduler
    trainer._load_from_checkpoint = load_from_checkpoint
    trainer._save_checkpoint = partial(_save_checkpoint_whole, trainer, trainer._save_checkpoint)
    trainer._tierstore_streams = True
    return trainer


def accumulate_layer_major(trainer: Any) -> Any:
    """Make transformers' ``trainer`` run each step's micro-batches (``gradient_accumulation_steps``) layer by
    layer through its offloaded model (see [Note: A layer-major step]); returns ``trainer``.

    One line after building the Trainer: ``accumulate_layer_major(trainer)``. Trainer then gathers a step's
    micro-batches as it does and calls ``training_step`` for each; the first call runs all of them through
    ``off.accumulate`` (each micro-batch's ``training_step`` as Trainer wrote it, forward and backward, on a thread
    of its own) and the others return their own results. Gradients, losses and logs are those of Trainer's own
    loop, bit for bit in fp32; each weight is read about once forward and once backward a step, whatever the
    number of micro-batches.
    """
    if getattr(trainer, "_tierstore_layer_major", False):
        return trainer
    _, off = _offloaded(trainer.model)
    if not hasattr(trainer, "get_batch_samples"):
        raise UnsupportedError("accumulate_layer_major needs a transformers whose Trainer gathers a step's "
                               "micro-batches first (Trainer.get_batch_samples, transformers >= 4.46)")
    gather, training_step = trainer.get_batch_samples, trainer.training_step
    step: dict[str, Any] = {"batch": [], "results": {}}

    def get_batch_samples(*args: Any, **kwargs: Any) -> Any:
        batch_samples, num_items = gather(*args, **kwargs)
        step["batch"], step["results"] = list(batch_samples), {}
        return batch_samples, num_items

    def training_step_of_the_step(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        results = step["results"]
        if id(inputs) not in results:
            if not any(inputs is b for b in step["batch"]):  # not one of the step's micro-batches
                return training_step(model, inputs, *args, **kwargs)
            batch = step["batch"]
            out = off.accumulate(lambda mb: training_step(model, mb, *args, **kwargs), batch)
            results.update({id(b): r for b, r in zip(batch, out)})
        return results.pop(id(inputs))

    trainer.get_batch_samples = get_batch_samples
    trainer.training_step = training_step_of_the_step
    trainer._tierstore_layer_major = True
    return trainer


def _save_checkpoint_whole(trainer: Any, save: Any, model: nn.Module, trial: Any, *args: Any, **kwargs: Any) -> None:
    """[Note: A Trainer checkpoint appears whole] ``Trainer`` writes
    ``checkpoint-N`` file by file (weights, optimizer, scheduler, RNG, and
    ``trainer_state.json`` last), and ``resume_from_checkpoint=True`` takes the
    highest-numbered ``checkpoint-N`` there is: a save killed part-way left one
    it picked and refused ("Can't find a valid checkpoint", a missing
    ``trainer_state.json``) until someone deleted it. So the save is written
    whole into a private staging directory (``.tierstore-checkpoint.tmp-*``,
    locked by this process; one a killed save left is removed by the next
    save), every file fsynced, and renamed to ``checkpoint-N`` as the store's
    own checkpoints are committed (see [Note: Atomic checkpoint commit]). A
    resume after a kill then continues from the last whole checkpoint. What
    Trainer does after the write with the directory's name is done here on
    the committed one: the best checkpoint's path (written again into its
    ``trainer_state.json`` where it changed) and the rotation of old
    checkpoints (``save_total_limit``). Runs of several processes and
    ``push_to_hub`` save as Trainer does."""
    args_ = trainer.args
    if not args_.should_save or args_.world_size > 1 or args_.push_to_hub:
        return save(model, trial, *args, **kwargs)
    run_dir = trainer._get_output_dir(trial=trial)
    os.makedirs(run_dir, exist_ok=True)
    name = f"{CHECKPOINT_PREFIX}-{trainer.state.global_step}"
    final = os.path.join(run_dir, name)
    staging = new_directory(os.path.join(run_dir, STAGING_NAME))
    trainer._get_output_dir = lambda *_a, **_k: staging  # the instance's, over the class's method
    try:
        save(model, trial, *args, **kwargs)
        written = os.path.join(staging, name)
        _fsync_files(written)
        commit(written, final)
    finally:
        del trainer._get_output_dir
        discard(staging)
    state = trainer.state
    best = state.best_model_checkpoint
    if best is not None and os.path.dirname(os.path.abspath(best)) == os.path.abspath(staging):
        best = os.path.join(run_dir, os.path.basename(best))  # named by the save itself
    best_step = getattr(state, "best_global_step", None)
    if best_step and os.path.isdir(os.path.join(run_dir, f"{CHECKPOINT_PREFIX}-{best_step}")):
        best = os.path.join(run_dir, f"{CHECKPOINT_PREFIX}-{best_step}")
    if best != state.best_model_checkpoint:
        state.best_model_checkpoint = best
        tmp = os.path.join(final, TRAINER_STATE_NAME + ".tmp")
        state.save_to_json(tmp)
        _fsync_files(tmp)
        os.replace(tmp, os.path.join(final, TRAINER_STATE_NAME))
    _rotate_checkpoints(trainer, run_dir)


def _fsync_files(path: str) -> None:
    """fsync ``path`` (a file), or every file and directory under it."""
    paths = [path] if os.path.isfile(path) else \
        [p for d, _, names in os.walk(path) for p in (*(os.path.join(d, n) for n in names), d)]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _rotate_checkpoints(trainer: Any, run_dir: str) -> None:
    """Trainer's removal of old checkpoints past ``save_total_limit``, in ``run_dir``."""
    rotate = getattr(trainer, "_rotate_checkpoints", None)
    if rotate is not None:  # transformers 4
        rotate(use_mtime=False, output_dir=run_dir)
        return
    from transformers.trainer_utils import rotate_checkpoints

    rotate_checkpoints(output_dir=run_dir, save_total_limit=trainer.args.save_total_limit,
                       best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)


# ---- merging adapters ------------------------------------------------------------------------
def save_merged(model: nn.Module | OffloadBase, save_directory: str | os.PathLike, *,
                max_shard_size: int | str = "50GB") -> None:
    """Save a peft LoRA model merged into its base, as ``model.merge_and_unload().save_pretrained(...)`` would,
    without the base in memory: each base weight is borrowed from the store, its active adapters' product added
    as peft's merge adds it, and written; the model itself is left as it is (adapters unmerged). The files are
    the base model's (``from_pretrained`` of the base class loads them)."""
    model, off = _offloaded(model)
    if not _is_peft(model):
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
        if _is_adapter(name):
            continue
        module, _, leaf = name.rpartition(".")
        out = base_name(name)
        layer = layers.get(module.removesuffix(".base_layer")) if module.endswith(".base_layer") else None
        source = tensor_source(off.store, out, v)
        if layer is not None and leaf == "weight":
            source = _merged_source(source, layer, lambda name: _read(off, tensors[name]),
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


add_model_methods(methods_for)  # see [Note: Saving the transformers way, tensor by tensor]

__all__ = ["accumulate_layer_major", "load_base_weights", "save_merged", "save_pretrained", "stream_checkpoints"]
