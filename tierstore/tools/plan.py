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

from tierstore import Tier
from tierstore._config import default_grad_backlog_bytes
from tierstore._placement import layered_trace, plan_placement, room_bytes

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
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
    ram_bytes: int | None = None  # this machine's RAM (None: read from the system)
    drive_gbps: float | None = None  # the drive's mixed read+write rate, for the predicted step
    compute_seconds: float | None = None  # one step's forward and backward, for the predicted step
    tensors: int | None = None  # parameter tensors of the model (the offload's own work is per tensor)
    tensor_seconds: float | None = None  # the offload's own work per parameter tensor and step (see below)
    unit: str = "GB"  # what sizes print in
    source: str | None = None  # where the parameter count came from, for the first line

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
        if self.moments not in _MOMENT_BYTES:
            raise ValueError(f"moments={self.moments!r}: choose one of {', '.join(_MOMENT_BYTES)}")
        if self.master not in _MASTER_BYTES:
            raise ValueError(f"master={self.master!r}: choose one of {', '.join(_MASTER_BYTES)}")
        for name in ("tensors", "tensor_seconds"):
            if (value := getattr(self, name)) is not None and not value >= 0:
                raise ValueError(f"{name}={value} must be >= 0")
        if self.unit not in UNITS:
            raise ValueError(f"unit={self.unit!r}: choose one of {', '.join(UNITS)}")


def make_plan(cfg: PlanConfig) -> dict[str, Any]:
    """Totals, per-rank holdings, homes per tier and per-step traffic, all in bytes."""
    p, n, b = cfg.params, cfg.ranks, _DTYPE_BYTES[cfg.dtype]
    moments = int(_MOMENT_BYTES[cfg.moments] * p) if cfg.optimizer == "adamw" else 0
    master = int(_MASTER_BYTES[cfg.master] * p) if cfg.optimizer == "adamw" and cfg.dtype != "fp32" else 0
    # gradients as the offloaded model keeps them from backward to the step: fp32 for bf16/fp16 weights
    kept_grads = 0 if cfg.step_in_backward or cfg.optimizer == "none" else 4 * p
    totals = {"weights": p * b, "grads": p * b, "moments": moments, "master": master,
              "optimizer_state": moments + master, "kept_grads": kept_grads}
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
    checks = _checks(cfg, homes, by_tier, per_rank)
    plan = {"config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "totals": totals,
            "per_rank": per_rank, "homes": homes, "per_rank_by_tier": by_tier, "traffic_per_step": traffic,
            "fits": not checks["problems"], "checks": checks, "placement": placement}
    plan["predicted_step"] = _predicted_step(cfg, plan, placed)
    return plan


def _checks(cfg: PlanConfig, homes: dict[str, str | None], by_tier: dict[str, float],
            per_rank: dict[str, float]) -> dict[str, Any]:
    """Why the plan does not fit (``problems``), against the budgets, this machine's RAM and the drive's free
    space; ``drive_need``, ``drive_free``, ``ram`` as found."""
    import psutil

    problems = []
    for what, home in homes.items():
        if home is None:
            problems.append(f"the {what.replace('_', ' ')} ({per_rank[what] / UNITS[cfg.unit]:.2f} {cfg.unit} a "
                            f"rank) fit in no tier's budget: raise a budget or add ranks")
    ram = cfg.ram_bytes if cfg.ram_bytes is not None else psutil.virtual_memory().total
    if cfg.host_budget_bytes and cfg.host_budget_bytes > ram:
        problems.append(f"the host budget ({cfg.host_budget_bytes / UNITS[cfg.unit]:.2f} {cfg.unit}) is more than "
                        f"this machine's RAM ({ram / UNITS[cfg.unit]:.2f} {cfg.unit})")
    # on the drive: what is homed there, and the gradients kept from backward (they reserve their bytes there)
    drive_need = by_tier["nvme"] + (per_rank["kept_grads"] if "nvme" in homes.values() else 0.0)
    free = cfg.free_bytes
    if free is None and cfg.nvme_path is not None:
        probe = cfg.nvme_path
        while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        free = psutil.disk_usage(probe).free
    local = drive_need * cfg.ranks  # every rank's share, on this machine's drive
    if free is not None and local > free:
        problems.append(f"the drive at {cfg.nvme_path or 'the nvme path'} has {free / UNITS[cfg.unit]:.2f} "
                        f"{cfg.unit} free and this plan puts {local / UNITS[cfg.unit]:.2f} {cfg.unit} there"
                        + (f" ({cfg.ranks} ranks)" if cfg.ranks > 1 else ""))
    return {"problems": problems, "drive_need": local, "drive_free": free, "ram": ram}


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
    if placed is not None:
        moved = placed.bytes_per_step
        step = placed.predicted_step_seconds(compute, rate, compute / 3)
    else:  # everything in memory, or no host budget to plan in
        moved = plan["traffic_per_step"]["nvme_read"] + plan["traffic_per_step"]["nvme_write"]
        step = max(compute, moved / rate)
    return {"seconds": step, "compute_seconds": cfg.compute_seconds, "offload_seconds": offload,
            "tensors": cfg.tensors, "drive_gbps": cfg.drive_gbps, "bytes_moved": moved}


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

    host = (f"host {size(cfg['host_budget_bytes'])} of {size(checks['ram'])} RAM" if cfg["host_budget_bytes"]
            else "host none")
    drive = ("drive unlimited" if cfg["nvme_budget_bytes"] is None else f"drive {size(cfg['nvme_budget_bytes'])}")
    if checks["drive_free"] is not None:
        drive += f" ({size(checks['drive_free'])} free at {cfg['nvme_path']})"
    lines.append(f"budgets per rank: device {size(cfg['device_budget_bytes'])}, {host}, {drive}")
    homes = plan["homes"]
    lines.append("homes: " + ", ".join(f"{what.replace('_', ' ')} {home or 'NONE'}" for what, home in homes.items())
                 + (f" (config: param_tier = \"{homes['weights']}\", optimizer_tier = "
                    f"\"{homes['optimizer_state']}\")" if plan["fits"] else ""))
    lines.append(f"on the drive: {size(checks['drive_need'])}" + (" (the gradients kept from backward included)"
                                                                  if t["kept_grads"] and checks["drive_need"] else ""))
    tr = plan["traffic_per_step"]
    lines.append(f"bytes per step per rank ({unit}): " + "  ".join(
        f"{k.replace('_', ' ')} {v / scale:.2f}" for k, v in tr.items()))
    pl = plan.get("placement")
    if pl is not None:
        lines.append(f"placement per rank (the offloaded model's, over {pl['layers']} equal layers; "
                     f"{pl['room_bytes'] / scale:.2f} {unit} of the host budget for copies in flight): kept in the "
                     "host tier " + ", ".join(f"{k} {v / scale:.2f}" for k, v in pl["resident_by_kind"].items()))
        lines.append(f"  drive bytes per step ({unit}): {pl['bytes_per_step'] / scale:.2f} predicted "
                     f"({pl['forward_bytes'] / scale:.2f} read by the forward, the rest from the first backward use "
                     f"on), {pl['lower_bound_bytes'] / scale:.2f} lower bound")
    step = plan.get("predicted_step")
    if step is not None:
        own = (f", the offload's own work {step['offload_seconds']:.2f} s ({step['tensors']} tensors x "
               f"{1e3 * cfg['tensor_seconds']:.2f} ms)" if step["offload_seconds"] is not None
               else ", the offload's own work not counted: give --tensor-ms or --measure")
        lines.append(f"predicted step: {step['seconds']:.2f} s (compute {step['compute_seconds']:.2f} s{own}; "
                     f"{step['bytes_moved'] / scale:.2f} {unit} over the drive at {step['drive_gbps']:.2f} GB/s)")
    else:
        lines.append("predicted step: give --drive-gbps and --tflops (or --measure) to predict it")
    return "\n".join(lines)


