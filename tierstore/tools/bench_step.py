"""`tierstore bench step`: offloaded step time at several prefetch depths against the resident step and the bound.

bound = max(resident step, bytes moved per step / drive GB/s), both measured
in the same run (see [Note: The compute in the bound]), the drive's GB/s for
the step's own mix of reads and writes (they share the drive: here a mix runs
well below reads or writes alone); overlap efficiency = bound / offloaded
step, and 'vs resident' = resident step / offloaded step. Depths and the
resident reference are run in alternating order over rounds and medians are
reported.

[Note: The drive's rate for the bound] A virtual disk's rate moves from
minute to minute (0.8 to 1.7 GB/s on one machine, within an hour), so one
measurement before the steps can be far below what the drive does during
them, and the bound then comes out loose (an "overlap" of 1.38 was seen).
The drive is measured before the first round and after every round, and the
fastest mix is used; a step that moved its bytes faster still (its bytes over
its whole time) raises the rate to that. The bound is then one the drive
has shown it can reach in this run, and overlap efficiency cannot pass 1.

[Note: The compute in the bound] The bound's compute is the whole resident
step: forward, backward and the update (torch's AdamW after backward, on the
training thread). Counting forward and backward alone left the update's
arithmetic out, so a step whose I/O was all hidden (0.058 s of stall on
ViT-large) read an "overlap" of 0.52. An offloaded step that steps in
backward runs its update on a worker beside backward and can beat the
resident step (ViT-large bf16 on two cores: 2.8 s against 5.5 s): its
overlap then passes 1, which says the update overlapped backward. The
resident reference runs in a process of its own (in this one, the
allocator's state after the offloaded setups would change its time), kept
alive for the whole run and asked for a sample in each round, in the
alternating order of the offloaded rows, so the drive's and the CPU's swings
fall on both alike.

[Note: A sample is steps in a row] A step's last writes go on after its
``step()`` returns, into the next step of its model. Models taking single
steps in turn let those writes run inside another model's step, where they
were counted for neither (their bytes fell between the model's own
windows) and slowed the other. So a sample is STEPS_PER_SAMPLE steps of one
model in a row and the wait for its last writes, divided by their number.
"""

from __future__ import annotations

import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F

from tierstore import StoreConfig, TierStore, TierStoreError, TierValueError
from tierstore.scheduling import count_text, size_text
from tierstore.integrations import OffloadedAdamW, offload_model

from .bench_drive import measure_drive
from .bench_rss import measure_rss
from .demo import DTYPES, default_budgets, measure_step
from .vit import PRESETS, SyntheticImages, ViT, num_params

MIB = 1024**2
# Before the timed rounds: the trace-recording step, a placement's trial (three steps), and the step after its
# verdict (a dropped placement writes its kept copies home then).
WARMUP_STEPS = 5
STEPS_PER_SAMPLE = 2  # see [Note: A sample is steps in a row]


class _MasterAdamW:
    """The resident reference of mixed precision, as OffloadedAdamW computes it: torch's AdamW (foreach=False, or
    fused) over fp32 masters of the bf16 parameters, each parameter rounded from its master after the step."""

    def __init__(self, model: torch.nn.Module, fused: bool = False) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=1e-3, foreach=False, fused=fused)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.opt.zero_grad()


def resident_step(model, data, batch_size: int, step: int, opt,
                   dtype: torch.dtype = torch.float32) -> tuple[float, float, float]:
    """(the step's seconds, those of its forward and backward, those of its forward)."""
    t0 = time.perf_counter()
    x, y = data.batch(step, batch_size)
    loss = F.cross_entropy(model(x.to(dtype)).float(), y)
    forward = time.perf_counter() - t0
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0, t1 - t0, forward


