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

import os
from dataclasses import dataclass
from typing import Any

from tierstore import Tier, TierValueError
from tierstore.integrations import default_grad_backlog_bytes
from tierstore.scheduling import layered_trace, plan_placement, room_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_OPTIMIZERS = ("adamw", "sgd", "none")
# bytes a parameter of both moments, and of the master of a bf16/fp16 weight, per OffloadedAdamW layout
_MOMENT_BYTES = {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 8 / 256}
_MASTER_BYTES = {"fp32": 4.0, "split": 2.0, "none": 0.0}
GB = 1e9
UNITS = {"GiB": 2**30, "GB": 1e9, "MiB": 2**20, "MB": 1e6, "KiB": 2**10, "KB": 1e3, "TiB": 2**40, "TB": 1e12}


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
    prefetch_reserve: float = 0.25  # share of the host budget kept for reads in flight where no placement says
    layers: int = 24  # equal blocks, for the placement (see [Note: The plan's placement])
    moments: str = "fp32"  # OffloadedAdamW's state layout (see [Note: Compressed optimizer state])
    master: str = "fp32"
    step_in_backward: bool = False  # else gradients are kept (in the store) from backward to the step
    nvme_path: str | None = None  # where the drive's free space is checked
    free_bytes: int | None = None  # the drive's free space (None: read at nvme_path)
    # the RAM of the machine planned for (None: this machine's when the plan is for it, else not checked; see
    # [Note: Planning for another machine])
    ram_bytes: int | None = None
    drive_gbps: float | None = None  # the drive's mixed read+write rate, for the predicted step
    compute_seconds: float | None = None  # one step's forward and backward, for the predicted step
    tensors: int | None = None  # parameter tensors of the model (the offload's own work is per tensor)
    tensor_seconds: float | None = None  # the offload's own work per parameter tensor and step (see below)
    tokens: int | None = None  # tokens a step computes per rank, for the activations on the device
    hidden: int | None = None  # the model's width, for the activations on the device
    compute_device: str = "cpu"  # where forward and backward run: "cpu", or "cuda" (the device tier's)
    device_name: str | None = None  # what measured the compute, as printed
    link_gbps: float | None = None  # host<->device copies, GB/s (pinned memory), for the predicted step
    update_seconds: float | None = None  # OffloadedAdamW's CPU update of this rank's parameters, one step
    unit: str = "GB"  # what sizes print in
    source: str | None = None  # where the parameter count came from, for the first line

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise TierValueError(f"params={self.params} must be > 0 (e.g. 7e9)")
        if self.ranks < 1:
            raise TierValueError(f"ranks={self.ranks} must be >= 1")
        if self.dtype not in DTYPE_BYTES:
            raise TierValueError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
        if self.optimizer not in _OPTIMIZERS:
            raise TierValueError(f"optimizer={self.optimizer!r}: choose one of {', '.join(_OPTIMIZERS)}")
        if self.layers < 1:
            raise TierValueError(f"layers={self.layers} must be >= 1")
        if not 0 <= self.prefetch_reserve < 1:
            raise TierValueError(f"prefetch_reserve={self.prefetch_reserve} must be in [0, 1)")
        if self.moments not in _MOMENT_BYTES:
            raise TierValueError(f"moments={self.moments!r}: choose one of {', '.join(_MOMENT_BYTES)}")
        if self.master not in _MASTER_BYTES:
            raise TierValueError(f"master={self.master!r}: choose one of {', '.join(_MASTER_BYTES)}")
        if self.master == "split" and self.dtype == "fp16":
            raise TierValueError("master='split' needs bf16 weights (an fp16 value is not the top half of an fp32 "
                                 "one): --master-weights fp32, or --dtype bf16")
        if self.compute_device not in ("cpu", "cuda"):
            raise TierValueError(f"compute_device={self.compute_device!r}: choose cpu or cuda")
        for name in ("tensors", "tensor_seconds", "tokens", "hidden", "link_gbps", "update_seconds"):
            if (value := getattr(self, name)) is not None and not value >= 0:
                raise TierValueError(f"{name}={value} must be >= 0")
        if self.unit not in UNITS:
            raise TierValueError(f"unit={self.unit!r}: choose one of {', '.join(UNITS)}")


def training_state_bytes(params: int, dtype: str, optimizer: str, moments: str, master: str) -> int:
    """The weights and optimizer state of ``params`` parameters: Adam's moments in their layout, and the master
    of a bf16/fp16 weight."""
    adam = optimizer == "adamw"
    per = DTYPE_BYTES[dtype] + (_MOMENT_BYTES[moments] if adam else 0.0) + (
        _MASTER_BYTES[master] if adam and dtype != "fp32" else 0.0)
    return int(params * per)


