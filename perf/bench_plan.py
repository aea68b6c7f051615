"""The plan's predicted step against a measured one, in the same run.

    python perf/bench_plan.py --preset small --nvme-path DIR [--optimizer-step after-backward]

``tierstore plan --measure`` predicts an offloaded step from the drive's mixed rate, a resident step and the
offload's own work per tensor, all measured here (see [Note: The offload's own work]); ``tierstore bench step``
then trains the same ViT offloaded at the same host budget (a third of its state unless given) and reports its
median step. Printed: the predicted step (ours), the measured step (the reference) and their ratio, for each of
``--rounds`` pairs (this machine's rates swing for minutes at a time, so one pair proves little).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile


def main(argv: list[str] | None = None) -> dict:
    from tierstore.tools import bench_step, flags
    from tierstore.tools.cli import main as cli
    from tierstore.tools.vit import PRESETS, ViT, num_params

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--batch-size", type=int, default=32, help="images a step (default 32)")
    p.add_argument("--host-budget", type=int, default=None, help="bytes (default: a third of the fp32 state)")
    flags.add_optimizer_step(p)
    p.add_argument("--rounds", type=int, default=2, help="predicted/measured pairs (default 2)")
    p.add_argument("--nvme-path", required=True, help="directory on the drive for the swap files")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    host = args.host_budget or num_params(ViT(PRESETS[args.preset])) * 12 // 3
    pairs = []
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as scratch:
        out = os.path.join(scratch, "plan.json")
        for _ in range(args.rounds):
            rc = cli(["plan", "--preset", args.preset, "--dtype", "fp32", "--host-budget", str(host), "--tokens",
                      str(args.batch_size), "--nvme-path", scratch, "--measure", "--optimizer-step",
                      args.optimizer_step, "--json", out])
            if rc:
                raise RuntimeError(f"tierstore plan failed ({rc})")
            with open(out) as f:
                predicted = json.load(f)["predicted_step"]
            bench = bench_step.run_step_bench(
                preset=args.preset, batch_size=args.batch_size, depths=["auto"], nvme_path=scratch, rounds=2,
                host_budget_bytes=host, device_budget_bytes=None, rss=False,
                step_in_backward=args.optimizer_step == "in-backward", log=lambda *a: None)
            pairs.append({"predicted_s": predicted["seconds"], "measured_s": bench["depths"]["auto"]["step_s"],
                          "offload_s": predicted["offload_seconds"], "tensors": predicted["tensors"]})
    print(f"ViT-{args.preset}, batch {args.batch_size}, host budget {host / 2**20:.1f} MiB, "
          f"optimizer {args.optimizer_step}")
    print(f"{'round':<7}{'predicted s (ours)':>19}{'measured s (the reference)':>28}{'ratio':>7}")
    for i, r in enumerate(pairs):
        r["ratio"] = r["predicted_s"] / r["measured_s"]
        print(f"{i:<7}{r['predicted_s']:>19.3f}{r['measured_s']:>28.3f}{r['ratio']:>7.2f}")
    res = {"preset": args.preset, "batch_size": args.batch_size, "host_budget_bytes": host,
           "optimizer_step": args.optimizer_step,
           "pairs": pairs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