def run_step_bench(*, preset: str, batch_size: int, depths: list[int | str], nvme_path: str, rounds: int,
                   host_budget_bytes: int | None, device_budget_bytes: int | None, trace_path: str | None = None,
                   step_in_backward: bool = True, rss: bool = True, dtype: str = "fp32", placement_ab: bool = False,
                   fused: bool = False, layouts: list[str] | None = None, log=print) -> dict[str, Any]:
    """``layouts``: optimizer state layouts ("moments/master", e.g. "8bit/split") also run at the last depth, in
    the same rounds (see [Note: Compressed optimizer state])."""
    if preset not in PRESETS:
        raise TierValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise TierValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    base = ViT(cfg).to(torch_dtype)
    n = num_params(base)
    # bf16 weights with fp32 masters: 2 + 4 + 8 bytes of state a parameter, against fp32's 4 + 8.
    state_bytes = n * (12 if torch_dtype == torch.float32 else 14)
    _, host, device = default_budgets(n, host_budget_bytes or max(384 * 1024, state_bytes // 3),
                                      device_budget_bytes)
    data = SyntheticImages(cfg)

    setups: dict[Any, tuple] = {}

    offloads: dict[Any, Any] = {}

    def setup(key: Any, depth: int | str, make_opt, placement: bool = True) -> dict[str, Any]:
        """A fresh offloaded model, store and optimizer under ``key``; runs the first (trace-recording) step."""
        model = copy.deepcopy(base)
        store = TierStore(StoreConfig(nvme_path=nvme_path, host_budget_bytes=host, device_budget_bytes=device))
        try:
            off = offloads[key] = offload_model(model, store, prefetch_depth=depth, placement=placement)
            opt = make_opt(off)
        except BaseException:
            store.close()
            raise
        setups[key] = (model, store, opt)
        # See WARMUP_STEPS (and integrations/_placing.py).
        for step in range(WARMUP_STEPS - 1):
            measure_step(model, store, opt, data, batch_size, step, dtype=torch_dtype)
        last = measure_step(model, store, opt, data, batch_size, WARMUP_STEPS - 1, dtype=torch_dtype)
        opt.wait()  # its writes belong to the warm-up, not to the first sample
        return last

    def adamw(off, **kw) -> OffloadedAdamW:  # every offloaded setup's optimizer, stepping where the flag says
        return OffloadedAdamW(off, lr=1e-3, fused=fused, speculate=False, **kw)

    # With placement_ab, the deepest numeric depth again without a placement (same run, alternating).
    numeric = [d for d in depths if isinstance(d, int)]
    unplanned = f"{max(numeric)} w/o plan" if placement_ab and numeric else None
    last = depths[-1]
    layout_keys = {f"{last} {lay}": tuple(lay.split("/")) for lay in layouts or []}
    rows_keys: list[Any] = [*depths, *([unplanned] if unplanned else []), *layout_keys]
    samples: dict[Any, list] = {"serial": [], **{d: [] for d in rows_keys}}
    resident = _ResidentRounds(preset, batch_size, dtype, fused)  # see [Note: The compute in the bound]
    resident_samples: list[tuple[float, float, float]] = []
    try:
        for d in depths:
            first = setup(d, d, lambda off: adamw(off, step_in_backward=step_in_backward))
        if unplanned:
            setup(unplanned, max(numeric), lambda off: adamw(off, step_in_backward=step_in_backward), placement=False)
        for key, (moments, master) in layout_keys.items():
            setup(key, last, lambda off, mo=moments, ma=master: adamw(off, step_in_backward=step_in_backward,
                                                                      moments=mo, master=ma))
        # The reference without any overlap: no prefetch, the optimizer after backward with no read-ahead, its
        # writes finished inside the step.
        setup("serial", 0, lambda off: _NoOverlap(adamw(off, readahead=0)))
        # A step reads and writes at once; the drive's rate for that mix is what bounds it.
        moved = first["read_bytes"] + first["written_bytes"]
        drives: list[dict[str, float]] = []

        def drive_once() -> None:  # see [Note: The drive's rate for the bound]
            drives.append(measure_drive(nvme_path, size_mib=max(16, min(512, state_bytes // MIB)),
                                        read_fraction=first["read_bytes"] / moved if moved else 0.5))

        drive_once()
        for r in range(rounds):
            order = ["serial", "resident", *rows_keys] if r % 2 == 0 else [*reversed(rows_keys), "resident", "serial"]
            for d in order:
                if d == "resident":
                    resident_samples += resident.sample(STEPS_PER_SAMPLE)
                    continue
                samples[d].append(offloaded_sample(*setups[d], data, batch_size,
                                                    WARMUP_STEPS + r * STEPS_PER_SAMPLE, torch_dtype))
            drive_once()
        plans = {key: off.placement for key, off in offloads.items()}
        tried = {key: off.placer.tried for key, off in offloads.items()}
        chosen = {key: off.stats.prefetch_depth for key, off in offloads.items()}
        if trace_path:
            traced = max(numeric) if numeric else depths[0]
            model, store, opt = setups[traced]
            timeline = store.record_timeline()
            assert timeline is not None
            offloaded_sample(model, store, opt, data, batch_size, WARMUP_STEPS + rounds * STEPS_PER_SAMPLE,
                              torch_dtype, steps=1)
            store.record_timeline(False)
            n_events = timeline.write_chrome_trace(trace_path)
    finally:
        resident.close()
        for _, store, opt in setups.values():
            opt.close()
            store.close()
    resident_s = statistics.median(s[0] for s in resident_samples)
    compute_s = statistics.median(s[1] for s in resident_samples)  # see [Note: The compute in the bound]
    forward_s = statistics.median(s[2] for s in resident_samples)
    drive = max(drives, key=lambda m: m["mixed_gbps"])
    drive_gbps = drive["mixed_gbps"]
    stepped_gbps = max(s[2] / s[0] / 1e9 for key in ["serial", *rows_keys] for s in samples[key])
    raised = stepped_gbps > drive_gbps
    drive_gbps = max(drive_gbps, stepped_gbps)
    result: dict[str, Any] = {"preset": preset, "params": n, "batch_size": batch_size, "resident_step_s": resident_s,
                              "resident_compute_s": compute_s, "resident_forward_s": forward_s,
                              "drive_gbps": drive_gbps, "drive": drive, "drive_mixed_gbps_samples":
                              [m["mixed_gbps"] for m in drives], "drive_gbps_from_a_step": raised,
                              "host_budget_bytes": host, "device_budget_bytes": device,
                              "state_bytes": state_bytes, "step_in_backward": step_in_backward, "dtype": dtype,
                              "fused": fused, "depths": {}}
    precision = "fp32" if torch_dtype == torch.float32 else f"{dtype} weights with fp32 masters, resident too"
    log(f"bench step: ViT-{preset} ({count_text(n)} params, {precision}, {size_text(state_bytes)} state), "
        f"batch {batch_size}, host budget {size_text(host)}, device {size_text(device)}")
    seen = ", ".join(f"{m['mixed_gbps']:.2f}" for m in drives)
    log(f"drive (store, same run, fastest of {len(drives)}: {seen}): {drive['read_fraction']:.0%} reads mixed with "
        f"writes {drive['mixed_gbps']:.2f} GB/s (reads alone {drive['read_gbps']:.2f}, writes alone "
        f"{drive['write_gbps']:.2f})" + (f"; a step moved its bytes at {stepped_gbps:.2f} GB/s, which the bound uses"
                                         if raised else "") +
        f"; optimizer steps {'in' if step_in_backward else 'after'} backward"
        f"{' (torch AdamW fused kernel, resident too)' if fused else ''}")
    log(f"resident step (a process of its own, sampled in every round): {resident_s:.3f} s (the bound's compute), "
        f"its forward and backward {compute_s:.3f} s, its forward {forward_s:.3f} s; "
        f"depth 0: nothing read ahead (parameters or optimizer state); "
        "'serial': that, with the optimizer after backward and its writes waited for")
    # The placement printed: the automatic depth's (a fixed depth leaves its own units room, so plans differ).
    plan = plans.get("auto") or next((p for p in plans.values() if p is not None), None)
    verdicts: dict[str, list[str]] = {}  # each verdict once, with the depths it was reached at
    for key, off in offloads.items():
        if off.placement_verdict:
            verdicts.setdefault(off.placement_verdict, []).append(str(key))
    for verdict, keys in verdicts.items():
        log(f"depth{'s' if len(keys) > 1 else ''} {', '.join(keys)}: {verdict}")
    result["placement_verdicts"] = {str(key): off.placement_verdict for key, off in offloads.items()}
    if plan is not None:
        log(plan.summary(compute_s, drive_gbps * 1e9, forward_s))
        result["placement"] = {"resident_bytes": plan.resident_bytes, "room_bytes": plan.room_bytes,
                               "resident_by_kind": plan.resident_by_kind, "moved_by_kind": plan.moved_by_kind,
                               "bytes_per_step": plan.bytes_per_step, "lower_bound_bytes": plan.lower_bound_bytes,
                               "forward_bytes": plan.forward_bytes, "predicted_step_s":
                               plan.predicted_step_seconds(compute_s, drive_gbps * 1e9, forward_s)}
    log("overlap = bound / step (1.00: the step is as fast as the slower of the resident step and the drive; above "
        "1, the update overlapped backward); 'vs resident' = resident step / step; 'plan MiB' and 'plan s': what the "
        "placement "
        "predicts a step moves and takes (its forward, then the rest of the step, each bound by its compute or its "
        "bytes over the drive's rate); the last two "
        "columns: how many times faster than the first depth and than 'serial' (higher is better); 'auto' shows the "
        "depth it chose")
    log(f"{'depth':>16} {'step s':>8} {'stall s':>8} {'MiB/step':>9} {'plan MiB':>9} {'plan s':>7} {'bound s':>8} "
        f"{'overlap':>8} {'vs resident':>11} {'vs first':>9} {'vs serial':>9}")

    def row_of(key: Any) -> dict[str, Any]:
        step_s = statistics.median(s[0] for s in samples[key])
        moved = statistics.median(s[2] for s in samples[key])
        bound = max(resident_s, moved / (drive_gbps * 1e9))
        p = plans.get(key)
        return {"step_s": step_s, "stall_s": statistics.median(s[1] for s in samples[key]), "bytes_per_step": moved,
                "bound_s": bound, "overlap_efficiency": bound / step_s, "vs_resident": resident_s / step_s,
                "chosen_depth": chosen[key],
                "predicted_bytes_per_step": p.bytes_per_step if p else None,
                "predicted_step_s": p.predicted_step_seconds(compute_s, drive_gbps * 1e9, forward_s) if p else None,
                "lower_bound_bytes": tried[key].lower_bound_bytes if tried[key] else None}

    serial = result["serial"] = row_of("serial")
    for key in ["serial", *rows_keys]:
        row = serial if key == "serial" else row_of(key)
        if key != "serial":
            result["depths"][str(key)] = row
        base0 = result["depths"].get(str(depths[0]), row)["step_s"]
        vs_first = "" if key == "serial" else f"{base0 / row['step_s']:.2f}x"
        label = (f"auto={row['chosen_depth']}" if key == "auto" else
                 f"auto={row['chosen_depth']} {key.split(' ', 1)[1]}" if str(key).startswith("auto ") else str(key))
        planned = f"{row['predicted_bytes_per_step'] / MIB:.1f}" if row["predicted_bytes_per_step"] else "-"
        planned_s = f"{row['predicted_step_s']:.3f}" if row["predicted_step_s"] else "-"
        log(f"{label:>16} {row['step_s']:>8.3f} {row['stall_s']:>8.3f} {row['bytes_per_step'] / MIB:>9.1f} "
            f"{planned:>9} {planned_s:>7} {row['bound_s']:>8.3f} {row['overlap_efficiency']:>8.2f} "
            f"{row['vs_resident']:>10.2f}x {vs_first:>9} "
            f"{serial['step_s'] / row['step_s']:>8.2f}x")
    deepest = max(numeric) if numeric else "auto"
    if rss and torch_dtype != torch.float32:
        log("peak RSS check: measured for fp32 only; run without --dtype for it")
        rss = False
    if rss:  # in a fresh process: this one held a store per depth (see [Note: Measuring RSS])
        try:
            probe = measure_rss(preset=preset, batch_size=batch_size, nvme_path=nvme_path, host_budget_bytes=host,
                                device_budget_bytes=device, prefetch_depth=deepest,
                                step_in_backward=step_in_backward)
        except RuntimeError as e:
            probe = {"error": str(e)}
            log(f"peak RSS check could not run: {e}")
        result["rss"] = probe
    if rss and "error" not in probe:
        log(f"peak RSS (fresh process, depth {deepest}): {probe['above_runtime_bytes'] / MIB:.0f} MiB above the "
            f"runtime's {probe['runtime_rss_bytes'] / MIB:.0f} MiB; budgets {probe['budgets_bytes'] / MIB:.0f} + "
            f"activations {probe['activations_bytes'] / MIB:.0f} + gradient backlog "
            f"{probe['grad_backlog_bytes'] / MIB:.0f} + overhead {probe['overhead_bytes'] / MIB:.0f} = "
            f"{probe['allowed_bytes'] / MIB:.0f} MiB allowed: {'within' if probe['within'] else 'OVER'} "
            f"(the state is {state_bytes / MIB:.0f} MiB)")
    if trace_path:
        log(f"timeline of one step at prefetch depth {traced}: {n_events} spans in {trace_path} "
            "(open it at https://ui.perfetto.dev)")
        result["trace"] = {"path": trace_path, "depth": traced, "events": n_events}
    return result


def run_budget_sweep(*, preset: str, batch_size: int, depths: list[int], nvme_path: str, rounds: int,
                     divisors: list[int], device_budget_bytes: int | None, step_in_backward: bool = True,
                     dtype: str = "fp32", fused: bool = False, log=print) -> dict[str, Any]:
    """``bench step`` at host budgets of state/k for each k in ``divisors``: per budget, the best depth's step
    time and bytes per step against the resident step and the bound, to show what a smaller budget costs."""
    if not divisors or any(k < 1 for k in divisors):
        raise TierValueError(f"--budget-sweep {divisors}: give divisors of the state, each >= 1 (e.g. 2,3,6,10)")
    torch.manual_seed(0)
    if preset not in PRESETS or dtype not in DTYPES:
        raise TierValueError(f"unknown preset {preset!r} or dtype {dtype!r}; presets: {', '.join(PRESETS)}; "
                             f"dtypes: {', '.join(DTYPES)}")
    with torch.device("meta"):
        n = num_params(ViT(PRESETS[preset]))
    state = n * (12 if dtype == "fp32" else 14)
    rows = []
    for k in sorted(set(divisors)):
        res = run_step_bench(preset=preset, batch_size=batch_size, depths=depths, nvme_path=nvme_path, rounds=rounds,
                             host_budget_bytes=max(384 * 1024, state // k), device_budget_bytes=device_budget_bytes,
                             step_in_backward=step_in_backward, rss=False, dtype=dtype, fused=fused,
                             log=lambda *a: None)
        depth, best = min(res["depths"].items(), key=lambda kv: kv[1]["step_s"])
        rows.append({"divisor": k, "host_budget_bytes": res["host_budget_bytes"], "depth": depth,
                     "resident_step_s": res["resident_step_s"],
                     "resident_compute_s": res["resident_compute_s"], "drive_gbps": res["drive_gbps"],
                     "placement_verdict": res["placement_verdicts"].get(depth), **best})
    log(f"bench step, budget sweep: ViT-{preset}, {dtype}, {size_text(state)} of state, batch {batch_size}; per "
        f"host budget the best of depths {','.join(map(str, depths))}; bound = max(resident step, "
        f"bytes / drive)")
    log("'bound MiB': the planner's lower bound on bytes per step at that budget; 'plan s': the step its placement "
        "predicts (its forward, then the rest)")
    log(f"{'budget':>8} {'host MiB':>9} {'depth':>6} {'step s':>8} {'plan s':>7} {'MiB/step':>9} {'bound MiB':>9} "
        f"{'resident s':>10} {'fwd+bwd s':>9} {'bound s':>8} {'overlap':>8}")
    for r in rows:
        lower = f"{r['lower_bound_bytes'] / MIB:.1f}" if r["lower_bound_bytes"] is not None else "-"
        planned_s = f"{r['predicted_step_s']:.3f}" if r["predicted_step_s"] else "-"
        log(f"{'1/' + str(r['divisor']):>8} {r['host_budget_bytes'] / MIB:>9.1f} {r['depth']:>6} {r['step_s']:>8.3f} "
            f"{planned_s:>7} {r['bytes_per_step'] / MIB:>9.1f} {lower:>9} {r['resident_step_s']:>10.3f} "
            f"{r['resident_compute_s']:>9.3f} {r['bound_s']:>8.3f} "
            f"{r['overlap_efficiency']:>8.2f}  {r['placement_verdict'] or ''}")
    return {"preset": preset, "params": n, "state_bytes": state, "dtype": dtype, "batch_size": batch_size,
            "sweep": rows}


def plot_budget_sweep(result: dict[str, Any], path: str) -> None:
    """Two panels over the host budget (as a fraction of the state): seconds per step (offloaded, resident, the
    bound) and MiB moved per step."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["sweep"]
    xs = [1 / r["divisor"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8.5, 5.6), height_ratios=[3, 2])
    top.plot(xs, [r["step_s"] for r in rows], "o-", label="offloaded step (best depth)")
    top.plot(xs, [r["resident_step_s"] for r in rows], ":", color="green", label="resident step")
    top.plot(xs, [r["bound_s"] for r in rows], "x--", color="red", label="bound")
    top.set_ylabel("seconds per step (lower is better)")
    bottom.plot(xs, [r["bytes_per_step"] / MIB for r in rows], "s-", color="purple", label="moved per step")
    bounded = [(x, r["lower_bound_bytes"] / MIB) for x, r in zip(xs, rows) if r.get("lower_bound_bytes") is not None]
    if bounded:
        bottom.plot(*zip(*bounded), "x--", color="red", label="lower bound\n(planner)")
    bottom.set_ylabel("MiB per step")
    bottom.set_xlabel("host budget / state")
    bottom.set_xscale("log")
    bottom.minorticks_off()
    bottom.set_xticks(xs, [f"1/{r['divisor']}" for r in rows])
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    top.set_title(f"ViT-{result['preset']}, {result['dtype']}: step time as the host budget shrinks")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class _ResidentRounds:
    """The resident reference (torch's AdamW) in a process of its own, kept for the whole run: each
    :meth:`sample` runs that many more resident steps there and gives each one's (seconds, forward and backward,
    forward). Its first two steps (which fault in Adam's state and temporaries) are run at the start and left
    out (see [Note: The compute in the bound])."""

    def __init__(self, preset: str, batch_size: int, dtype: str, fused: bool) -> None:
        args = json.dumps({"preset": preset, "batch_size": batch_size, "dtype": dtype, "fused": fused})
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([sys.executable, "-m", "tierstore.tools.bench_step", args], text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self.sample(2)

    def sample(self, steps: int) -> list[tuple[float, float, float]]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(f"{steps}\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self._proc.wait()
            self._stderr.seek(0)
            raise TierStoreError(f"the resident reference's process failed:\n{self._stderr.read()[-2000:]}")
        return [tuple(s) for s in json.loads(line)]

    def close(self) -> None:
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
        self._proc.wait()
        self._stderr.close()


def _resident_child(args: dict[str, Any]) -> None:
    """Serve :class:`_ResidentRounds`: for each number read from stdin, that many more resident steps, their
    samples as one JSON line."""
    torch_dtype = DTYPES[args["dtype"]]
    cfg = PRESETS[args["preset"]]
    torch.manual_seed(0)
    model = ViT(cfg).to(torch_dtype)
    data = SyntheticImages(cfg)
    # Both sides run the same implementation of torch's AdamW: fused=True, or its CPU default.
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False, fused=args["fused"])
           if torch_dtype == torch.float32 else _MasterAdamW(model, args["fused"]))
    step = 0
    for line in sys.stdin:
        out = []
        for _ in range(int(line)):
            out.append(resident_step(model, data, args["batch_size"], step, opt, torch_dtype))
            step += 1
        print(json.dumps(out), flush=True)


class _NoOverlap:
    """An OffloadedAdamW whose step also waits for its writes."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def step(self) -> None:
        self.opt.step()
        self.opt.wait()

    def wait(self) -> None:
        self.opt.wait()

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def close(self) -> None:
        self.opt.close()


def offloaded_sample(model, store, opt, data, batch_size: int, first_step: int, dtype: torch.dtype = torch.float32,
                      steps: int = STEPS_PER_SAMPLE) -> tuple[float, float, float]:
    """Seconds, stall seconds and drive bytes per step over ``steps`` steps in a row and the wait for the last
    one's writes (see [Note: A sample is steps in a row])."""
    before = store.stats_dict()
    t0 = time.perf_counter()
    for i in range(steps):
        measure_step(model, store, opt, data, batch_size, first_step + i, dtype=dtype)
    opt.wait()
    seconds = time.perf_counter() - t0
    after = store.stats_dict()
    moved = sum(after[k] - before[k] for k in ("bytes_read_nvme", "bytes_written_nvme"))
    return seconds / steps, (after["stall_seconds"] - before["stall_seconds"]) / steps, moved / steps


def check_plotting() -> None:
    """Raise ValueError now, before any measuring, when --plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise TierValueError("--plot needs matplotlib: pip install 'tierstore[bench]' (or matplotlib)") from e


def plot_step_bench(result: dict[str, Any], path: str) -> None:
    """Two panels sharing the depth axis, one quantity each: seconds per step (offloaded, resident, the bound)
    and the drive's GB/s (during the step, and measured alone); legends beside the panels, not over the lines."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted((d for d in result["depths"] if d.isdigit()), key=int)  # 'auto' is drawn apart, below
    xs = [int(d) for d in depths]
    rows = [result["depths"][d] for d in depths]
    during = [r["bytes_per_step"] / r["step_s"] / 1e9 for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8.5, 5.6), height_ratios=[3, 2])
    top.plot(xs, [r["step_s"] for r in rows], "o-", color="C0", linewidth=2, label="offloaded step")
    top.plot(xs, [r["bound_s"] for r in rows], "x--", color="C3", markersize=8,
             label="bound: max(resident step,\nbytes / drive GB/s)")
    top.axhline(result["resident_step_s"], color="C2", linestyle=":", linewidth=2, label="resident step")
    auto = result["depths"].get("auto")
    if auto is not None:  # at the depth it chose
        top.plot([auto["chosen_depth"]], [auto["step_s"]], "*", color="C4", markersize=12,
                 label=f"auto (chose {auto['chosen_depth']})")
    top.set_ylabel("seconds per step")
    top.set_ylim(bottom=0, top=max([r["step_s"] for r in rows] + ([auto["step_s"]] if auto else [])) * 1.15)
    top.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    top.set_title(f"ViT-{result['preset']} ({result['params'] / 1e6:.0f}M params), batch {result['batch_size']}")
    bottom.plot(xs, during, "s-", color="C1", label="drive GB/s during\nthe step")
    bottom.axhline(result["drive_gbps"], color="C7", linestyle="--", label="drive GB/s measured\nalone (same mix)")
    bottom.set_ylabel("GB/s")
    bottom.set_ylim(bottom=0, top=max([result["drive_gbps"], *during]) * 1.2)
    bottom.set_xlabel("prefetch depth (units read ahead)")
    bottom.set_xticks(xs)
    bottom.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    _resident_child(json.loads(sys.argv[1]))