def make_plan(cfg: PlanConfig) -> dict[str, Any]:
    """Totals, per-rank holdings, homes per tier and per-step traffic, all in bytes."""
    p, n, b = cfg.params, cfg.ranks, DTYPE_BYTES[cfg.dtype]
    moments = int(_MOMENT_BYTES[cfg.moments] * p) if cfg.optimizer == "adamw" else 0
    master = int(_MASTER_BYTES[cfg.master] * p) if cfg.optimizer == "adamw" and cfg.dtype != "fp32" else 0
    # gradients as the offloaded model keeps them from backward to the step: fp32 for bf16/fp16 weights
    kept_grads = 0 if cfg.step_in_backward or cfg.optimizer == "none" else 4 * p
    totals = {"weights": p * b, "grads": p * b, "moments": moments, "master": master,
              "optimizer_state": moments + master, "kept_grads": kept_grads}
    per_rank = {k: v / n for k, v in totals.items()}
    working = _device_working_set(cfg, per_rank["weights"])
    free = {
        Tier.DEVICE: max(0.0, float(cfg.device_budget_bytes or 0) - working["bytes"]),
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
    # Kept gradients stay in the host tier while it has room, and no owner ranks them for eviction (see [Note:
    # Gradients in the tiers]): beside state that streams from the drive, the tier is full and they go first, so
    # each is written and read once a step.
    spill = per_rank["kept_grads"] if o_home == "nvme" else 0.0
    others = (n - 1) / n  # the share of each collective's bytes that comes from (or goes to) other ranks
    stepped_on_cpu = cfg.optimizer != "none"
    traffic = {
        # [Note: Link traffic] FSDP2 all-gathers the whole weights into every rank for forward and again for
        # backward: each rank receives the other ranks' shards, 2 x weights x (N-1)/N; the reduce-scatter
        # sends each rank's gradient for the others' shards, grads x (N-1)/N.
        "all_gather": 2 * totals["weights"] * others,
        "reduce_scatter": totals["grads"] * others,
        # Weights are read for forward and backward and, when they are the fp32 master, by the optimizer.
        "nvme_read": (w * (2 if master else 3) if w_home == "nvme" else 0.0) + (o if o_home == "nvme" else 0.0)
        + spill,
        "nvme_write": (o if o_home == "nvme" else 0.0) + (w if w_home == "nvme" else 0.0) + spill,
        # Shards kept off the device come to it before each all-gather; the optimizer steps on the CPU, so
        # the gradient shard goes down and, for weights homed on the device, the updated shard comes back.
        "host_to_device": (2 * w if w_home != "device" else 0.0) + (w if w_home == "device" and stepped_on_cpu
                                                                     else 0.0),
        "device_to_host": per_rank["grads"] if stepped_on_cpu else 0.0,
    }
    placement, placed = _placement(cfg, per_rank, homes)
    checks = _checks(cfg, homes, by_tier, per_rank, working)
    plan = {"config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "totals": totals,
            "per_rank": per_rank, "homes": homes, "per_rank_by_tier": by_tier, "traffic_per_step": traffic,
            "fits": not checks["problems"], "checks": checks, "placement": placement, "device_working_set": working}
    plan["predicted_step"] = _predicted_step(cfg, plan, placed)
    plan["drive_per_step"] = _drive_per_step(cfg, plan)
    plan["device"] = _on_the_device(cfg, plan)
    return plan


def _drive_per_step(cfg: PlanConfig, plan: dict[str, Any]) -> dict[str, Any]:
    """The one figure of what a step moves over the drive, the one the predicted step takes: the placement's
    where there is one (it keeps part of the state in the host tier), else every byte homed on the drive, read and
    written as the homes say; with its time at the drive's mixed rate where that is given."""
    pl, tr = plan["placement"], plan["traffic_per_step"]
    if pl is not None:
        out = {"bytes": pl["bytes_per_step"], "read_bytes": None, "write_bytes": None, "by": "placement"}
    else:
        out = {"bytes": tr["nvme_read"] + tr["nvme_write"], "read_bytes": tr["nvme_read"],
               "write_bytes": tr["nvme_write"], "by": "homes"}
    out["seconds"] = out["bytes"] / (cfg.drive_gbps * 1e9) if cfg.drive_gbps else None
    return out


def _on_the_device(cfg: PlanConfig, plan: dict[str, Any]) -> dict[str, Any] | None:
    """What stays on the device and what streams through it, a rank and a step; None where there is no device
    (the host computes and no device budget is given)."""
    ws = plan["device_working_set"]
    if not cfg.device_budget_bytes and cfg.compute_device != "cuda":
        return None
    w = plan["per_rank"]["weights"]
    kept = plan["homes"]["weights"] == "device"
    tr = plan["traffic_per_step"]
    return {"budget_bytes": cfg.device_budget_bytes, "working_set_bytes": ws["bytes"],
            "left_for_weights_bytes": max(0.0, float(cfg.device_budget_bytes or 0) - ws["bytes"]),
            "resident": {"weights": w} if kept else {}, "resident_bytes": w if kept else 0.0,
            "streamed_in_bytes_per_step": tr["host_to_device"], "sent_down_bytes_per_step": tr["device_to_host"]}


# [Note: The device's working set] Beside the weights homed on the device, a step there holds the activations
# its backward needs and the layers in flight: the unit computing, the one read ahead, and the gradients of the
# one whose backward just ran (they go down to the CPU's update a layer at a time). Activations of a transformer
# layer in 16 bits: about 34 bytes per token and unit of width (Korthikanti et al., "Reducing Activation
# Recomputation in Large Transformer Models", 2022: 34sbh, leaving out the attention scores that a fused
# attention kernel never stores), twice that in fp32; none checkpointed.
_ACTIVATION_BYTES = 34


def _device_working_set(cfg: PlanConfig, weights: float) -> dict[str, float]:
    """What a step holds on the device besides the weights homed there (see [Note: The device's working set])."""
    if not cfg.device_budget_bytes and cfg.compute_device != "cuda":  # the host computes: no device to fill
        return {"activations": 0.0, "layers_in_flight": 0.0, "bytes": 0.0}
    activations = (_ACTIVATION_BYTES * cfg.hidden * cfg.tokens * cfg.layers * DTYPE_BYTES[cfg.dtype] / 2
                   if cfg.tokens and cfg.hidden else 0.0)
    in_flight = 3 * weights / cfg.layers
    return {"activations": activations, "layers_in_flight": in_flight, "bytes": activations + in_flight}


# [Note: Planning for another machine] A plan whose rates were given rather than measured here (--tflops,
# --drive-gbps, --link-gbps, --update-ns, --tensor-ms without --measure timing the compute), or that computes on
# CUDA where this machine has none, is for another machine: this machine's RAM and the drive where this machine's
# store would put its swap files say nothing about it, so neither is checked. The host budget is checked against
# --ram where it is given, the drive's free space at a --nvme-path given, and the plan says what it did not check.
def _plans_this_machine(cfg: PlanConfig) -> bool:
    """Whether ``cfg`` plans for the machine it runs on (see [Note: Planning for another machine])."""
    if cfg.compute_device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return False
    if cfg.device_name is not None:  # the compute was measured here
        return True
    given = (cfg.compute_seconds, cfg.drive_gbps, cfg.link_gbps, cfg.update_seconds, cfg.tensor_seconds)
    return all(v is None for v in given)


def _checks(cfg: PlanConfig, homes: dict[str, str | None], by_tier: dict[str, float],
            per_rank: dict[str, float], working: dict[str, float]) -> dict[str, Any]:
    """Why the plan does not fit (``problems``), against the budgets, the RAM and the drive's free space of the
    machine planned for; ``drive_need``, ``drive_free``, ``drive_path``, ``ram`` as found (None: not checked) and
    ``this_machine`` (see [Note: Planning for another machine])."""
    import psutil

    problems = []
    scale = UNITS[cfg.unit]
    device = cfg.device_budget_bytes
    if device and working["bytes"] > device:
        problems.append(f"a step holds {working['bytes'] / scale:.2f} {cfg.unit} on the device (activations of "
                        f"{cfg.tokens} tokens {working['activations'] / scale:.2f}, three layers of weights and "
                        f"gradients in flight {working['layers_in_flight'] / scale:.2f}), more than its budget of "
                        f"{device / scale:.2f} {cfg.unit}: fewer --tokens a step, activation checkpointing, or a "
                        f"larger --device-budget")
    for what, home in homes.items():
        if home is None:
            problems.append(f"the {what.replace('_', ' ')} ({per_rank[what] / scale:.2f} {cfg.unit} a "
                            f"rank) fit in no tier's budget: raise a budget or add ranks")
    here = _plans_this_machine(cfg)
    ram = cfg.ram_bytes if cfg.ram_bytes is not None else (psutil.virtual_memory().total if here else None)
    if ram is not None and cfg.host_budget_bytes and cfg.host_budget_bytes > ram:
        whose = (f"the RAM planned for ({ram / scale:.2f} {cfg.unit}, --ram)" if cfg.ram_bytes is not None
                 else f"this machine's RAM ({ram / scale:.2f} {cfg.unit})")
        problems.append(f"the host budget ({cfg.host_budget_bytes / scale:.2f} {cfg.unit}) is more than {whose}: "
                        f"a smaller --host-budget")
    # on the drive: what is homed there, and the gradients kept from backward (they reserve their bytes there)
    drive_need = by_tier["nvme"] + (per_rank["kept_grads"] if "nvme" in homes.values() else 0.0)
    free = cfg.free_bytes
    path = cfg.nvme_path
    if path is None and drive_need and here:  # state goes to the drive: check where the store would put it
        from tierstore import default_nvme_path

        path = default_nvme_path()
    if free is None and path is not None:
        probe = path
        while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        free = psutil.disk_usage(probe).free
    local = drive_need * cfg.ranks  # every rank's share, on this machine's drive
    if free is not None and local > free:
        problems.append(f"the drive at {path or 'the nvme path'} has {free / scale:.2f} "
                        f"{cfg.unit} free and this plan puts {local / scale:.2f} {cfg.unit} there"
                        + (f" ({cfg.ranks} ranks)" if cfg.ranks > 1 else ""))
    return {"problems": problems, "drive_need": local, "drive_free": free, "drive_path": path, "ram": ram,
            "this_machine": here}


def _predicted_step(cfg: PlanConfig, plan: dict[str, Any], placed: Any) -> dict[str, Any] | None:
    """The step's time from the compute time and the drive's rate, with the placement's bytes and the model the
    offloaded model uses (see [Note: The predicted step] in tierstore/_placement.py: the forward, a third of the
    compute, then the rest); None without both figures.

    [Note: The offload's own work] On top of the model's compute, an offloaded step costs CPU and latency per
    parameter tensor: hooks, the store's bookkeeping, handing each read, update and write between threads, each
    read's wait. Measured here (a third of the state as host budget, against a resident step under the same
    allocator setting): 2.6, 2.3 and 1.7 ms a tensor and step at ViT-tiny, -small and -base stepping in backward,
    4.7, 5.4 and 5.6 ms stepping after it: about constant per tensor across 750x in parameters, so the plan adds
    ``tensors x tensor_seconds`` to the compute, with ``tensor_seconds`` measured on ViT-tiny (`--measure`) or
    given. Without it the prediction is a floor (ViT-small: 0.07 s predicted against 0.36 measured)."""
    if cfg.compute_seconds is None or not cfg.drive_gbps:
        return None
    rate = cfg.drive_gbps * 1e9
    offload = None
    if cfg.tensors is not None and cfg.tensor_seconds is not None:
        offload = cfg.tensors * cfg.tensor_seconds
    compute = cfg.compute_seconds + (offload or 0.0)
    update = cfg.update_seconds or 0.0
    if cfg.compute_device == "cpu" or not cfg.step_in_backward:
        compute += update  # the same cores, or after the backward: in series
    else:  # on the CPU while the device runs the backward (two thirds of the compute)
        compute = max(compute, compute / 3 + update)
    if placed is not None:
        moved = placed.bytes_per_step
        step = placed.predicted_step_seconds(compute, rate, compute / 3)
    else:  # everything in memory, or no host budget to plan in
        moved = plan["traffic_per_step"]["nvme_read"] + plan["traffic_per_step"]["nvme_write"]
        step = max(compute, moved / rate)
    link = None
    if cfg.compute_device == "cuda" and cfg.link_gbps:
        tr = plan["traffic_per_step"]
        link = (tr["host_to_device"] + tr["device_to_host"]) / (cfg.link_gbps * 1e9)
        step = max(step, link)  # copies run on their own streams, beside the compute and the drive
    return {"seconds": step, "compute_seconds": cfg.compute_seconds, "offload_seconds": offload,
            "update_seconds": cfg.update_seconds, "link_seconds": link, "tensors": cfg.tensors,
            "drive_gbps": cfg.drive_gbps, "bytes_moved": moved, "not_counted": _not_counted(cfg, plan)}


def _not_counted(cfg: PlanConfig, plan: dict[str, Any]) -> list[str]:
    """The terms of a step the prediction leaves out for want of a figure, each with what would count it. Each
    only adds to the step (in series with the compute, or beside it as a bound), so without them the prediction
    is a floor."""
    out = []
    if cfg.tensors is None or cfg.tensor_seconds is None:
        out.append("the offload's own work per tensor (give --tensor-ms or --measure)")
    # A preset's step measured on the CPU (--preset --measure) has torch's AdamW in it: no update figure is missing.
    update_in_compute = cfg.compute_device == "cpu" and cfg.device_name is not None and cfg.optimizer == "adamw"
    if cfg.optimizer != "none" and cfg.update_seconds is None and not update_in_compute:
        out.append("the optimizer's CPU update (give --update-ns or --measure)")
    if cfg.compute_device == "cuda" and cfg.link_gbps is None:
        out.append("host<->device copies (give --link-gbps or --measure)")
    tr = plan["traffic_per_step"]
    if cfg.ranks > 1:  # no rate of the network between ranks is asked for
        out.append(f"the all-gather and reduce-scatter between the {cfg.ranks} ranks "
                   f"({(tr['all_gather'] + tr['reduce_scatter']) / UNITS[cfg.unit]:.2f} {cfg.unit} a step)")
    return out


def _placement(cfg: PlanConfig, per_rank: dict[str, float],
               homes: dict[str, str | None]) -> tuple[dict[str, Any] | None, Any]:
    """What the offloaded model's placement predicts for one rank (see [Note: The plan's placement]), and the
    placement; None where nothing streams from the drive or there is no host budget or optimizer."""
    if cfg.optimizer != "adamw" or not cfg.host_budget_bytes or "nvme" not in homes.values():
        return None, None
    per_layer = {k: int(v / cfg.layers) for k, v in per_rank.items()}
    state = {"exp_avg": per_layer["moments"] // 2, "exp_avg_sq": per_layer["moments"] // 2}
    if per_layer["master"]:
        state["master"] = per_layer["master"]
    trace = layered_trace(cfg.layers, weight_bytes=per_layer["weights"], state_bytes=state)
    host = cfg.host_budget_bytes
    # Stepping in backward, the room also holds the parameters waiting for their updates: as many bytes as
    # OffloadedAdamW's default gradient backlog (see [Note: Updates behind backward]).
    room = room_bytes(host, largest_unit_bytes=per_layer["weights"],
                      largest_update_bytes=per_layer["weights"] + sum(state.values()),
                      behind_bytes=default_grad_backlog_bytes(host) if cfg.step_in_backward else 0)
    p = plan_placement(trace, budget_bytes=host, room_bytes=room)
    return {"layers": cfg.layers, "host_budget_bytes": host, "room_bytes": p.room_bytes,
            "resident_by_kind": p.resident_by_kind, "moved_by_kind": p.moved_by_kind,
            "bytes_per_step": p.bytes_per_step, "lower_bound_bytes": p.lower_bound_bytes,
            "forward_bytes": p.forward_bytes}, p


def format_plan(plan: dict[str, Any]) -> str:
    cfg, t, r = plan["config"], plan["totals"], plan["per_rank"]
    n, p = cfg["ranks"], cfg["params"]
    unit = cfg["unit"]
    scale = UNITS[unit]
    checks = plan["checks"]
    lines = ["fits: " + ", ".join(_fit_reasons(plan)) if plan["fits"]
             else "does not fit: " + "; ".join(checks["problems"])]
    count = f"{p / 1e9:.3g}B" if p >= 1e9 else f"{p / 1e6:.3g}M"
    layout = (f" (moments {cfg['moments']}" + (f", master {cfg['master']}" if cfg["dtype"] != "fp32" else "") + ")"
              if cfg["optimizer"] == "adamw" else "")
    lines += [f"plan: {count} parameters{' (' + cfg['source'] + ')' if cfg.get('source') else ''}, "
              f"{cfg['dtype']} weights, {cfg['optimizer']}{layout}, {n} rank(s)",
              f"{'':28}{'total ' + unit:>12}{'per rank ' + unit:>14}"]
    rows = [(f"weights ({cfg['dtype']})", "weights"), (f"gradients ({cfg['dtype']})", "grads")]
    if cfg["optimizer"] == "adamw":
        rows += [(f"Adam moments ({cfg['moments']} m, v)", "moments")]
        if t["master"]:
            rows += [(f"master copy ({cfg['master']})", "master"), ("optimizer state, all", "optimizer_state")]
        if t["kept_grads"]:
            rows += [("gradients kept (fp32)", "kept_grads")]
    for label, k in rows:
        lines.append(f"{label:<28}{t[k] / scale:>12.2f}{r[k] / scale:>14.2f}")

    def size(v: float | None) -> str:
        return "none" if v is None else f"{v / scale:.2f} {unit}"

    not_here = "planning for another machine"
    if not cfg["host_budget_bytes"]:
        host = "host none"
    elif checks["ram"] is None:
        host = f"host {size(cfg['host_budget_bytes'])} (RAM not checked: {not_here}; give --ram to check it)"
    else:
        host = (f"host {size(cfg['host_budget_bytes'])} of {size(checks['ram'])} RAM"
                + (" (--ram)" if cfg["ram_bytes"] is not None else ""))
    drive = ("drive unlimited" if cfg["nvme_budget_bytes"] is None else f"drive {size(cfg['nvme_budget_bytes'])}")
    if checks["drive_free"] is not None:
        drive += f" ({size(checks['drive_free'])} free at {checks['drive_path']})"
    elif checks["drive_need"]:
        drive += f" (free space not checked: {not_here}; give --nvme-path to check a drive)"
    lines.append(f"budgets per rank: device {size(cfg['device_budget_bytes'])}, {host}, {drive}")
    dev = plan.get("device")
    if dev is not None:
        lines.append(_device_line(plan, dev, size))
    homes = plan["homes"]
    lines.append("homes: " + ", ".join(f"{what.replace('_', ' ')} {home or 'NONE'}" for what, home in homes.items())
                 + (f" (config: param_tier = \"{homes['weights']}\", optimizer_tier = "
                    f"\"{homes['optimizer_state']}\")" if plan["fits"] else ""))
    lines.append(f"space on the drive: {size(checks['drive_need'])}" + (
        " (the gradients kept from backward included)" if t["kept_grads"] and checks["drive_need"] else ""))
    tr = plan["traffic_per_step"]
    # the drive's bytes are one figure, on a line of their own (below): the homes' nvme_read and nvme_write, which
    # the JSON keeps, are not what a placement moves
    lines.append(f"bytes per step per rank over the links ({unit}): " + "  ".join(
        f"{k.replace('_', ' ')} {tr[k] / scale:.2f}" for k in ("all_gather", "reduce_scatter", "host_to_device",
                                                                 "device_to_host")))
    pl = plan.get("placement")
    if pl is not None:
        lines.append(f"placement per rank (the offloaded model's, over {pl['layers']} equal layers; "
                     f"{pl['room_bytes'] / scale:.2f} {unit} of the host budget for copies in flight): kept in the "
                     "host tier " + ", ".join(f"{k} {v / scale:.2f}" for k, v in pl["resident_by_kind"].items()))
    lines.append(_drive_line(plan, size))
    step = plan.get("predicted_step")
    if step is not None:
        own = (f", the offload's own work {step['offload_seconds']:.2f} s ({step['tensors']} tensors x "
               f"{1e3 * cfg['tensor_seconds']:.2f} ms)" if step["offload_seconds"] is not None else "")
        on = f" on {cfg['device_name']}" if cfg.get("device_name") else ""
        update = (f", the optimizer's CPU update {step['update_seconds']:.2f} s" if step["update_seconds"] is not None
                  else "")
        link = (f", host<->device copies {step['link_seconds']:.2f} s at {cfg['link_gbps']:.1f} GB/s"
                if step["link_seconds"] is not None else "")
        left_out = step["not_counted"]
        lines.append(f"predicted step: {'at least ' if left_out else ''}{step['seconds']:.2f} s (compute "
                     f"{step['compute_seconds']:.2f} s{on}{own}{update}{link}; the drive's "
                     f"{step['bytes_moved'] / scale:.2f} {unit} at {step['drive_gbps']:.2f} GB/s)"
                     + ("; not counted: " + ", ".join(left_out) if left_out else ""))
    else:
        lines.append("predicted step: give --drive-gbps and --tflops (or --measure) to predict it")
    return "\n".join(lines)


def _device_line(plan: dict[str, Any], dev: dict[str, Any], size: Any) -> str:
    """What stays on the device and what streams through it, and the step's working set there."""
    cfg, ws = plan["config"], plan["device_working_set"]
    w = plan["per_rank"]["weights"]
    budget = f"budget {size(dev['budget_bytes'])}" if dev["budget_bytes"] else "no budget"
    up, down = dev["streamed_in_bytes_per_step"], dev["sent_down_bytes_per_step"]
    streamed = []
    if dev["resident_bytes"]:
        kept = f"the weights, {size(w)}"
        if up:
            streamed.append(f"the updated weights up from the CPU's update {size(up)}")
    else:
        kept = (f"nothing (no --device-budget: the weights, {size(w)}, have no home there)" if not dev["budget_bytes"]
                else f"nothing (the weights, {size(w)}, are more than the {size(dev['left_for_weights_bytes'])} the "
                     "budget leaves beside the step's working set)")
        streamed.append(f"each layer's weights up through the host tier for forward and backward {size(up)}")
    if down:
        streamed.append(f"the gradients down to the CPU's update {size(down)}")
    moved = "; streamed a step: " + ", ".join(streamed) if streamed else ""
    acts = (f"activations of {cfg['tokens']} tokens {size(ws['activations'])} (none checkpointed), "
            if ws["activations"] else "")
    return (f"on the device per rank ({budget}): kept there {kept}{moved}\n"
            f"  on the device besides the weights homed there: {acts}three layers of weights and gradients in "
            f"flight {size(ws['layers_in_flight'])}")


def _drive_line(plan: dict[str, Any], size: Any) -> str:
    """The one figure of the drive's bytes a step (see _drive_per_step), its time at the mixed rate, and where it
    comes from."""
    cfg, d = plan["config"], plan["drive_per_step"]
    scale = UNITS[cfg["unit"]]
    if not d["bytes"]:
        return "drive per step per rank: nothing moves (nothing is homed on the drive)"
    took = (f", {d['seconds']:.2f} s at the drive's {cfg['drive_gbps']:.2f} GB/s mixed read+write rate"
            if d["seconds"] is not None else "")
    if d["by"] == "placement":
        pl = plan["placement"]
        how = (f"the placement's: {pl['forward_bytes'] / scale:.2f} read by the forward, the rest from the first "
               f"backward use on; lower bound {pl['lower_bound_bytes'] / scale:.2f}, which no placement beats")
    else:
        how = (f"{d['read_bytes'] / scale:.2f} read + {d['write_bytes'] / scale:.2f} written: what is homed on the "
               "drive")
    return f"drive per step per rank: {size(d['bytes'])} read and written{took} ({how})"


def _fit_reasons(plan: dict[str, Any]) -> list[str]:
    cfg, checks = plan["config"], plan["checks"]
    scale, unit = UNITS[cfg["unit"]], cfg["unit"]
    out = ["every tensor has a home within the budgets"]
    if cfg["host_budget_bytes"]:
        if checks["ram"] is None:
            out.append("RAM not checked (planning for another machine: give --ram to check the host budget)")
        else:
            out.append(f"the host budget is within the {checks['ram'] / scale:.2f} {unit} of RAM given (--ram)"
                       if cfg["ram_bytes"] is not None
                       else f"the host budget is within this machine's {checks['ram'] / scale:.2f} {unit} of RAM")
    if checks["drive_free"] is not None:
        out.append(f"the drive needs {checks['drive_need'] / scale:.2f} of its {checks['drive_free'] / scale:.2f} "
                   f"{unit} free")
    elif checks["drive_need"]:
        out.append("the drive's free space not checked (planning for another machine: give --nvme-path to check a "
                   "drive)")
    return out


@dataclass(frozen=True)
class ModelShape:
    """What the plan reads of a model: its size and shape, and the dtype its config names (None: none named)."""

    params: int
    tensors: int
    layers: int
    hidden: int
    dtype: str | None
    source: str


def hf_model_size(path: str) -> ModelShape:
    """A transformers model from its ``config.json`` (a file or the directory holding it), counted exactly on the
    meta device (embeddings included, a tied weight once); layers, width and dtype as its config gives them."""
    import torch
    import transformers

    if not os.path.exists(path):
        raise TierValueError(f"--hf-config {path!r}: no such file or directory (give a config.json or its directory)")
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TierValueError(f"--hf-config {path!r} is not a transformers config transformers can read: "
                             f"{first}") from None
    archs = getattr(config, "architectures", None) or []
    auto = (transformers.AutoModelForCausalLM if any(a.endswith("ForCausalLM") for a in archs)
            else transformers.AutoModel)
    with torch.device("meta"):
        model = auto.from_config(config)
    tensors = list(model.parameters())  # a tied weight is one parameter
    params = sum(p.numel() for p in tensors)

    def first_int(*keys: str) -> int | None:
        return next((getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)), None)

    layers = first_int("num_hidden_layers", "n_layer", "num_layers") or 24
    hidden = first_int("hidden_size", "n_embd", "d_model") or int((params / (12 * layers)) ** 0.5)
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", "float32": "fp32",
             "bfloat16": "bf16", "float16": "fp16"}.get(named)
    return ModelShape(params, len(tensors), layers, hidden, dtype, f"{type(model).__name__} from {path}")


