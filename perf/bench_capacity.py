"""Bigger than the host budget: a model built on the meta device, offloaded and trained in every optimizer mode;
peak RSS of the whole process (construction included) against the budgets plus a fixed overhead.

    python perf/bench_capacity.py --layers 24 --width 2048 --state-per-budget 10 --nvme-path /mnt/nvme

The model is a stack of Linear(width, width) layers with GELU, fp32, AdamW. Each mode runs in a fresh process,
whose RSS before the model exists is the baseline:

- ``accumulate``: the loop transformers' Trainer runs: 2 micro-batches a step, clipping by the global norm
  (torch's ``clip_grad_norm_`` over ``model.parameters()``), the optimizer after backward;
- ``after``: one backward, the optimizer after it;
- ``in-backward``: ``OffloadedAdamW(step_in_backward=True)``.

The claim, for each: ``peak RSS - baseline <= host budget + device budget + activations of one forward +
max_grad_backlog_bytes + the largest gradient (autograd makes it before the store sees it) + overhead``, the
printed ratio (measured / allowed) at or below 1, with no environment variable set: the store fixes the
allocator's mmap threshold itself (see [Note: Giving freed memory back] in tierstore/_allocator.py). Kept
gradients live in the store under the host budget (see [Note: Gradients in the tiers]); eager construction
alone would add the model's fp32 weights to the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MIB = 1024**2
# The allocator, thread stacks, torch's kernels' first buffers, autograd's bookkeeping: measured 50-65 MiB here in
# every mode, at 2.6M and 10.5M parameters alike.
OVERHEAD_BYTES = 96 * MIB


def _child(args: argparse.Namespace) -> dict:
    import time

    import torch
    import torch.nn.functional as F

    import tierstore as ts
    from tierstore.tools.rss import peak_rss_bytes, reset_peak_rss, rss_bytes
    from tierstore.integrations import OffloadedAdamW, load_safetensors, offload_model

    torch.set_num_threads(2)

    def build() -> torch.nn.Module:
        layers: list[torch.nn.Module] = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
        return torch.nn.Sequential(*layers)

    params = args.layers * (args.width * args.width + args.width)
    state = params * 4 * 3
    host = max(state // args.state_per_budget, 5 * 4 * (args.width * args.width + args.width))  # an update + a unit
    if args.host_budget:
        host = ts.parse_bytes(args.host_budget, name="--host-budget")
    torch.manual_seed(0)
    batch = torch.randn(args.batch_size, args.width)
    target = torch.randn(args.batch_size, args.width)
    baseline = rss_bytes()
    if not reset_peak_rss():
        baseline = 0
    threshold = {} if args.malloc_mmap_threshold is None else {"malloc_mmap_threshold_bytes": (
        None if args.malloc_mmap_threshold == "none" else args.malloc_mmap_threshold)}
    with ts.TierStore(nvme_path=args.nvme_path, host_budget_bytes=host, device_budget_bytes="1MiB",
                      **threshold) as store:
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = build()
        off = offload_model(model, store)
        if args.load:  # pretrained weights streamed in, one tensor at a time
            load_safetensors(args.load, off)
        built_s = time.perf_counter() - t0
        built_peak = peak_rss_bytes() - baseline
        opt = OffloadedAdamW(off, lr=1e-4, step_in_backward=args.mode == "in-backward")
        micro = 2 if args.mode == "accumulate" else 1
        losses, steps_s = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            for i in range(micro):
                rows = slice(i * args.batch_size // micro, (i + 1) * args.batch_size // micro)
                loss = F.mse_loss(model(batch[rows]), target[rows]) / micro
                loss.backward()
                losses.append(loss.item() * micro)
            if args.mode == "accumulate":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            steps_s.append(time.perf_counter() - t0)
        opt.close()
        stats = store.stats_dict()
    peak = peak_rss_bytes() - baseline
    activations = 2 * args.layers * args.batch_size * args.width * 4 * 2  # outputs and GELU inputs, with grads
    in_flight = 4 * (args.width * args.width + args.width)  # the gradient autograd makes before the store sees it
    backlog = host // 4 if args.mode == "in-backward" else 0  # OffloadedAdamW's default max_grad_backlog_bytes
    allowed = host + MIB + activations + backlog + in_flight + OVERHEAD_BYTES
    return {"mode": args.mode, "params": params, "baseline_rss_bytes": baseline, "peak_rss_bytes": peak_rss_bytes(), "state_bytes": state, "peak_rss_after_build": built_peak, "host_budget_bytes": host, "peak_rss_above_baseline": peak,
            "allowed_bytes": allowed, "ratio": peak / allowed, "weights_bytes": params * 4, "losses": losses,
            "build_s": built_s, "steps_s": steps_s, "bytes_read_nvme": stats["bytes_read_nvme"],
            "bytes_written_nvme": stats["bytes_written_nvme"]}


MODES = ("accumulate", "after", "in-backward")


def _write_pretrained(args: argparse.Namespace, directory: str) -> str:
    """Weights for the stack, in bf16 (converted to the fp32 parameters as they load), one layer at a time."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    weights = {}
    for i in range(args.layers):
        weights[f"{2 * i}.weight"] = (torch.randn(args.width, args.width, generator=g) * 0.02).bfloat16()
        weights[f"{2 * i}.bias"] = torch.zeros(args.width, dtype=torch.bfloat16)
    path = os.path.join(directory, "pretrained.safetensors")
    save_file(weights, path)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--state-per-budget", type=int, default=10, help="fp32 state / host budget (default 10)")
    p.add_argument("--host-budget", help="host budget (a size such as 512MiB; default: the state over "
                                         "--state-per-budget)")
    p.add_argument("--malloc-mmap-threshold", help="the store's malloc_mmap_threshold_bytes ('none': leave the "
                                                   "allocator alone; default: the store's default)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--nvme-path", default=None, help="directory on the drive (default: a temporary one in /var/tmp)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    p.add_argument("--pretrained", action="store_true",
                   help="also load weights from a safetensors file (written first, outside the measured process)")
    p.add_argument("--json", help="write the results (a list, one per mode) to this file")
    p.add_argument("--load", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, default="accumulate", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return {}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: {', '.join(bad) or 'none given'}; choose from {', '.join(MODES)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-capacity-", dir=args.nvme_path or "/var/tmp") as d:
        load = ["--load", _write_pretrained(args, d)] if args.pretrained else []
        for mode in modes:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode, "--layers", str(args.layers),
                   "--width", str(args.width), "--state-per-budget", str(args.state_per_budget),
                   *(["--host-budget", args.host_budget] if args.host_budget else []),
                   *(["--malloc-mmap-threshold", args.malloc_mmap_threshold] if args.malloc_mmap_threshold else []),
                   "--steps",
                   str(args.steps), "--batch-size", str(args.batch_size), "--nvme-path", d, *load]
            env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # the store sets it
            r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
            if r.returncode != 0:
                raise SystemExit(f"the measured process ({mode}) failed:\n{r.stderr}")
            results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    res = results[0]
    print(f"capacity: {res['params'] / 1e6:.1f}M parameters, fp32 state {res['state_bytes'] / MIB:.0f} MiB = "
          f"{res['state_bytes'] / res['host_budget_bytes']:.1f}x the host budget of "
          f"{res['host_budget_bytes'] / MIB:.0f} MiB; built on meta" + (" and pretrained weights loaded"
                                                                        if args.pretrained else "")
          + f"; the weights alone would be {res['weights_bytes'] / MIB:.0f} MiB")
    print(f"{'mode':<12} {'build s':>7} {'step s':>14} {'loss first->last':>18} {'peak RSS MiB':>12} "
          f"{'(after build)':>13} {'whole process':>13} {'allowed MiB':>11} {'ratio':>6} {'drive read/written GiB':>22}")
    for res in results:
        print(f"{res['mode']:<12} {res['build_s']:>7.2f} {' '.join(f'{s:.2f}' for s in res['steps_s']):>14} "
              f"{res['losses'][0]:>8.4f}->{res['losses'][-1]:<8.4f} {res['peak_rss_above_baseline'] / MIB:>12.0f} "
              f"{res['peak_rss_after_build'] / MIB:>13.0f} {res['peak_rss_bytes'] / MIB:>13.0f} "
              f"{res['allowed_bytes'] / MIB:>11.0f} {res['ratio']:>6.2f} "
              f"{res['bytes_read_nvme'] / 2**30:>10.2f}/{res['bytes_written_nvme'] / 2**30:<.2f}")
    print(f"allowed = host budget + device budget + activations + gradient backlog (in backward) + one gradient in "
          f"flight + {OVERHEAD_BYTES // MIB} MiB; the claim holds where ratio <= 1")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return {"results": results, **results[0]}


if __name__ == "__main__":
    main()
