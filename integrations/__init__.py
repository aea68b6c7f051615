"""Hooks that attach a TierStore to training loops and distributed engines: the public front.

    from tierstore.integrations import offload_model, OffloadedAdamW, save_checkpoint, load_checkpoint
"""

from ._contract import OffloadedParameters
from ._pipeline import UnrestorableUpdateError
from .checkpoint import (
    consolidate_checkpoint,
    load_checkpoint,
    load_parameters,
    load_safetensors,
    save_checkpoint,
)
from .fsdp import FSDPOffload, offload_fsdp
from .hf import (
    accumulate_layer_major,
    load_base_weights,
    log_update_counts,
    save_merged,
    save_pretrained,
    stream_checkpoints,
)
from .offload import DEFAULT_UNITS, OffloadedModel, OffloadedParameterError, offload_model
from .optim import OffloadedAdamW, OffloadedGradScaler
from .policies import (
    OptimizerStatePolicy,
    ParamOffloadPolicy,
    Settings,
    default_grad_backlog_bytes,
    load_settings,
    settings_from_deepspeed,
    split_settings,
)

__all__ = [
    "DEFAULT_UNITS",
    "FSDPOffload",
    "OffloadedAdamW",
    "OffloadedGradScaler",
    "OffloadedModel",
    "OffloadedParameters",
    "OffloadedParameterError",
    "OptimizerStatePolicy",
    "ParamOffloadPolicy",
    "Settings",
    "UnrestorableUpdateError",
    "accumulate_layer_major",
    "log_update_counts",
    "consolidate_checkpoint",
    "default_grad_backlog_bytes",
    "load_base_weights",
    "load_checkpoint",
    "load_parameters",
    "load_safetensors",
    "load_settings",
    "offload_fsdp",
    "offload_model",
    "save_checkpoint",
    "save_merged",
    "save_pretrained",
    "settings_from_deepspeed",
    "split_settings",
    "stream_checkpoints",
]
