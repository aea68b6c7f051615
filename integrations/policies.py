"""The integrations' choices, as small frozen policies (as FSDP2 passes ``MixedPrecisionPolicy`` and
``OffloadPolicy``):

- :class:`ParamOffloadPolicy`: what ``offload_model`` and ``offload_fsdp`` choose for the parameters (how far
  ahead to read them, their home, what stays resident, where kept gradients live);
- :class:`OptimizerStatePolicy`: what ``OffloadedAdamW`` chooses for its state (how moments and masters are
  stored, their home, and so the home of the gradients it steps).

Pass one (``offload_model(model, store, policy=ParamOffloadPolicy(prefetch_depth=4))``); a keyword given to the
function itself overrides the policy's field of that name. A settings file (or a DeepSpeed config) that holds the
store's settings and these choices together, flat (``prefetch_depth``, ``param_tier``, ``optimizer_moments``,
...), is split into the store's config and the two policies by :func:`load_settings` (see [Note: Settings of the
layers above] in ``tierstore/_config.py``): the store knows nothing of these names.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from tierstore import (
    STORE_DEEPSPEED_KEYS,
    DeepSpeedKeys,
    StoreConfig,
    Tier,
    TierValueError,
    check_settings,
    deepspeed_int,
    from_dict,
    parse_bytes,
    read_config_file,
    read_deepspeed,
)

from ._layouts import MASTERS, MOMENTS

P = TypeVar("P", "ParamOffloadPolicy", "OptimizerStatePolicy")


def check_prefetch_depth(depth: object) -> None:
    """``depth`` is "auto" or an integer >= 0, else a ValueError that says so."""
    if depth != "auto" and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise TierValueError(f"prefetch_depth={depth!r} must be \"auto\" or an integer >= 0 (0 turns prefetch off)")


def default_grad_backlog_bytes(host_budget_bytes: int) -> int:
    """OffloadedAdamW's default ``max_grad_backlog_bytes``: a quarter of the host budget (at least a byte; see
    [Note: Splitting the host budget]), stepping in backward or speculating there. The placement leaves that much
    room for the parameters waiting for their updates (see [Note: Updates behind backward] in _placing.py); a
    speculated update's gradients are in the host tier under its budget, and before the room counted them a
    sixteenth was faster (the longer queue squeezed the room: the worker read ahead one update and its gradients
    were written and read back). Counted, on a 201M model of 48 x Linear(2048), fp32, 800 MiB, one run
    alternating: a quarter 1.97 s a step, an eighth 2.27, three eighths 2.08 (the step in backward 1.56)."""
    return max(1, host_budget_bytes // 4)


def _tier(name: str, value: Any) -> Tier:
    """``value`` as a tier; a bad one is an error that names the setting."""
    try:
        return Tier.parse(value)
    except TierValueError as e:
        raise TierValueError(f"{name}={value!r}: {e}") from None


class _Policy:
    """What both policies do: overridden by the keywords a function was given."""

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
    """[grad_tier] Home tier of the gradients kept from backward to the optimizer's step (None: the home of the
    state of the optimizer that steps them, ``OptimizerStatePolicy.home``, once it is built). With an NVMe home a
    gradient stays in the host tier while it has room, and goes to the drive only when the room is needed (see
    [Note: Gradients in the tiers])."""

    def __post_init__(self) -> None:
        check_prefetch_depth(self.prefetch_depth)
        if self.prefetch_bytes is not None:
            object.__setattr__(self, "prefetch_bytes", parse_bytes(self.prefetch_bytes, name="prefetch_bytes"))
            if self.prefetch_bytes <= 0:
                raise TierValueError(f"prefetch_bytes={self.prefetch_bytes} must be a positive number of bytes")
        object.__setattr__(self, "home", _tier("home", self.home))
        threshold = parse_bytes(self.resident_threshold_bytes, name="resident_threshold_bytes")
        if threshold < 0:
            raise TierValueError(f"resident_threshold_bytes={threshold} must be >= 0")
        object.__setattr__(self, "resident_threshold_bytes", threshold)
        if self.grad_tier is not None:
            object.__setattr__(self, "grad_tier", _tier("grad_tier", self.grad_tier))


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
        object.__setattr__(self, "home", _tier("home", self.home))


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
"""The name each choice has in a settings file, beside the store's settings -> (its policy, its field)."""


