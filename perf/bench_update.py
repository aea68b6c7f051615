"""The compressed update's speed against the drive's: GB of optimizer state updated per second of CPU, beside the
drive's mixed read+write GB/s measured in the same run.

    python perf/bench_update.py --elements 33554432 --nvme-path DIR

A parameter's state is stored compressed (see [Note: Compressed optimizer state]); a step reads it from the
drive, updates it and writes it back, so the update keeps up with the drive when it turns over the stored
bytes at least as fast as the drive moves them. For each layout (bf16 weights: moments, master) one tensor of
``--elements`` values with a bf16 gradient is updated ``--rounds`` times, and the best round is kept:

- ``state GB``: the bytes stored for it: both moments, the master (its low half under ``split``) and the weight;
- ``GB/cpu-s``: those bytes over the CPU seconds of one update on one thread (the native kernel; the torch
  operations of the same arithmetic beside it, ``torch ops``), and over the wall seconds of one update split
  over ``--threads`` threads (as the optimizer runs it after backward);
- the reference: the drive's mixed GB/s (half reads, half writes: a step's mix), measured by the store on
  ``--nvme-path`` in the same run, before and after the updates (the figure drifts for minutes at a time);
  the ratio is ours over the reference, and 1 or more means the update is not what bounds a step.

The fp32 layout (torch's own AdamW, fused, as the fp32 layout runs it when asked for fused) is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

LAYOUTS = (("8bit", "split"), ("8bit", "none"), ("bf16", "split"), ("fp32", "fp32"))


def _state(moments: str, master: str, n: int) -> dict:
    import torch
    from tierstore.integrations import layouts as L

    g = torch.Generator().manual_seed(0)
    fp = torch.randn(n, generator=g)
    out: dict = {"grad": (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16), "low": None}
    if master == "split":
        out["weight"], out["low"] = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
        L.split_master(fp, out["weight"], out["low"])
    elif master == "none":
        out["weight"] = fp.to(torch.bfloat16)
    else:
        out["weight"] = fp  # the fp32 master (the bf16 weight is made from it: counted in the bytes below)
    for key, value, signed in (("exp_avg", torch.randn(n, generator=g) * 1e-3, True),
                               ("exp_avg_sq", torch.rand(n, generator=g) * 1e-6, False)):
        if moments == "8bit":
            out[key] = torch.zeros(L.packed_size(n), dtype=torch.uint8)
            L.encode_state("8bit", value, out[key], signed, None)
        else:
            out[key] = value.to(torch.bfloat16 if moments == "bf16" else torch.float32)
    return out


def _stored_bytes(moments: str, master: str, st: dict) -> int:
    n = st["weight"].numel()
    nbytes = st["exp_avg"].nbytes + st["exp_avg_sq"].nbytes + 2 * n  # the bf16 weight
    return nbytes + (st["low"].nbytes if master == "split" else 4 * n if master == "fp32" else 0)


def _time(update, rounds: int) -> tuple[float, float]:
    """(best CPU seconds, best wall seconds) of ``rounds`` calls after one warm-up."""
    update(1.0)
    cpu, wall = [], []
    for r in range(rounds):
        c0, t0 = time.process_time(), time.perf_counter()
        update(float(r + 2))
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return min(cpu), min(wall)


def run_layout(moments: str, master: str, n: int, rounds: int, threads: int) -> dict:
    import torch
    from tierstore.integrations import layouts as L

    st = _state(moments, master, n)
    hyper = (1e-3, (0.9, 0.999), 1e-8, 0.01, False)
    nbytes = _stored_bytes(moments, master, st)
    res: dict = {"layout": f"{moments}/{master}", "elements": n, "state_bytes": nbytes}
    if moments == "fp32":
        grad = st["grad"].float()

        def fp32(step: float) -> None:
            L.adamw_update(st["weight"], st["exp_avg"], st["exp_avg_sq"], grad, step, hyper, "fused")

        torch.set_num_threads(1)
        res["cpu_s"], _ = _time(fp32, rounds)
        torch.set_num_threads(threads)
        _, res["wall_s"] = _time(fp32, rounds)
        return res

    def update(native: bool, nthreads: int):
        def call(step: float) -> None:
            L.compressed_update(moments=moments, master=None if master == "none" else master, weight=st["weight"],
                                low=st["low"], exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"], grad=st["grad"],
                                step=step, hyper=hyper, seed=0, native=native, threads=nthreads)
        return call

    torch.set_num_threads(1)
    native = L.native_kernel_built()
    res["native"] = native
    res["cpu_s"], _ = _time(update(native, 1), rounds)
    res["torch_cpu_s"], _ = _time(update(False, 1), rounds)
    torch.set_num_threads(threads)
    _, res["wall_s"] = _time(update(native, threads), rounds)
    return res


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--elements", type=int, default=1 << 25, help="values in the tensor updated (default 32M)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of the split update (default: the CPU count)")
    p.add_argument("--drive-mib", type=int, default=1024, help="MiB the drive measurement moves")
    p.add_argument("--nvme-path", default=None, help="where the drive is measured (default: tierstore's cache)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch
    from tierstore import default_nvme_path
    from tierstore.tools.bench_drive import measure_drive

    path = args.nvme_path or default_nvme_path()
    before = measure_drive(path, size_mib=args.drive_mib, read_fraction=0.5)["mixed_gbps"]
    saved_threads = torch.get_num_threads()
    try:
        results = [run_layout(m, s, args.elements, args.rounds, args.threads) for m, s in LAYOUTS]
    finally:
        torch.set_num_threads(saved_threads)
    after = measure_drive(path, size_mib=args.drive_mib, read_fraction=0.5)["mixed_gbps"]
    drive = max(before, after)  # the faster of the two: the harder reference
    print(f"the drive's mixed read+write rate (the reference): {before:.2f} GB/s before the updates, {after:.2f} "
          f"after; {drive:.2f} used")
    print(f"{'layout':<12} {'state B/param':>13} {'GB/cpu-s':>9} {'ratio':>6} {'torch ops':>10} {'ratio':>6} "
          f"{f'GB/s {args.threads} thr':>12} {'ratio':>6}")
    for r in results:
        gb = r["state_bytes"] / 1e9
        r["gb_per_cpu_s"] = gb / r["cpu_s"]
        r["gb_per_wall_s"] = gb / r["wall_s"]
        r["torch_gb_per_cpu_s"] = gb / r["torch_cpu_s"] if "torch_cpu_s" in r else None
        torch_ops = (f"{r['torch_gb_per_cpu_s']:>10.2f} {r['torch_gb_per_cpu_s'] / drive:>6.2f}"
                     if r["torch_gb_per_cpu_s"] else f"{'-':>10} {'-':>6}")
        print(f"{r['layout']:<12} {r['state_bytes'] / r['elements']:>13.2f} {r['gb_per_cpu_s']:>9.2f} "
              f"{r['gb_per_cpu_s'] / drive:>6.2f} {torch_ops} {r['gb_per_wall_s']:>12.2f} "
              f"{r['gb_per_wall_s'] / drive:>6.2f}")
    if not all(r.get("native", True) for r in results):
        print("the native kernel was not built here (see the warning): the first columns are torch operations")
    out = {"drive_mixed_gbps": drive, "drive_mixed_gbps_before": before, "drive_mixed_gbps_after": after,
           "threads": args.threads, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
