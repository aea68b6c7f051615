"""transformers and peft with an offloaded model: ``save_pretrained``, ``Trainer``'s checkpoints and resume, and
merging LoRA adapters, each moving one tensor at a time through the host budget. The front of five modules, one
job each: transformers' and peft's files (``_hf_pretrained.py``), Trainer's checkpoints (``_hf_trainer.py``),
Trainer's micro-batches layer by layer (``_hf_layer_major.py``), merged adapters (``_hf_merge.py``), and what the
optimizer did with the updates in Trainer's logs (``_hf_logs.py``).

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

from ._hf_layer_major import accumulate_layer_major
from ._hf_logs import log_update_counts
from ._hf_merge import save_merged
from ._hf_pretrained import load_base_weights, methods_for, save_pretrained
from ._hf_trainer import stream_checkpoints
from .offload import add_model_methods

add_model_methods(methods_for)  # see [Note: Saving the transformers way, tensor by tensor]

__all__ = ["accumulate_layer_major", "load_base_weights", "log_update_counts", "save_merged", "save_pretrained",
           "stream_checkpoints"]
