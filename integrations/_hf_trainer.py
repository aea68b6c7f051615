"""transformers' ``Trainer`` saving and resuming an offloaded model and its ``OffloadedAdamW`` one tensor at a time,
each checkpoint appearing whole (see [Note: Saving the transformers way, tensor by tensor] in hf.py, [Note: A
Trainer checkpoint appears whole])."""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
from torch import nn

from tierstore.files import commit, discard, fsync_tree, new_directory, replace_file

from ._hf_pretrained import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, hf_offload, is_peft
from .checkpoint import load_checkpoint, load_safetensors, save_checkpoint
from .optim import OffloadedAdamW

OPTIMIZER_DIR = "tierstore_optimizer"
SCHEDULER_NAME = "scheduler.pt"  # as Trainer names it
CHECKPOINT_PREFIX = "checkpoint"  # Trainer's checkpoint-N directories
TRAINER_STATE_NAME = "trainer_state.json"  # as Trainer names it
# Where a Trainer checkpoint is written before it takes its name (see [Note: A Trainer checkpoint appears whole]):
# not a checkpoint-N name, so Trainer's resume never picks it.
STAGING_NAME = ".tierstore-checkpoint"


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
    model, off = hf_offload(trainer.model)
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
        if (model_ is None or model_ is model) and whole and not is_peft(model):
            load_safetensors(resume_from_checkpoint, off)
            return None
        return load_weights(resume_from_checkpoint, model_)

    trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler
    trainer._load_optimizer_and_scheduler = load_optimizer_and_scheduler
    trainer._load_from_checkpoint = load_from_checkpoint
    trainer._save_checkpoint = partial(_save_checkpoint_whole, trainer, trainer._save_checkpoint)
    trainer._tierstore_streams = True
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
        fsync_tree(written)  # Trainer wrote these files: on the drive before the commit names them
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
        replace_file(tmp, os.path.join(final, TRAINER_STATE_NAME))
    _rotate_checkpoints(trainer, run_dir)


def _rotate_checkpoints(trainer: Any, run_dir: str) -> None:
    """Trainer's removal of old checkpoints past ``save_total_limit``, in ``run_dir``."""
    rotate = getattr(trainer, "_rotate_checkpoints", None)
    if rotate is not None:  # transformers 4
        rotate(use_mtime=False, output_dir=run_dir)
        return
    from transformers.trainer_utils import rotate_checkpoints

    rotate_checkpoints(output_dir=run_dir, save_total_limit=trainer.args.save_total_limit,
                       best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)


__all__ = ["OPTIMIZER_DIR", "stream_checkpoints"]
