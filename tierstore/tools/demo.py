"""`tierstore demo`: train a ViT with parameters and Adam state offloaded to NVMe, and show the numbers."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from tierstore import StoreConfig, TierStore, TierValueError
from tierstore.integrations import OffloadedAdamW, offload_model

from .rss import peak_rss_bytes, reset_peak_rss, rss_bytes
from .vit import PRESETS, SyntheticImages, ViT, num_params

MIB = 1024**2
# Peak learning rates under which the demo's loss falls within its default steps (measured resident, 5-8 steps,
# batch 32, warm-up over the first half): larger ViTs need smaller ones; 1b's is extrapolated.
PRESET_LR = {"tiny": 1e-3, "small": 1e-3, "base": 1e-4, "large": 3e-5, "1b": 1e-5, "3b": 5e-6}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def default_budgets(num_params: int, host_budget_bytes: int | None,
                    device_budget_bytes: int | None) -> tuple[int, int, int]:
    """(fp32 state bytes, host budget, device budget): unless given, the host tier holds a third
    of the offloaded state (fp32 parameters + two moments) and the device a quarter of the weights
    (with CUDA; without it modules compute in the host tier and the device tier gets 1 MiB)."""
    state_bytes = num_params * 4 * 3
    host = host_budget_bytes or max(384 * 1024, state_bytes // 3)  # the floor: a tiny ViT's AdamW update
    device = device_budget_bytes or (max(2 * MIB, num_params * 4 // 4) if torch.cuda.is_available() else MIB)
    return state_bytes, host, device


def measure_step(model, store: TierStore, opt, data: SyntheticImages, batch_size: int, step: int,
                 sched=None, dtype: torch.dtype = torch.float32, *, write_behind: bool = False) -> dict[str, Any]:
    """Run one training step; its loss, wall time, stall time and NVMe bytes read and written (with
    ``write_behind``, its optimizer's write-behind too: the step ends when that is on the drive)."""
    before = store.stats_dict()
    t0 = time.perf_counter()
    x, y = data.batch(step, batch_size)
    loss = F.cross_entropy(model(x.to(dtype)).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()
    if write_behind:
        opt.wait()
    dt = time.perf_counter() - t0
    after = store.stats_dict()
    read = after["bytes_read_nvme"] - before["bytes_read_nvme"]
    written = after["bytes_written_nvme"] - before["bytes_written_nvme"]
    return {"step": step, "loss": loss.item(), "step_s": dt,
            "stall_s": after["stall_seconds"] - before["stall_seconds"], "read_bytes": read,
            "written_bytes": written, "nvme_gbps": (read + written) / dt / 1e9}


def _drive_mixed_gbps(path: str, mib: int, read_fraction: float) -> float:
    """The store's mixed read+write GB/s on the drive at ``path``, moving ``mib`` MiB, ``read_fraction`` of it read."""
    from .bench_drive import measure_drive

    return measure_drive(path, size_mib=mib, read_fraction=read_fraction)["mixed_gbps"]


def _read_fraction(row: dict[str, Any]) -> float:
    """The share of a step's drive bytes that were reads, to two places: the drive measurement's mix."""
    return round(row["read_bytes"] / max(1, row["read_bytes"] + row["written_bytes"]), 2)


def run_demo(*, preset: str, steps: int, batch_size: int, nvme_path: str, prefetch_depth: int | str,
             host_budget_bytes: int | None, device_budget_bytes: int | None, lr: float | None = None,
             step_in_backward: bool = True, dtype: str = "fp32", moments: str = "fp32", master: str = "fp32",
             compute: str = "auto", measure_drive_mib: int = 0, log=print) -> dict[str, Any]:

    if preset not in PRESETS:
        raise TierValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    if steps < 1 or batch_size < 1:
        raise TierValueError("--steps and --batch-size must be >= 1")
    lr = PRESET_LR[preset] if lr is None else lr
    if not lr > 0:
        raise TierValueError(f"--lr {lr} must be > 0")
    warmup = max(1, steps // 2)
    if dtype not in DTYPES:
        raise TierValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if measure_drive_mib < 0:
        raise TierValueError(f"--measure-drive {measure_drive_mib}: give the MiB each measurement moves, or 0 for none")
    torch_dtype = DTYPES[dtype]
    from tierstore.integrations.layouts import StateLayout, packed_size

    from .upcast import choice_text, compute_in_fp32, resolve_compute

    layout = StateLayout(moments, master)  # checks the names
    cuda = torch.cuda.is_available()
    try:
        compute, product_s = resolve_compute(compute, torch_dtype, on_cpu=not cuda)
    except ValueError as e:
        raise TierValueError(f"--{e}") from None
    # Before the model exists, so that the measurement's own memory is not in the figures of RSS.
    drive_gbps = [_drive_mixed_gbps(nvme_path, measure_drive_mib, 0.55)] if measure_drive_mib else []
    rss_start = rss_bytes()  # the whole process from here, the model's construction included
    start_resettable = reset_peak_rss()
    cfg = PRESETS[preset]
    with torch.device("meta"):  # no memory: offload_model builds it module by module into the store
        model = ViT(cfg).to(torch_dtype)
    if compute == "fp32":
        compute_in_fp32(model)
    torch.manual_seed(0)
    n = num_params(model)
    state_bytes, host, device = default_budgets(n, host_budget_bytes, device_budget_bytes)
    config = StoreConfig(nvme_path=nvme_path, host_budget_bytes=host, device_budget_bytes=device)
    # On the drive: the weights, their masters (bf16 weights: fp32, or the low half when split) and two moments.
    half = torch_dtype != torch.float32
    moment_bytes = {"fp32": 8 * n, "bf16": 4 * n, "8bit": 2 * packed_size(n)}[moments]
    master_bytes = 0 if not half else {"fp32": 4 * n, "split": 2 * n, "none": 0}[master]
    on_drive = n * torch.empty((), dtype=torch_dtype).element_size() + master_bytes + moment_bytes
    what = "weights" + (f", {master} masters" if half and master != "none" else "")
    log(f"tierstore demo: ViT-{preset}, {n / 1e6:.1f}M parameters, {dtype}"
        + (f" computed in {'fp32' if compute == 'fp32' else dtype}{choice_text(product_s, dtype)}" if half else "")
        + f"; {on_drive / MIB:.0f} MiB of {what} and {moments} AdamW moments on NVMe under {nvme_path!r}, built on "
        f"the meta device")
    if moments == "fp32" and (master == "fp32" or not half):
        update = "torch's fused kernel"
    else:  # the compressed state's own update; tensors too small to compress keep torch's fused kernel
        from tierstore.integrations.layouts import native_kernel_built

        update = "the compressed update's " + ("native kernel" if native_kernel_built() else "torch operations")
    log(f"data: synthetic {cfg.image_size}x{cfg.image_size} images ({cfg.num_classes} random templates plus noise, "
        f"made in-process), batch {batch_size}; AdamW ({update}) lr {lr:g} after {warmup} warm-up step(s)")
    budgets = f"host {host / MIB:.1f} MiB" + (f", device {device / MIB:.1f} MiB" if cuda else
                                              " (no CUDA: modules compute in the host tier)")
    log(f"budgets: {budgets}; prefetch depth {prefetch_depth}" + (" (chosen each step: the 'depth' column)"
                                                                 if prefetch_depth == "auto" else "")
        + "; optimizer steps "
        + ("in backward" if step_in_backward else "after backward"))
    data = SyntheticImages(cfg)
    rows = []
    with TierStore(config) as store:
        t0 = time.perf_counter()
        off = offload_model(model, store, prefetch_depth=prefetch_depth)
        log(f"built into the store in {time.perf_counter() - t0:.1f} s")
        # torch's fused AdamW: one pass over each parameter's state (see [Note: Which AdamW])
        opt = OffloadedAdamW(off, lr=lr, step_in_backward=step_in_backward, speculate=False, fused=True,
                             moments=layout.moments, master=layout.master)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        store.flush()
        built_peak = peak_rss_bytes() - rss_start if start_resettable else None  # construction's own peak
        rss_before = rss_bytes()
        if not reset_peak_rss():
            rss_before = 0  # the peak below is then the process's lifetime peak
        # [Note: The drive beside the steps] The drive's rate changes by tens of percent from one minute to
        # the next on some machines, so each step is set against the drive measured just before and just after
        # it (the measurements alternate with the steps, outside their time; each step then ends when its
        # write-behind is on the drive, so the measurement has the drive to itself): the mean of the two. Each
        # measurement makes and closes a store of its own; the peak RSS it adds is left out of the figures
        # (the kernel's peak mark is reset after it), so without that reset it runs only after the last step.
        between = bool(measure_drive_mib) and rss_before > 0
        log("drive columns: bytes the step read from and wrote to the drive, and their sum over the step's time"
            + ("; its share of the drive's mixed rate measured just before and after the step" if between else ""))
        header = (f"{'step':>4} {'loss':>8} {'step s':>8} {'stall s':>8} {'read MiB':>9} {'write MiB':>9} "
                  f"{'drive GB/s':>10} {'depth':>5}" + (f" {'x drive':>7}" if between else ""))
        log(header)
        peak_rss = 0
        for step in range(steps):
            row = measure_step(model, store, opt, data, batch_size, step, sched, torch_dtype, write_behind=between)
            row["prefetch_depth"] = off.stats.prefetch_depth
            rows.append(row)
            share = ""
            if between:
                peak_rss = max(peak_rss, peak_rss_bytes())
                drive_gbps.append(_drive_mixed_gbps(nvme_path, measure_drive_mib, _read_fraction(row)))
                reset_peak_rss()
                row["drive_share"] = row["nvme_gbps"] / (sum(drive_gbps[-2:]) / 2)
                share = f" {row['drive_share']:>6.2f}x"
            log(f"{step:>4} {row['loss']:>8.4f} {row['step_s']:>8.3f} {row['stall_s']:>8.3f} "
                f"{row['read_bytes'] / MIB:>9.1f} {row['written_bytes'] / MIB:>9.1f} "
                f"{row['nvme_gbps']:>10.2f} {row['prefetch_depth']:>5}{share}  {_bar(step + 1, steps)}")
        opt.close()
        placement, verdict = off.placement, off.placement_verdict
        peak_rss = max(peak_rss, peak_rss_bytes())
        mem = store.memory()
        stats = store.stats_dict()
        split = off.host_budget_split()
        off.remove(keep_values=False)  # the demo's trained values are not kept: nothing to read back at close
    log("host budget shared (MiB):  " + "  ".join(f"{name[:-6].replace('_', ' ')} {v / MIB:.1f}"
                                                  for name, v in split.items() if v is not None))
    log("peak memory per tier (MiB):  " + "  ".join(
        f"{tier} {m['peak_bytes'] / MIB:.1f}/{m['budget_bytes'] / MIB:.1f}" if m["budget_bytes"] > 0
        else f"{tier} {m['peak_bytes'] / MIB:.1f}" for tier, m in mem.items() if tier != "device" or cuda))
    log(f"peak RSS: {peak_rss / MIB:.0f} MiB, {(peak_rss - rss_before) / MIB:.0f} MiB above the RSS before the "
        f"first step (budgets: host {host / MIB:.1f}" + (f" + device {device / MIB:.1f}" if cuda else "")
        + " MiB; the rest is activations, "
        f"gradients not yet consumed and the runtime); prefetch hits {stats['hits']}, misses {stats['misses']}")
    if built_peak is not None:
        whole_peak = max(built_peak, peak_rss - rss_start)
        log(f"peak RSS of the whole process, construction included: {whole_peak / MIB:.0f} MiB above the RSS "
            f"before the model existed (construction alone: {built_peak / MIB:.0f} MiB)")
    if placement is not None:
        log(placement.summary())
    if verdict is not None:
        log(verdict)
    if measure_drive_mib and not between:  # after the store is gone: its swap files and buffers too
        drive_gbps.append(_drive_mixed_gbps(nvme_path, measure_drive_mib, _read_fraction(rows[-1])))
        for row in rows:
            row["drive_share"] = row["nvme_gbps"] / max(drive_gbps)
    if measure_drive_mib:
        shares = [row["drive_share"] for row in rows[1:] or rows]
        log(f"the drive's mixed read+write rate (the store moving {measure_drive_mib} MiB) "
            + ("before the first step and after each: " if between else "before the steps and after them: ")
            + ", ".join(f"{g:.2f}" for g in drive_gbps) + " GB/s; steps " + ("after the first " if len(rows) > 1 else "")
            + f"ran at {min(shares):.2f}-{max(shares):.2f}x of it"
            + ("" if between else f" (of the faster, {max(drive_gbps):.2f})"))
    log(f"loss: {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}")
    return {"preset": preset, "params": n, "steps": rows, "memory": mem, "peak_rss_bytes": peak_rss, "rss_before_steps_bytes": rss_before,
            "hits": stats["hits"], "misses": stats["misses"], "prefetch_depth": prefetch_depth,
            "host_budget_bytes": host, "device_budget_bytes": device, "lr": lr, "dtype": dtype,
            "compute": "fp32" if compute == "fp32" or not half else dtype, "product_seconds": product_s,
            "construction_peak_rss_bytes": built_peak, "drive_mixed_gbps": drive_gbps, "bytes_on_drive": on_drive,
            "placement": None if placement is None else {
                "resident_bytes": placement.resident_bytes, "bytes_per_step": placement.bytes_per_step,
                "lower_bound_bytes": placement.lower_bound_bytes}}


__all__ = ["default_budgets", "measure_step", "run_demo"]
