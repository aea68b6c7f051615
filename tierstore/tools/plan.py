"""`tierstore plan`: ZeRO-3 memory math per rank and tier, and the bytes each step moves over each link.

[Note: What a rank holds] With P parameters sharded over N ranks in a
b-byte compute dtype, each rank holds P*b/N bytes of weights and (while
backward runs) P*b/N of gradients. Adam adds two fp32 moments (8 bytes per
parameter) and, unless the compute dtype is fp32, an fp32 master copy (4
more): 12 bytes per parameter with mixed precision, the "16 bytes per
parameter" of ZeRO with the bf16 weights and gradients. Homes are chosen
like the store's config: weights first (used twice per step), then the
optimizer state (once per step; host or NVMe, as the optimizer steps on the
CPU), each in the fastest tier whose per-rank budget holds all of it, after
a reserve of the host budget for the prefetch window.

[Note: The plan's placement] Within one rank, the offloaded model does
better than whole categories: once a step is recorded, its placement keeps
what saves the most drive traffic per byte in the host tier and streams the
rest (tierstore/_placement.py). The plan runs the same policy over a model of
``layers`` equal blocks (forward, backward in reverse, each block's update
after its backward) and prints what it predicts a step moves and the lower
bound; ``bench step`` prints the same two figures from the real trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierstore import Tier
from tierstore._placement import layered_trace, plan_placement, room_bytes

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_OPTIMIZERS = ("adamw", "sgd", "none")
GB = 1e9


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """What to plan for. Budgets are per rank; None means unlimited (nvme) or none (device, host)."""

    params: int
    ranks: int = 1
    dtype: str = "bf16"
    optimizer: str = "adamw"
    device_budget_bytes: int | None = None
    host_budget_bytes: int | None = None
    nvme_budget_bytes: int | None = None
    prefetch_reserve: float = 0.25  # share of the host budget kept for reads in flight
    layers: int = 24  # equal blocks, for the placement (see [Note: The plan's placement])

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise ValueError(f"params={self.params} must be > 0 (e.g. 7e9)")
        if self.ranks < 1:
            raise ValueError(f"ranks={self.ranks} must be >= 1")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(_DTYPE_BYTES)}")
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: choose one of {', '.join(_OPTIMIZERS)}")
        if self.layers < 1:
            raise ValueError(f"layers={self.layers} must be >= 1")
        if not 0 <= self.prefetch_reserve < 1:
            raise ValueError(f"prefetch_reserve={self.prefetch_reserve} must be in [0, 1)")


def make_plan(cfg: PlanConfig) -> dict[str, Any]:
    """Totals, per-rank holdings, homes per tier and per-step traffic, all in bytes."""
    p, n, b = cfg.params, cfg.ranks, _DTYPE_BYTES[cfg.dtype]
    moments = 8 * p if cfg.optimizer == "adamw" else 0
    master = 4 * p if cfg.optimizer == "adamw" and cfg.dtype != "fp32" else 0
    totals = {"weights": p * b, "grads": p * b, "moments": moments, "master": master,
              "optimizer_state": moments + master}
    per_rank = {k: v / n for k, v in totals.items()}
    free = {
        Tier.DEVICE: float(cfg.device_budget_bytes or 0),
        Tier.HOST: float(cfg.host_budget_bytes or 0) * (1 - cfg.prefetch_reserve),
        Tier.NVME: float("inf") if cfg.nvme_budget_bytes is None else float(cfg.nvme_budget_bytes),
    }
    homes: dict[str, str | None] = {}
    by_tier = {t.label: 0.0 for t in Tier}
    # The offloaded optimizer steps on the CPU, so its state lives on the host or the drive.
    for what, tiers in (("weights", tuple(Tier)), ("optimizer_state", (Tier.HOST, Tier.NVME))):
        need = per_rank[what]
        tier = next((t for t in tiers if need <= free[t]), None)
        homes[what] = tier.label if tier is not None else None
        if tier is not None:
            free[tier] -= need
            by_tier[tier.label] += need
    w_home, o_home = homes["weights"], homes["optimizer_state"]
    w, o = per_rank["weights"], per_rank["optimizer_state"]
    others = (n - 1) / n  # the share of each collective's bytes that comes from (or goes to) other ranks
    stepped_on_cpu = cfg.optimizer != "none"
    traffic = {
        # [Note: Link traffic] FSDP2 all-gathers the whole weights into every rank for forward and again for
        # backward: each rank receives the other ranks' shards, 2 x weights x (N-1)/N; the reduce-scatter
        # sends each rank's gradient for the others' shards, grads x (N-1)/N.
        "all_gather": 2 * totals["weights"] * others,
        "reduce_scatter": totals["grads"] * others,
        # Weights are read for forward and backward and, when they are the fp32 master, by the optimizer.
        "nvme_read": (w * (2 if master else 3) if w_home == "nvme" else 0.0) + (o if o_home == "nvme" else 0.0),
        "nvme_write": (o if o_home == "nvme" else 0.0) + (w if w_home == "nvme" else 0.0),
        # Shards kept off the device come to it before each all-gather; the optimizer steps on the CPU, so
        # the gradient shard goes down and, for weights homed on the device, the updated shard comes back.
        "host_to_device": (2 * w if w_home != "device" else 0.0) + (w if w_home == "device" and stepped_on_cpu
                                                                     else 0.0),
        "device_to_host": per_rank["grads"] if stepped_on_cpu else 0.0,
    }
    fits = all(h is not None for h in homes.values())
    return {"config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "totals": totals,
            "per_rank": per_rank, "homes": homes, "per_rank_by_tier": by_tier, "traffic_per_step": traffic,
            "fits": fits, "placement": _placement(cfg, per_rank, homes)}


def _placement(cfg: PlanConfig, per_rank: dict[str, float], homes: dict[str, str | None]) -> dict[str, Any] | None:
    """What the offloaded model's placement predicts for one rank (see [Note: The plan's placement]); None
    where nothing streams from the drive or there is no host budget or optimizer."""
    if cfg.optimizer != "adamw" or not cfg.host_budget_bytes or "nvme" not in homes.values():
        return None
    per_layer = {k: int(v / cfg.layers) for k, v in per_rank.items()}
    state = {"exp_avg": per_layer["moments"] // 2, "exp_avg_sq": per_layer["moments"] // 2}
    if per_layer["master"]:
        state["master"] = per_layer["master"]
    trace = layered_trace(cfg.layers, weight_bytes=per_layer["weights"], state_bytes=state)
    host = cfg.host_budget_bytes
    room = room_bytes(host, largest_unit_bytes=per_layer["weights"],
                      largest_update_bytes=per_layer["weights"] + sum(state.values()))
    p = plan_placement(trace, budget_bytes=host, room_bytes=room)
    return {"layers": cfg.layers, "host_budget_bytes": host, "room_bytes": p.room_bytes,
            "resident_by_kind": p.resident_by_kind, "moved_by_kind": p.moved_by_kind,
            "bytes_per_step": p.bytes_per_step, "lower_bound_bytes": p.lower_bound_bytes,
            "forward_bytes": p.forward_bytes}


def format_plan(plan: dict[str, Any]) -> str:
    cfg, t, r = plan["config"], plan["totals"], plan["per_rank"]
    n, p = cfg["ranks"], cfg["params"]
    unit, scale = next((u, s) for u, s in (("GB", GB), ("MB", 1e6), ("KB", 1e3), ("B", 1)) if t["weights"] >= s)
    count = f"{p / 1e9:.3g}B" if p >= 1e9 else f"{p / 1e6:.3g}M"
    lines = [f"plan: {count} parameters, {cfg['dtype']} compute, {cfg['optimizer']}, {n} rank(s)",
             f"{'':26}{'total ' + unit:>10}{'per rank ' + unit:>13}"]
    rows = [("weights (" + cfg["dtype"] + ")", "weights"), ("gradients (" + cfg["dtype"] + ")", "grads")]
    if cfg["optimizer"] == "adamw":
        rows += [("Adam moments (fp32 m, v)", "moments")]
        if t["master"]:
            rows += [("fp32 master copy", "master"), ("optimizer state, all", "optimizer_state")]
    for label, k in rows:
        lines.append(f"{label:<26}{t[k] / scale:>10.2f}{r[k] / scale:>13.2f}")

    def budget(key: str) -> str:
        v = cfg[key]
        return "none" if v is None else f"{v / scale:.2f} {unit}"

    lines.append(f"budgets per rank: device {budget('device_budget_bytes')}, host {budget('host_budget_bytes')} "
                 f"({cfg['prefetch_reserve']:.0%} kept for prefetch), nvme "
                 + ("unlimited" if cfg["nvme_budget_bytes"] is None else budget("nvme_budget_bytes")))
    homes = plan["homes"]
    for what, label in (("weights", "weights"), ("optimizer_state", "optimizer state")):
        lines.append(f"home of {label}: " + (homes[what] or "DOES NOT FIT: raise a budget or add ranks"))
    lines.append(f"per rank by tier ({unit}): " + "  ".join(f"{k} {v / scale:.2f}" for k, v in
                                                      plan["per_rank_by_tier"].items()))
    if plan["fits"]:
        lines.append(f"config: param_tier = \"{homes['weights']}\", optimizer_tier = \"{homes['optimizer_state']}\"")
    tr = plan["traffic_per_step"]
    lines.append(f"bytes per step per rank ({unit}): " + "  ".join(
        f"{k.replace('_', ' ')} {v / scale:.2f}" for k, v in tr.items()))
    pl = plan.get("placement")
    if pl is not None:
        lines.append(f"placement per rank (the offloaded model's, over {pl['layers']} equal layers; host budget "
                     f"{pl['host_budget_bytes'] / scale:.2f} {unit}, {pl['room_bytes'] / scale:.2f} of it for "
                     "copies in flight): resident "
                     + ", ".join(f"{k} {v / scale:.2f}" for k, v in pl["resident_by_kind"].items()))
        lines.append(f"  nvme bytes per step ({unit}): {pl['bytes_per_step'] / scale:.2f} predicted "
                     f"({pl['forward_bytes'] / scale:.2f} read by the forward, the rest from the first backward use "
                     f"on), {pl['lower_bound_bytes'] / scale:.2f} lower bound")
    return "\n".join(lines)


__all__ = ["PlanConfig", "format_plan", "make_plan"]
