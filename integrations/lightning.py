"""PyTorch Lightning's checkpoints of an offloaded model within the host budget: one plugin.

Lightning's own writer (``TorchCheckpointIO``) serializes the whole checkpoint into memory (``torch.save`` into a
``BytesIO``) and then writes that buffer to the file: for a state beyond the host budget, all of it in ordinary
memory at once, whatever the state dicts hold. :class:`MappedCheckpointIO` writes ``torch.save`` straight into a
file beside the checkpoint, one tensor after another as they come (the state dicts' tensors are copies mapped
from files beyond the budget: see [Note: A whole state dict beyond the host budget]), and renames it into place
once whole, so a run killed while saving keeps its last checkpoint; a load maps the file (``mmap=True``) and the
model and the optimizer read it tensor by tensor::

    trainer = pytorch_lightning.Trainer(..., plugins=[MappedCheckpointIO()])

It subclasses the ``CheckpointIO`` of ``pytorch_lightning`` (``lightning_fabric``) where that is installed, else
that of the unified ``lightning`` package. Local paths only.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tierstore import CheckpointNotFoundError, TierTypeError, TierValueError
from tierstore.files import replace_file

try:
    from lightning_fabric.plugins import CheckpointIO
except ImportError:  # the unified package alone
    from lightning.fabric.plugins import CheckpointIO


class MappedCheckpointIO(CheckpointIO):
    """Lightning's checkpoints written and read one tensor at a time (see the module's docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TierTypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (got "
                            f"{storage_options!r}), as Lightning's TorchCheckpointIO takes none")
        path = _local(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
            replace_file(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        path = _local(path)
        if not os.path.exists(path):
            raise CheckpointNotFoundError(f"Checkpoint file not found: {path}")
        return torch.load(path, map_location=map_location, mmap=True, weights_only=weights_only)  # as Lightning's

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        path = _local(path)
        if os.path.exists(path):
            os.unlink(path)


def _local(path: str | os.PathLike) -> str:
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise TierValueError(f"MappedCheckpointIO writes local files only, not {text!r}: save to a local path "
                             f"(and copy it after), or leave the plugin out")
    return os.path.abspath(text.removeprefix("file://"))


__all__ = ["MappedCheckpointIO"]
