"""FSDP2 + NVMe offload: the step with prefetch against prefetch depth 0, on N gloo (or NCCL) ranks.

    python perf/bench_fsdp.py --preset large --ranks 2 --depths 0,2,4 --steps 4 --nvme-path /mnt/nvme

Each depth is one torchrun of ``tierstore.tools.fsdp_train`` (a fresh
model and fresh stores); its first step records the trace and is left out,
the median of the others is reported. Depths run in alternating order over
``--rounds``. Prints per depth the step time (slowest rank), stall time and
drive traffic, the speed-up over depth 0, and the step against FSDP2 alone
(no offload): each round's first run also trains FSDP2 alone in the same
processes first (``--check``), which gives that reference step time and
fails the benchmark unless the offloaded run is bit-identical to it.

    python perf/bench_fsdp.py --preset large --ranks 2 --micro-batches 2,8 --steps 3 --nvme-path /mnt/nvme

compares micro-batch counts instead (``--micro-batches``): for each count, one
torchrun layer by layer (``off.accumulate``) and one of FSDP2's loop with
gradient sync on the last micro-batch only, each a fresh model and stores,
the batch split evenly. Prints per rank and step (medians of steps 2..)
the all-gather and reduce-scatter bytes, the drive bytes read and written,
the step time and the peak RSS (each run a fresh process), the ratio of the
largest count to the smallest for each way (the layer-major step's
reference: itself at the smallest count), and the loop's figures over the
layer-major step's. A run before them, layer by layer at the largest count,
also trains FSDP2's loop alone first and fails unless bit-identical to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from tierstore.tools import flags


def run_depth(args: argparse.Namespace, depth: int | str, *, check: bool = False, extra: tuple[str, ...] = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-", dir=args.nvme_path) as d:
        out = os.path.join(d, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
               "-m", "tierstore.tools.fsdp_train", "--preset", args.preset, "--steps", str(args.steps),
               "--batch-size", str(args.batch_size), "--nvme-path", d, "--prefetch-depth", str(depth),
               "--json", out]
        if args.host_budget:
            cmd += ["--host-budget", args.host_budget]
        cmd += ["--optimizer-step", args.optimizer_step, *extra]
        if check:  # also trains FSDP2 alone first: the reference step time, and a bit-for-bit check
            cmd.append("--check")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, os.cpu_count() or 1)
                                                                                     // args.ranks)))
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if r.returncode != 0:
            raise SystemExit(f"depth {depth}: torchrun failed:\n{r.stdout}\n{r.stderr}")
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="large")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--depths", default="0,2,4")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is left out (default 4)")
    p.add_argument("--batch-size", type=int, default=4, help="images per rank per step (default 4)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--nvme-path", default=".")
    p.add_argument("--host-budget", help="per rank (default: a third of the rank's state)")
    flags.add_optimizer_step(p)
    p.add_argument("--micro-batches", metavar="N,M", help="compare these micro-batch counts, layer by layer and "
                   "as the loop, instead of prefetch depths (at the default depth)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step records the trace and is not counted)")
    if args.micro_batches:
        return micro_batches(args, [int(n) for n in args.micro_batches.split(",")])
    depths = [int(d) for d in args.depths.split(",")]
    if 0 not in depths:
        depths.insert(0, 0)
    samples: dict[int, list[dict]] = {d: [] for d in depths}
    meta: dict = {}
    reference: list[float] = []
    for r in range(args.rounds):
        for i, d in enumerate(depths if r % 2 == 0 else list(reversed(depths))):
            res = run_depth(args, d, check=i == 0)
            if i == 0 and not res["bit_identical"]:
                raise SystemExit(f"depth {d}: offloaded training differs from FSDP2 alone")
            reference.extend(res["reference_step_s"][1:])
            meta = {k: res[k] for k in ("params", "ranks", "backend", "host_budget_bytes")}
            samples[d].extend(res["steps"][1:])
    rows = {}
    for d in depths:
        rows[d] = {k: statistics.median(s[k] for s in samples[d])
                   for k in ("step_s", "stall_s", "read_bytes", "written_bytes")}
    base = rows[0]["step_s"]
    print(f"bench fsdp: ViT-{args.preset}, {meta['params'] / 1e6:.0f}M parameters, {meta['ranks']} ranks "
          f"({meta['backend']}), batch {args.batch_size} per rank, host budget "
          f"{meta['host_budget_bytes'] / 2**20:.0f} MiB per rank; optimizer "
          f"{args.optimizer_step.replace('-', ' ')}; medians of steps 2..{args.steps} x {args.rounds} run(s)")
    resident = statistics.median(reference)
    print(f"FSDP2 alone (no offload, same processes as each round's first run): {resident:.3f} s")
    print(f"{'depth':>5} {'step s':>8} {'stall s':>8} {'read MiB':>9} {'write MiB':>9} {'vs depth 0':>10} "
          f"{'/ FSDP2 alone':>13}")
    for d in depths:
        row = rows[d]
        row["speedup_vs_depth0"] = base / row["step_s"]
        row["vs_fsdp2_alone"] = row["step_s"] / resident
        print(f"{d:>5} {row['step_s']:>8.3f} {row['stall_s']:>8.3f} {row['read_bytes'] / 2**20:>9.1f} "
              f"{row['written_bytes'] / 2**20:>9.1f} {row['speedup_vs_depth0']:>9.2f}x {row['vs_fsdp2_alone']:>12.2f}x")
    result = {**meta, "preset": args.preset, "fsdp2_alone_step_s": resident,
              "depths": {str(d): rows[d] for d in depths}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


FIGURES = ("all_gather_bytes_per_rank", "reduce_scatter_bytes_per_rank", "read_bytes", "written_bytes", "step_s")


def micro_batches(args: argparse.Namespace, counts: list[int]) -> dict:
    """The step at each micro-batch count, layer by layer and as FSDP2's loop (see the module's docstring)."""
    if len(counts) < 2 or any(n < 1 or args.batch_size % n for n in counts):
        raise SystemExit(f"--micro-batches: two or more counts, each dividing --batch-size ({args.batch_size})")
    depth = "auto"
    rows: dict[str, dict[int, dict]] = {"layer-major": {}, "loop": {}}
    meta: dict = {}
    checked = run_depth(args, depth, check=True, extra=("--micro-batches", str(counts[-1]), "--layer-major"))
    if not checked["bit_identical"]:  # a run of its own: FSDP2 alone in the process would count in its peak RSS
        raise SystemExit(f"{counts[-1]} micro-batches layer by layer: differs from FSDP2's loop alone")
    for n in counts:
        for way in ("layer-major", "loop"):
            extra = ("--micro-batches", str(n)) + (("--layer-major",) if way == "layer-major" else ())
            res = run_depth(args, depth, extra=extra)
            if way == "layer-major" and any(r["layer_major_steps"] != args.steps for r in res["per_rank"]):
                raise SystemExit(f"{n} micro-batches: the step ran as the loop, not layer by layer")
            ranks = res["ranks"]
            row = {k: statistics.median(s[k] for s in res["steps"][1:]) for k in FIGURES}
            row["read_bytes"] /= ranks  # summed over ranks in the example's figures: per rank here
            row["written_bytes"] /= ranks
            row["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in res["per_rank"])
            rows[way][n] = row
            meta = {k: res[k] for k in ("params", "ranks", "backend", "host_budget_bytes")}
    lo, hi = counts[0], counts[-1]
    print(f"bench fsdp micro-batches: ViT-{args.preset}, {meta['params'] / 1e6:.1f}M parameters, {meta['ranks']} ranks "
          f"({meta['backend']}), batch {args.batch_size} per rank, host budget "
          f"{meta['host_budget_bytes'] / 2**20:.2f} MiB per rank; per rank and step, medians of steps 2..{args.steps}")
    print(f"{'way':>11} {'mbs':>4} {'all-gather MiB':>14} {'reduce-scatter MiB':>18} {'read MiB':>9} "
          f"{'write MiB':>9} {'step s':>7} {'peak RSS MiB':>12}")
    for way, by_n in rows.items():
        for n, r in by_n.items():
            print(f"{way:>11} {n:>4} {r['all_gather_bytes_per_rank'] / 2**20:>14.2f} "
                  f"{r['reduce_scatter_bytes_per_rank'] / 2**20:>18.2f} {r['read_bytes'] / 2**20:>9.1f} "
                  f"{r['written_bytes'] / 2**20:>9.1f} {r['step_s']:>7.3f} {r['peak_rss_bytes'] / 2**20:>12.0f}")
    ratios = {way: {k: by_n[hi][k] / by_n[lo][k] if by_n[lo][k] else None
                    for k in (*FIGURES, "peak_rss_bytes")} for way, by_n in rows.items()}
    loop_over = {k: rows["loop"][hi][k] / rows["layer-major"][hi][k] if rows["layer-major"][hi][k] else None
                 for k in (*FIGURES, "peak_rss_bytes")}

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    for way in rows:
        print(f"{way} {hi} over {lo} micro-batches: all-gather {fmt(ratios[way]['all_gather_bytes_per_rank'])}, "
              f"reduce-scatter {fmt(ratios[way]['reduce_scatter_bytes_per_rank'])}, drive read "
              f"{fmt(ratios[way]['read_bytes'])}, written {fmt(ratios[way]['written_bytes'])}, step "
              f"{fmt(ratios[way]['step_s'])}, peak RSS {fmt(ratios[way]['peak_rss_bytes'])}")
    print(f"the loop over layer by layer at {hi} micro-batches: all-gather "
          f"{fmt(loop_over['all_gather_bytes_per_rank'])}, drive read {fmt(loop_over['read_bytes'])}, step "
          f"{fmt(loop_over['step_s'])}, peak RSS {fmt(loop_over['peak_rss_bytes'])}")
    result = {**meta, "preset": args.preset, "micro_batches": {way: {str(n): r for n, r in by_n.items()}
                                                               for way, by_n in rows.items()},
              "ratio": ratios, "loop_over_layer_major": loop_over}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