def estimated_layers(params: int) -> int:
    """Layers of a decoder of ``params`` parameters shaped as Llama's are (width 128 x layers, so about
    12 x 128^2 x layers^3 parameters), to a multiple of 4: 32 for 7B, 40 for 13B."""
    return max(4, round((params / (12 * 128**2)) ** (1 / 3) / 4) * 4)


def measure_compute_tflops(dtype: str) -> tuple[float, str]:
    """The matrix-product rate in ``dtype`` (TFLOPS, the best of a few) of the device that will compute: CUDA's
    when there is one (4096 x 4096), else this CPU's (1024 x 1024); and that device's name."""
    import time

    import torch

    t = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    cuda = torch.cuda.is_available()
    n = 4096 if cuda else 1024
    a = torch.randn(n, n, device="cuda" if cuda else "cpu").to(t)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    a @ a
    sync()
    best = float("inf")
    for _ in range(3 if not cuda else 10):
        t0 = time.perf_counter()
        a @ a
        sync()
        best = min(best, time.perf_counter() - t0)
    name = torch.cuda.get_device_name() if cuda else f"the CPU ({os.cpu_count()} cores)"
    return 2 * n**3 / best / 1e12, name


def measure_link_gbps(nbytes: int = 256 * 2**20) -> float | None:
    """Host<->device copies from and to pinned memory, GB/s (the mean of both ways, the best of 3); None without
    CUDA."""
    import time

    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for dst, src in ((dev, host), (host, dev)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        rates.append(nbytes / best / 1e9)
    return sum(rates) / 2


def measure_update_seconds(dtype: str, moments: str, master: str, params: int = 8 * 2**20) -> float:
    """OffloadedAdamW's update on this CPU, seconds per parameter: a model of ``params`` parameters in ``dtype``
    whose state is in the host tier (no drive in it), stepped after backward with its threads; the best of 3."""
    import time

    import torch

    from tierstore import TierStore
    from tierstore.integrations import OffloadedAdamW, offload_model

    t = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    width = 1024
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(params // width**2)]).to(t)
    n = sum(p.numel() for p in model.parameters())
    with TierStore(host_budget_bytes=64 * n + 2**28, device_budget_bytes="1MiB") as store:
        off = offload_model(model, store, home="host")
        opt = OffloadedAdamW(off, moments=moments, master=master, home="host")
        try:
            best = float("inf")
            for i in range(4):
                model(torch.randn(4, width, generator=torch.Generator().manual_seed(i)).to(t)).float().sum().backward()
                t0 = time.perf_counter()
                opt.step()
                opt.wait()
                if i:  # the first builds the state
                    best = min(best, time.perf_counter() - t0)
                opt.zero_grad()
        finally:
            opt.close()
    return best / n


def median_step_seconds(model: Any, opt: Any, data: Any, batch_size: int, *, warmup: int, steps: int,
                        dtype: Any = None, device: str = "cpu") -> float:
    """The median time of ``steps`` training steps of a ViT on ``data`` (forward, backward, the optimizer's
    step, zero_grad), after ``warmup``; inputs in ``dtype`` (None: as they come) on ``device``, the loss in
    fp32."""
    import statistics
    import time

    import torch.nn.functional as F

    import torch

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    times = []
    for i in range(warmup + steps):
        x, y = data.batch(i, batch_size)
        x, y = x.to(device=device, dtype=dtype or x.dtype), y.to(device)
        sync()
        t0 = time.perf_counter()
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def measure_tensor_seconds(nvme_path: str, step_in_backward: bool, steps: int = 8) -> float:
    """The offload's own work per parameter tensor and step (see [Note: The offload's own work]): ViT-tiny
    (batch 32, fp32) offloaded at ``nvme_path`` under a third of its state as host budget, against the same model
    resident, both under the allocator setting a store makes; medians after 3 steps."""
    import copy

    import torch

    from tierstore import TierStore
    from tierstore.integrations import OffloadedAdamW, offload_model

    from .vit import PRESETS, SyntheticImages, ViT

    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    resident = ViT(cfg)
    data = SyntheticImages(cfg)
    n = sum(p.numel() for p in resident.parameters())
    tensors = len(list(resident.parameters()))

    with TierStore(nvme_path=nvme_path, host_budget_bytes=n * 12 // 3) as store:  # sets the allocator up
        model = copy.deepcopy(resident)
        opt = OffloadedAdamW(offload_model(model, store), step_in_backward=step_in_backward, speculate=False)
        try:
            offloaded = median_step_seconds(model, opt, data, 32, warmup=3, steps=steps)
        finally:
            opt.close()
        alone = median_step_seconds(resident, torch.optim.AdamW(resident.parameters(), foreach=False), data, 32,
                                    warmup=3, steps=steps)
    return max(0.0, offloaded - alone) / tensors


__all__ = ["DTYPE_BYTES", "ModelShape", "PlanConfig", "estimated_layers", "format_plan", "hf_model_size", "make_plan",
           "training_state_bytes",
           "measure_compute_tflops", "measure_link_gbps", "measure_update_seconds",
           "measure_tensor_seconds", "median_step_seconds"]