def _fit_reasons(plan: dict[str, Any]) -> list[str]:
    cfg, checks = plan["config"], plan["checks"]
    scale, unit = UNITS[cfg["unit"]], cfg["unit"]
    out = ["every tensor has a home within the budgets"]
    if cfg["host_budget_bytes"]:
        out.append(f"the host budget is within this machine's {checks['ram'] / scale:.2f} {unit} of RAM")
    if checks["drive_free"] is not None:
        out.append(f"the drive needs {checks['drive_need'] / scale:.2f} of its {checks['drive_free'] / scale:.2f} "
                   f"{unit} free")
    return out


def hf_model_size(path: str) -> tuple[int, int, int, str]:
    """(parameters, parameter tensors, layers, description) of a transformers model from its ``config.json`` (a file or the
    directory holding it), counted exactly on the meta device: embeddings included, a tied weight once."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    auto = (transformers.AutoModelForCausalLM if any(a.endswith("ForCausalLM") for a in archs)
            else transformers.AutoModel)
    with torch.device("meta"):
        model = auto.from_config(config)
    tensors = list(model.parameters())  # a tied weight is one parameter
    params = sum(p.numel() for p in tensors)
    layers = next((getattr(config, k) for k in ("num_hidden_layers", "n_layer", "num_layers")
                   if isinstance(getattr(config, k, None), int)), 24)
    return params, len(tensors), layers, f"{type(model).__name__} from {path}"


def measure_compute_tflops(dtype: str) -> float:
    """This machine's matrix-product rate in ``dtype`` (TFLOPS; 1024 x 1024, the best of a few)."""
    import time

    import torch

    t = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a = torch.randn(1024, 1024).to(t)
    a @ a
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024**3 / best / 1e12


def median_step_seconds(model: Any, opt: Any, data: Any, batch_size: int, *, warmup: int, steps: int,
                        dtype: Any = None) -> float:
    """The median time of ``steps`` training steps of a ViT on ``data`` (forward, backward, the optimizer's
    step, zero_grad), after ``warmup``; inputs in ``dtype`` (None: as they come), the loss in fp32."""
    import statistics
    import time

    import torch.nn.functional as F

    times = []
    for i in range(warmup + steps):
        x, y = data.batch(i, batch_size)
        t0 = time.perf_counter()
        F.cross_entropy(model(x if dtype is None else x.to(dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()
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
        opt = OffloadedAdamW(offload_model(model, store), step_in_backward=step_in_backward)
        try:
            offloaded = median_step_seconds(model, opt, data, 32, warmup=3, steps=steps)
        finally:
            opt.close()
        alone = median_step_seconds(resident, torch.optim.AdamW(resident.parameters(), foreach=False), data, 32,
                                    warmup=3, steps=steps)
    return max(0.0, offloaded - alone) / tensors


__all__ = ["PlanConfig", "format_plan", "hf_model_size", "make_plan", "measure_compute_tflops",
           "measure_tensor_seconds", "median_step_seconds"]
