"""Checkpoint files (public API of the core): safetensors written and read tensor by tensor, checksummed
manifests, and the atomic commit of a checkpoint directory (see tierstore/_checkpoint.py's notes).

What a checkpoint of a model holds, and in what order, is the integrations' business; this module knows
tensors only by name and a way to borrow each one (:class:`TensorSource`) while its bytes are written.
"""

from ._checkpoint import (
    MANIFEST,
    PinnedCheckpoint,
    TensorSource,
    commit,
    discard,
    dtype_from_name,
    dtype_name,
    fsync_tree,
    new_directory,
    read_into,
    read_manifest,
    read_raw,
    read_safetensors,
    read_tensor,
    replace_file,
    safetensors_entries,
    verify_tensor,
    write_checkpoint,
    write_files,
    write_safetensors_file,
)

__all__ = ["MANIFEST", "PinnedCheckpoint", "TensorSource", "commit", "discard", "dtype_from_name", "dtype_name",
           "fsync_tree", "new_directory", "read_into", "read_manifest", "read_raw", "read_safetensors", "read_tensor",
           "replace_file", "safetensors_entries", "verify_tensor", "write_checkpoint", "write_files",
           "write_safetensors_file"]
