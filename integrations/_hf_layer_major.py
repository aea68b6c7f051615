"""transformers' ``Trainer`` running each step's micro-batches layer by layer through its offloaded model (see
[Note: A layer-major step] in _layer_major.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from tierstore import UnsupportedError

from ._hf_pretrained import hf_offload


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
    _, off = hf_offload(trainer.model)
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


__all__ = ["accumulate_layer_major"]
