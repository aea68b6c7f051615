"""The `tierstore` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tierstore import StoreConfig, TierStoreError, TierValueError, __version__, default_nvme_path, parse_bytes

from . import flags as F
from .upcast import COMPUTE_CHOICES

def _add_drive(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drive", help="the store's NVMe reads and writes against fio on the same drive")
    F.add_nvme_path(p)
    p.add_argument("--size-mib", type=int, default=8192,
                   help="MiB written then read per round (default 8192: a smaller file does not measure the drive)")
    p.add_argument("--tensor-mib", type=int, default=64, help="size of each tensor moved (default 64)")
    d = StoreConfig
    p.add_argument("--block-size", default=str(d.block_size_bytes),
                   help=f"I/O block size for both (default the store's, {d.block_size_bytes // 1024**2}MiB)")
    p.add_argument("--queue-depth", type=int, default=d.queue_depth,
                   help=f"store blocks in flight (default {d.queue_depth})")
    p.add_argument("--io-threads", type=int, default=d.io_threads, help=f"store I/O threads (default {d.io_threads})")
    p.add_argument("--fio-iodepth", type=int, default=32, help="fio libaio iodepth (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported (default 3)")
    p.add_argument("--integrity", action="store_true", help="also measure with checksums on and report the cost")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")


# bench step's flags each of its modes uses (any other given is an error: see flags.refuse_ignored)
_STEP_COMMON = {"cmd", "bench", "command_parser", "preset", "batch_size", "rounds", "nvme_path", "device_budget",
                "json"}
_STEP_MODES = {
    "--compile": _STEP_COMMON | {"compile", "host_budget"},
    "--budget-sweep": _STEP_COMMON | {"budget_sweep", "depths", "optimizer_step", "dtype", "fused", "plot"},
}


def build_parser() -> argparse.ArgumentParser:
    """The `tierstore` command line (its vocabulary: tierstore/tools/flags.py, docs/cli.md)."""
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tierstore {__version__}")
    cmds = parser.add_subparsers(dest="cmd", required=True)
    gc = cmds.add_parser("gc", help="remove swap directories left under the nvme path by stores whose process is "
                                    "gone")
    gc.add_argument("path", nargs="?", help="the nvme_path the stores used (the same as --nvme-path)")
    F.add_nvme_path(gc)
    bench = cmds.add_parser("bench", help="benchmarks that print ours, the reference and their ratio")
    bsub = bench.add_subparsers(dest="bench", required=True)
    _add_drive(bsub)
    step = bsub.add_parser("step", help="offloaded step time at several prefetch depths vs resident and the bound")
    step.add_argument("--preset", default="small", help="ViT size (default small)")
    step.add_argument("--batch-size", type=int, default=32, help="images a step (default 32)")
    step.add_argument("--depths", type=_depths, default="0,1,2,4,8,auto",
                      help="the prefetch depths compared, numbers or 'auto' (default 0,1,2,4,8,auto)")
    step.add_argument("--placement-ab", action="store_true",
                      help="also run the deepest numeric depth without a placement (alternating, same run)")
    step.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported (default 3)")
    F.add_nvme_path(step)
    F.add_budgets(step)
    F.add_dtype(step, choices=("fp32", "bf16"),
                help="the weights' dtype: fp32, or bf16 with fp32 masters (the resident reference too; default fp32)")
    step.add_argument("--budget-sweep", metavar="K,K,...",
                      help="instead: run at host budgets of state/K for each K (e.g. 2,3,6,10) and print step time "
                           "and bytes per step against the bound for each")
    step.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    step.add_argument("--plot", metavar="FILE.png", help="plot step time and drive GB/s against depth (matplotlib)")
    F.add_optimizer_step(step)
    step.add_argument("--fused", action="store_true",
                      help="torch's fused AdamW kernel (fused=True) on both sides, resident and offloaded, instead "
                           "of its CPU default")
    step.add_argument("--layouts", metavar="MOMENTS/MASTER,...",
                      help="the optimizer state layouts compared: also run these at the last depth, in the same "
                           "rounds (e.g. 8bit/split,bf16/fp32; see the optimizer's docs)")
    step.add_argument("--trace", metavar="FILE", help="write a Chrome trace (Perfetto) of one step at the deepest depth")
    step.add_argument("--compile", action="store_true",
                      help="instead: compiled and eager, resident and offloaded, in one run (each ViT block "
                           "compiled in place; depth auto)")
    step.add_argument("--no-rss", action="store_true",
                      help="skip the peak-RSS check (a fresh process training a few steps at the deepest depth)")
    step.set_defaults(command_parser=step)
    peers = bsub.add_parser("peers", help="cold inference forward, weights on disk: tierstore vs Accelerate's "
                            "disk_offload vs in-memory")
    F.add_nvme_path(peers)
    peers.add_argument("--layers", type=int, default=24, help="Linear layers in the stack (default 24)")
    peers.add_argument("--width", type=int, default=4096, help="features per layer (default 4096)")
    peers.add_argument("--batch-size", type=int, default=8, help="rows a forward (default 8)")
    peers.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported (default 3)")
    why = "; one cold forward has no step to choose a depth from"
    F.add_prefetch_depth(peers, default=4, why=why)
    F.add_budgets(peers, host_default="the prefetch window and 2 layers, as Accelerate's disk offload holds",
                  device_default="2 layers")
    peers.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    demo = cmds.add_parser("demo", help="train a ViT with parameters and AdamW state offloaded to NVMe")
    demo.add_argument("--preset", default="small", help="model size: tiny, small, base, large, 1b, 3b (default small)")
    F.add_dtype(demo, choices=("fp32", "bf16"), help="the weights' dtype: fp32, or bf16 with masters (default fp32)")
    F.add_layout(demo)
    demo.add_argument("--compute", default="auto", choices=COMPUTE_CHOICES,
                      help="compute bf16 weights in their own dtype (param) or in fp32 (cast up in each Linear and "
                      "LayerNorm: for CPUs whose bf16 matrix product is slow); auto, the default, times both on one "
                      "small layer and keeps the faster")
    demo.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    demo.add_argument("--batch-size", type=int, default=32, help="images a step (default 32)")
    F.add_nvme_path(demo)
    F.add_prefetch_depth(demo)
    demo.add_argument("--lr", type=float, help="peak AdamW learning rate, reached after a warm-up over the first "
                      "half of the steps (default by preset: tiny/small 1e-3, base 1e-4, large 3e-5, 1b 1e-5, 3b 5e-6)")
    F.add_budgets(demo)
    demo.add_argument("--json", metavar="FILE", help="write per-step figures as JSON")
    demo.add_argument("--measure-drive", type=int, default=0, metavar="MIB",
                      help="measure the drive's mixed read+write rate with the store before the first step and "
                      "after each (moving MIB MiB each time, 2048 say, outside the steps' time) and print each "
                      "step's share of the two around it (default: not)")
    F.add_optimizer_step(demo)
    plan = cmds.add_parser("plan", help="ZeRO-3 memory per rank and tier, and the bytes each step moves")
    what = plan.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="parameter count: 7e9, 7B, 350M, 1.5b")
    what.add_argument("--preset", help="a ViT preset: tiny, small, base, large, 1b")
    what.add_argument("--hf-config", help="a transformers config.json (or its directory): parameters counted "
                      "exactly, embeddings and tied weights included")
    plan.add_argument("--ranks", type=int, default=1, help="data-parallel ranks sharding the model (default 1)")
    F.add_dtype(plan, default=None, help="the weights' dtype (default: the --hf-config's, else fp32)")
    F.add_layout(plan)
    F.add_optimizer_step(plan)
    F.add_nvme_path(plan, help="the drive's directory: its free space is checked (and, with --measure, its rate "
                    "measured) there (default: where a store would put its swap files)")
    plan.add_argument("--drive-gbps", type=float, help="the drive's mixed read+write rate, for the predicted step")
    plan.add_argument("--tflops", type=float, help="compute rate, for the predicted step")
    plan.add_argument("--tokens", type=int, help="tokens (or, with --preset, images) a step computes, per rank "
                      "(default: 2048 tokens; 32 images)")
    plan.add_argument("--device", choices=("cuda", "cpu"), default=None,
                      help="what computes forward and backward (default: cuda when this machine has it, else cpu)")
    plan.add_argument("--ram", help="the machine's RAM, to plan for another machine (default: this one's)")
    plan.add_argument("--link-gbps", type=float, help="host<->device copies from pinned memory, GB/s, for the "
                      "predicted step on a device (measured by --measure where there is one)")
    plan.add_argument("--update-ns", type=float, help="OffloadedAdamW's CPU update, ns a parameter, for the "
                      "predicted step (measured by --measure)")
    plan.add_argument("--tensor-ms", type=float, help="the offload's own work per parameter tensor and step, in ms, "
                      "for the predicted step (measured by --measure)")
    plan.add_argument("--measure", action="store_true",
                      help="measure what is not given, under the allocator setting a store makes: the drive's rate "
                      "at --nvme-path (a few seconds), the compute (with --preset, one resident step of the model; "
                      "else a matrix product's rate) and the offload's own work per tensor (ViT-tiny offloaded "
                      "at --nvme-path against resident, a few seconds)")
    plan.add_argument("--optimizer", default="adamw", help="adamw, sgd or none (default adamw)")
    F.add_budgets(plan, per_rank=True)
    plan.add_argument("--nvme-budget", help="NVMe budget per rank (default unlimited)")
    plan.add_argument("--layers", type=int, help="equal blocks the placement is planned over (default: the "
                      "config's or the preset's depth; with --params, estimated from the count)")
    plan.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cmd == "gc":
            from tierstore.swap import describe, reclaim_swap

            if args.path and args.nvme_path and args.path != args.nvme_path:
                raise TierValueError(f"two paths given ({args.path!r} and --nvme-path {args.nvme_path!r}): give one")
            path = args.path or F.nvme_path(args)
            if not os.path.isdir(path):
                raise TierValueError(f"{path!r} is not a directory")
            reclaimed = reclaim_swap(path)
            print(f"{path}: {describe(reclaimed)}" if reclaimed else f"{path}: nothing to reclaim")
            return 0
        if args.cmd == "plan":
            from .plan import PlanConfig, format_plan, make_plan

            result = make_plan(PlanConfig(**_plan_inputs(args)))
            print(format_plan(result))
            _write_json(args.json, result)
            return 0
        if args.cmd == "demo":
            from .demo import run_demo

            result = run_demo(
                preset=args.preset, steps=args.steps, batch_size=args.batch_size, nvme_path=F.nvme_path(args),
                prefetch_depth=args.prefetch_depth, step_in_backward=args.optimizer_step == "in-backward", lr=args.lr,
                dtype=args.dtype, moments=args.moments, master=args.master, compute=args.compute,
                measure_drive_mib=args.measure_drive, **_budgets(args))
            _write_json(args.json, result)
            return 0
        if args.cmd == "bench" and args.bench == "step":
            from .bench_step import check_plotting, run_step_bench

            if args.plot:
                check_plotting()

            for flag, used in _STEP_MODES.items():
                if getattr(args, flag[2:].replace("-", "_")):
                    F.refuse_ignored(args.command_parser, args, flag, used)
            if args.compile:
                from .bench_compile import run_compile_bench

                result = run_compile_bench(preset=args.preset, batch_size=args.batch_size, rounds=args.rounds,
                                           nvme_path=F.nvme_path(args), **_budgets(args))
                _write_json(args.json, result)
                return 0
            if args.budget_sweep:
                from .bench_step import plot_budget_sweep, run_budget_sweep

                result = run_budget_sweep(
                    preset=args.preset, batch_size=args.batch_size, rounds=args.rounds, nvme_path=F.nvme_path(args),
                    depths=args.depths, step_in_backward=args.optimizer_step == "in-backward",
                    divisors=[int(k) for k in args.budget_sweep.split(",")], dtype=args.dtype, fused=args.fused,
                    device_budget_bytes=_budgets(args)["device_budget_bytes"])
                _write_json(args.json, result)
                if args.plot:
                    plot_budget_sweep(result, args.plot)
                    print(f"plot written to {args.plot}")
                return 0
            result = run_step_bench(
                preset=args.preset, batch_size=args.batch_size, rounds=args.rounds, nvme_path=F.nvme_path(args),
                depths=args.depths, trace_path=args.trace, placement_ab=args.placement_ab,
                step_in_backward=args.optimizer_step == "in-backward", rss=not args.no_rss, dtype=args.dtype,
                fused=args.fused, layouts=_layouts(args.layouts), **_budgets(args))
            _write_json(args.json, result)
            if args.plot:
                from .bench_step import plot_step_bench

                plot_step_bench(result, args.plot)
                print(f"plot written to {args.plot}")
            return 0
        if args.cmd == "bench" and args.bench == "peers":
            from .bench_peers import run_peers_bench

            result = run_peers_bench(path=F.nvme_path(args), layers=args.layers, width=args.width,
                                     batch_size=args.batch_size, rounds=args.rounds,
                                     prefetch_depth=args.prefetch_depth, **_budgets(args))
            _write_json(args.json, result)
            return 0
        if args.cmd == "bench" and args.bench == "drive":
            from .bench_drive import DriveBenchConfig, run_drive_bench

            cfg = DriveBenchConfig(
                path=F.nvme_path(args), size_mib=args.size_mib, tensor_mib=args.tensor_mib,
                block_size_bytes=parse_bytes(args.block_size, name="--block-size"),
                queue_depth=args.queue_depth, io_threads=args.io_threads, fio_iodepth=args.fio_iodepth,
                rounds=args.rounds, integrity=args.integrity)
            result = run_drive_bench(cfg)
            _write_json(args.json, result)
            return 0
    except (ValueError, TierStoreError) as e:
        print(f"tierstore: error: {e}", file=sys.stderr)
        return 2
    parser.error("unknown command")
    return 2


def _layouts(text: str | None) -> list[str]:
    """'8bit/split,bf16' -> ['8bit/split', 'bf16/fp32'], each checked."""
    from tierstore.integrations.layouts import StateLayout

    out = []
    for part in (text or "").split(","):
        if part.strip():
            moments, _, master = part.strip().partition("/")
            layout = StateLayout(moments, master or "fp32")
            out.append(f"{layout.moments}/{layout.master}")
    return out


def _depths(text: str) -> list[int | str]:
    """'0,2,auto' -> [0, 2, 'auto']."""
    return [F.depth(part) for part in text.split(",")]


def _count(text: str) -> int:
    """A parameter count: a number (7e9, 7000000000) or one with a K/M/B/T suffix (7B, 350M, 1.5b)."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(text.strip()[-1:].lower())
    try:
        value = float(text.strip()[:-1]) * scale if scale else float(text)
    except ValueError:
        raise TierValueError(f"--params {text!r}: give a count such as 7e9, 7B or 350M") from None
    if not value >= 1 or value != value:
        raise TierValueError(f"--params {text!r} must be at least 1")
    return int(value)


