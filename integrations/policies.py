"""The integrations' choices, as small frozen policies (as FSDP2 passes ``MixedPrecisionPolicy`` and
``OffloadPolicy``):

- :class:`ParamOffloadPolicy`: what ``offload_model`` and ``offload_fsdp`` choose for the parameters (how far
  ahead to read them, their home, what stays resident, where kept gradients live);
- :class:`OptimizerStatePolicy`: what ``OffloadedAdamW`` chooses for its state (how moments and masters are
  stored, and their home).

Pass one (``offload_model(model, store, policy=ParamOffloadPolicy(prefetch_depth=4))``), or write the same
choices flat where the store's settings are written (a config file, a DeepSpeed config, ``TierStore(**settings)``:
``prefetch_depth``, ``param_tier``, ``optimizer_moments``, ...): this module declares those names to the store
(see [Note: Settings of the layers above]), which keeps them in ``StoreConfig.layer_settings`` for
``ParamOffloadPolicy.of(store)`` and ``OptimizerStatePolicy.of(store)`` to read. A keyword given to the function
itself overrides both.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, TypeVar

from tierstore import StoreConfig, Tier, TierStore, TierValueError, parse_bytes, register_layer_settings
from tierstore.scheduling import check_prefetch_depth

from ._layouts import MASTERS, MOMENTS

P = TypeVar("P", "ParamOffloadPolicy", "OptimizerStatePolicy")


class _Policy:
    """What both policies do: built from a store's settings, and overridden by the keywords a function was
    given."""

    @classmethod
    def of(cls: type[P], store: TierStore | StoreConfig) -> P:
        """The policy a store's settings (or a config's) give: their flat names in ``StoreConfig.layer_settings``,
        the defaults for the rest."""
        given = (store if isinstance(store, StoreConfig) else store.config).layer_settings
        return cls(**{field: given[flat] for flat, (owner, field) in FLAT.items() if owner is cls and flat in given})

    def overridden(self: P, **given: Any) -> P:
        """This policy with the keywords that are not None in place of its own."""
        given = {k: v for k, v in given.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamOffloadPolicy(_Policy):
    """How ``offload_model`` and ``offload_fsdp`` offload parameters (config names in brackets)."""

    prefetch_depth: int | Literal["auto"] = "auto"
    """[prefetch_depth] How many units ahead of use the scheduler keeps in flight; "auto" chooses it each step
    from the measured drive rate and compute time per unit; 0 turns prefetch off, the optimizer's read-ahead
    included."""
    prefetch_bytes: int | None = None
    """[prefetch_bytes] If set, also stop prefetching once this many bytes are in flight ahead of use."""
    home: Tier = Tier.NVME
    """[param_tier] Home tier of offloaded parameters."""
    resident_threshold_bytes: int = 0
    """[resident_threshold_bytes] Parameters smaller than this stay resident and are never offloaded."""
    grad_tier: Tier | None = None
    """[grad_tier] Home tier of the gradients kept from backward to the optimizer's step (None: the optimizer
    state's home). With an NVMe home a gradient stays in the host tier while it has room, and goes to the drive
    only when the room is needed (see [Note: Gradients in the tiers])."""

    def __post_init__(self) -> None:
        check_prefetch_depth(self.prefetch_depth)
        if self.prefetch_bytes is not None:
            object.__setattr__(self, "prefetch_bytes", parse_bytes(self.prefetch_bytes, name="prefetch_bytes"))
            if self.prefetch_bytes <= 0:
                raise TierValueError(f"prefetch_bytes={self.prefetch_bytes} must be a positive number of bytes")
        object.__setattr__(self, "home", Tier.parse(self.home))
        threshold = parse_bytes(self.resident_threshold_bytes, name="resident_threshold_bytes")
        if threshold < 0:
            raise TierValueError(f"resident_threshold_bytes={threshold} must be >= 0")
        object.__setattr__(self, "resident_threshold_bytes", threshold)
        if self.grad_tier is not None:
            object.__setattr__(self, "grad_tier", Tier.parse(self.grad_tier))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerStatePolicy(_Policy):
    """How ``OffloadedAdamW`` keeps its state (config names in brackets); see [Note: Compressed optimizer
    state]."""

    moments: Literal["fp32", "bf16", "8bit"] = "fp32"
    """[optimizer_moments] The AdamW moments: "fp32" (as torch keeps them), "bf16" or "8bit" (block-wise dynamic
    quantization)."""
    master: Literal["fp32", "split", "none"] = "fp32"
    """[optimizer_master] The master of a bf16 weight: "fp32" (a copy beside it), "split" (the weight is its top
    half, the low half is stored apart: exact, 2 bytes more) or "none" (stochastic rounding)."""
    home: Tier = Tier.NVME
    """[optimizer_tier] Home tier of the optimizer state (masters and moments)."""

    def __post_init__(self) -> None:
        for name, choices in (("moments", MOMENTS), ("master", MASTERS)):
            if getattr(self, name) not in choices:
                raise TierValueError(f"{name}={getattr(self, name)!r}: choose one of {', '.join(map(repr, choices))}")
        object.__setattr__(self, "home", Tier.parse(self.home))


FLAT: dict[str, tuple[type[_Policy], str]] = {
    "prefetch_depth": (ParamOffloadPolicy, "prefetch_depth"),
    "prefetch_bytes": (ParamOffloadPolicy, "prefetch_bytes"),
    "param_tier": (ParamOffloadPolicy, "home"),
    "resident_threshold_bytes": (ParamOffloadPolicy, "resident_threshold_bytes"),
    "grad_tier": (ParamOffloadPolicy, "grad_tier"),
    "optimizer_tier": (OptimizerStatePolicy, "home"),
    "optimizer_moments": (OptimizerStatePolicy, "moments"),
    "optimizer_master": (OptimizerStatePolicy, "master"),
}
"""The name each choice has where the store's settings are written -> (its policy, its field)."""


def _check_flat(flat: str, policy: type[_Policy], field: str) -> Any:
    def check(value: Any) -> Any:
        try:
            return getattr(policy(**{field: value}), field)
        except (TierValueError, ValueError, TypeError) as e:  # named as the config names it
            raise type(e)(str(e).replace(f"{field}=", f"{flat}=", 1) if flat != field else str(e)) from None
    return check


for _flat, (_policy, _field) in FLAT.items():
    register_layer_settings(f"{_policy.__name__}.{_field}", {
        _flat: (_policy.__dataclass_fields__[_field].default, _check_flat(_flat, _policy, _field))})


__all__ = ["FLAT", "OptimizerStatePolicy", "ParamOffloadPolicy"]