def _check_flat(flat: str, policy: type[_Policy], field: str, value: Any) -> Any:
    """``value`` of flat setting ``flat`` as ``policy``'s ``field`` holds it; a bad one is named as written."""
    try:
        return getattr(policy(**{field: value}), field)
    except (TierValueError, ValueError, TypeError) as e:  # named as the file names it
        raise type(e)(str(e).replace(f"{field}=", f"{flat}=", 1) if flat != field else str(e)) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """A settings file's (or dict's) three parts: the store's config and the integrations' two policies."""

    store: StoreConfig
    """For ``TierStore(settings.store)``."""
    params: ParamOffloadPolicy = ParamOffloadPolicy()
    """For ``offload_model(model, store, policy=settings.params)`` (and ``offload_fsdp``)."""
    optimizer: OptimizerStatePolicy = OptimizerStatePolicy()
    """For ``OffloadedAdamW(off, policy=settings.optimizer)``."""

    def to_dict(self) -> dict[str, Any]:
        """Every setting flat, as a settings file writes them (tiers as their labels); :func:`split_settings`
        reads it back."""
        out = self.store.to_dict()
        for flat, (policy, field) in FLAT.items():
            out[flat] = getattr(self.params if policy is ParamOffloadPolicy else self.optimizer, field)
        return {k: v.label if isinstance(v, Tier) else v for k, v in out.items()}


def split_settings(values: Mapping[str, Any]) -> Settings:
    """The store's config and the two policies that flat settings (a dict, as a file writes them) give; the
    names no part has are one error that names the closest of each and lists them all."""
    check_settings(values, "the settings", above=FLAT)
    core = {f.name for f in dataclasses.fields(StoreConfig)}
    fields: dict[type[_Policy], dict[str, Any]] = {ParamOffloadPolicy: {}, OptimizerStatePolicy: {}}
    for flat, (policy, field) in FLAT.items():
        if flat in values:
            fields[policy][field] = _check_flat(flat, policy, field, values[flat])
    return Settings(store=from_dict({k: v for k, v in values.items() if k in core}),
                    params=ParamOffloadPolicy(**fields[ParamOffloadPolicy]),
                    optimizer=OptimizerStatePolicy(**fields[OptimizerStatePolicy]))


def _ds_tier(value: Any) -> Tier:
    v = str(value).lower()
    if v == "nvme":
        return Tier.NVME
    if v == "cpu":
        return Tier.HOST
    if v == "none":
        return Tier.DEVICE
    raise TierValueError(f"DeepSpeed offload device {value!r} must be 'nvme', 'cpu' or 'none'")


DEEPSPEED_KEYS: DeepSpeedKeys = {
    **STORE_DEEPSPEED_KEYS,
    "zero_optimization.offload_param.device": ("param_tier", _ds_tier),
    "zero_optimization.offload_optimizer.device": ("optimizer_tier", _ds_tier),
    # DeepSpeed's swap buffers bound how far ahead parameters are read.
    "zero_optimization.offload_param.buffer_count": ("prefetch_depth", lambda v: max(deepspeed_int(v) - 1, 0)),
    # elements of fp16/bf16
    "zero_optimization.stage3_param_persistence_threshold": ("resident_threshold_bytes",
                                                             lambda v: deepspeed_int(v) * 2),
}
"""The DeepSpeed keys honoured: the store's, and those of offload_model and OffloadedAdamW."""


def settings_from_deepspeed(ds: Mapping[str, Any]) -> tuple[Settings, list[str]]:
    """A DeepSpeed config (dict) split as :func:`split_settings` splits flat settings; also the dotted names of the
    keys that tierstore does not honour, reported in one warning too (see ``tierstore.read_deepspeed``)."""
    values, ignored = read_deepspeed(ds, DEEPSPEED_KEYS)
    if ignored:
        warnings.warn("tierstore does not honour these DeepSpeed config keys: " + ", ".join(ignored), stacklevel=2)
    return split_settings(values), ignored


def load_settings(path: str | os.PathLike[str], **overrides: Any) -> Settings:
    """The store's config and the two policies a .json or .toml settings file (or a DeepSpeed config) holds;
    keywords, flat, override the file::

        settings = load_settings("tierstore.toml")
        store = TierStore(settings.store)
        off = offload_model(model, store, policy=settings.params)
        opt = OffloadedAdamW(off, lr=1e-4, policy=settings.optimizer)
    """
    values, deepspeed = read_config_file(path)
    if deepspeed:
        settings, _ = settings_from_deepspeed(values)
        return split_settings({**settings.to_dict(), **overrides}) if overrides else settings
    return split_settings({**values, **overrides})


__all__ = ["FLAT", "OptimizerStatePolicy", "ParamOffloadPolicy", "Settings", "check_prefetch_depth",
           "default_grad_backlog_bytes", "load_settings", "settings_from_deepspeed", "split_settings"]