def _preset_params(preset: str) -> int:
    import torch

    from .vit import PRESETS, ViT, num_params

    if preset not in PRESETS:
        raise TierValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    with torch.device("meta"):
        return num_params(ViT(PRESETS[preset]))


def _plan_inputs(args: argparse.Namespace) -> dict:
    """PlanConfig's keywords from `tierstore plan`'s arguments, measuring what --measure asks for."""
    import torch

    from .plan import (DTYPE_BYTES, UNITS, estimated_layers, hf_model_size, measure_compute_tflops,
                       measure_link_gbps, measure_tensor_seconds, measure_update_seconds, training_state_bytes)

    source, named_dtype = None, None
    if args.hf_config is not None:
        shape = hf_model_size(args.hf_config)
        params, tensors, layers, hidden, source, named_dtype = (shape.params, shape.tensors, shape.layers,
                                                                shape.hidden, shape.source, shape.dtype)
    elif args.params is not None:
        params = _count(args.params)
        layers = args.layers or estimated_layers(params)
        if args.layers is None:
            source = f"{layers} layers estimated from the count: --layers sets them"
        tensors = 9 * layers + 3  # as a Llama's: 9 a decoder layer, the embedding, the last norm, the head
        hidden = int((params / (12 * layers)) ** 0.5)
    else:
        params, layers = _preset_params(args.preset), _preset_depth(args.preset)
        tensors, hidden = _preset_tensors(args.preset), _preset_width(args.preset)
    dtype = args.dtype or named_dtype or "fp32"
    cuda = args.device == "cuda" if args.device else torch.cuda.is_available()
    if args.measure and cuda and not torch.cuda.is_available():
        raise TierValueError("--device cuda --measure: this machine has no CUDA device to measure; give --tflops, "
                             "--link-gbps and --update-ns instead")
    layers = args.layers or layers
    budgets = {f"{t}_budget_bytes": parse_bytes(v, name=f"--{t}-budget") if v else None
               for t, v in (("device", args.device_budget), ("host", args.host_budget), ("nvme", args.nvme_budget))}
    # the defaults every command has (tierstore/tools/flags.py); 0 is none
    if args.host_budget is None:
        budgets["host_budget_bytes"] = training_state_bytes(params, dtype, args.optimizer, args.moments,
                                                            args.master) // args.ranks // 3
    if args.device_budget is None and cuda:
        budgets["device_budget_bytes"] = params * DTYPE_BYTES[dtype] // args.ranks // 4
    typed = [v for v in (args.host_budget, args.device_budget, args.nvme_budget) if v]
    unit = next((u for v in typed for u in sorted(UNITS, key=len, reverse=True)
                 if v.strip().lower().endswith(u.lower())), "GB")
    in_backward = args.optimizer_step == "in-backward"
    if args.measure:  # what is measured runs as it will beside a store: under the allocator setting it makes
        from tierstore.memory import set_mmap_threshold

        if (threshold := StoreConfig().malloc_mmap_threshold_bytes) is not None:
            set_mmap_threshold(threshold)
        if args.nvme_path is None and (args.drive_gbps is None or args.tensor_ms is None):
            raise TierValueError("--measure measures the drive and the offload at --nvme-path: give it (or give "
                                 "--drive-gbps and --tensor-ms)")
    drive = args.drive_gbps
    if drive is None and args.measure:
        from .bench_drive import measure_drive

        drive = measure_drive(args.nvme_path, size_mib=256, read_fraction=0.5)["mixed_gbps"]
    tensor_seconds = args.tensor_ms / 1e3 if args.tensor_ms is not None else None
    if tensor_seconds is None and args.measure:
        tensor_seconds = measure_tensor_seconds(args.nvme_path, in_backward)
    compute, device_name = None, None
    per_rank_tokens = args.tokens * (_preset_tokens(args.preset) if args.preset else 1) if args.tokens else (
        32 * _preset_tokens(args.preset) if args.preset else 2048)
    if args.preset is not None and args.tflops is None and args.measure:
        compute, device_name = _measured_preset_step(args.preset, dtype, args.tokens or 32)
    elif args.tflops is not None or args.measure:
        tflops, device_name = ((args.tflops, None) if args.tflops is not None else measure_compute_tflops(dtype))
        compute = 6 * params * per_rank_tokens / (tflops * 1e12)  # forward 2, backward 4 FLOPs a parameter, token
    # The optimizer's CPU update: a measured resident step of a preset on the CPU has torch's AdamW in it already.
    update = args.update_ns * 1e-9 * params / args.ranks if args.update_ns is not None else None
    if update is None and args.measure and args.optimizer == "adamw" and (args.preset is None or cuda):
        update = measure_update_seconds(dtype, args.moments, args.master) * params / args.ranks
    link = args.link_gbps if args.link_gbps is not None else (measure_link_gbps() if args.measure else None)
    return {"params": params, "ranks": args.ranks, "dtype": dtype, "optimizer": args.optimizer,
            "layers": layers, "moments": args.moments, "master": args.master, "step_in_backward": in_backward,
            "nvme_path": args.nvme_path, "drive_gbps": drive, "compute_seconds": compute, "tensors": tensors,
            "tensor_seconds": tensor_seconds, "unit": unit, "source": source, "tokens": per_rank_tokens,
            "hidden": hidden, "compute_device": "cuda" if cuda else "cpu", "device_name": device_name,
            "link_gbps": link, "update_seconds": update,
            "ram_bytes": parse_bytes(args.ram, name="--ram") if args.ram else None, **budgets}


