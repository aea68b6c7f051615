"""transformers' ``Trainer`` logging what an ``OffloadedAdamW`` did with each step's updates (see [Note: Update
counts in Trainer's logs])."""

from __future__ import annotations

from typing import Any

from tierstore import TierTypeError

from .optim import OffloadedAdamW

# The store's counters of updates, each logged as its change since the last log.
UPDATE_COUNTS = ("updates_streamed", "updates_speculated", "speculated_kept", "speculated_undone")


def log_update_counts(trainer: Any) -> Any:
    """Add to each of ``trainer``'s training logs how many updates its ``OffloadedAdamW`` streamed into the next
    forward, made in backward (speculated), kept and undone since the last log; returns the trainer.

    [Note: Update counts in Trainer's logs] Trainer logs the loss, the gradient norm and the learning rate of each
    logging step (``log_history``, the console, the reporting integrations); with this line beside them come the
    store's counters of what the optimizer did with the updates since the log before: ``updates_streamed``,
    ``updates_speculated``, ``speculated_kept``, ``speculated_undone`` (see [Note: Speculated updates] in
    _speculated.py). A log without a loss (the end of training, an evaluation) is left as it is."""
    opt = trainer.optimizer
    if not isinstance(opt, OffloadedAdamW):
        raise TierTypeError(f"log_update_counts needs a Trainer given an OffloadedAdamW (optimizers=(opt, None)), not "
                            f"{type(opt).__name__}")
    stats = opt.store.stats_dict
    last = {k: stats()[k] for k in UPDATE_COUNTS}
    log = trainer.log

    def log_with_counts(logs: dict[str, float], *args: Any, **kwargs: Any) -> Any:
        if "loss" in logs:
            now = stats()
            logs = {**logs, **{k: now[k] - last[k] for k in UPDATE_COUNTS}}
            last.update({k: now[k] for k in UPDATE_COUNTS})
        return log(logs, *args, **kwargs)

    trainer.log = log_with_counts  # the instance's, over the class's method
    return trainer


__all__ = ["UPDATE_COUNTS", "log_update_counts"]