def _preset_tokens(preset: str) -> int:
    from .vit import PRESETS

    cfg = PRESETS[preset]
    return (cfg.image_size // cfg.patch_size) ** 2 + 1


def _measured_preset_step(preset: str, dtype: str, batch_size: int) -> tuple[float, str]:
    """One resident training step (forward, backward and torch's AdamW: on a CPU the offloaded optimizer's
    arithmetic shares the cores with the compute) of the preset's ViT at ``batch_size`` on the device that will
    compute (CUDA's when there is one): the median of 3, after 2; and that device's name."""
    import torch

    from .plan import median_step_seconds
    from .vit import PRESETS, SyntheticImages, ViT

    t = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model = ViT(PRESETS[preset]).to(device=device, dtype=t)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    seconds = median_step_seconds(model, opt, SyntheticImages(PRESETS[preset]), batch_size, warmup=2, steps=3,
                                  dtype=t, device=device)
    return seconds, torch.cuda.get_device_name() if cuda else f"the CPU ({os.cpu_count()} cores)"


def _preset_tensors(preset: str) -> int:
    import torch

    from .vit import PRESETS, ViT

    with torch.device("meta"):
        return len(list(ViT(PRESETS[preset]).parameters()))


def _preset_width(preset: str) -> int:
    from .vit import PRESETS

    return PRESETS[preset].dim


def _preset_depth(preset: str) -> int:
    from .vit import PRESETS

    return PRESETS[preset].depth if preset in PRESETS else 24  # an unknown one is refused by _preset_params


def _budgets(args: argparse.Namespace) -> dict[str, int | None]:
    """--host-budget / --device-budget as byte counts (None: the command's default)."""
    return {"host_budget_bytes": parse_bytes(args.host_budget, name="--host-budget") if args.host_budget else None,
            "device_budget_bytes": (parse_bytes(args.device_budget, name="--device-budget")
                                    if args.device_budget else None)}


def _write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)
            f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
