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

With ``--preset`` the model is a Llama of transformers (``LlamaConfig``, built on meta, bf16 weights computed in
bf16 or in fp32, whichever multiplies faster on this CPU, measured (``--compute``: see tierstore/tools/upcast.py)) trained on one repeated batch of token ids, with the optimizer state layout
``--moments``/``--master-weights`` (8-bit moments and split masters by default; see [Note: Compressed optimizer state]):

    python perf/bench_capacity.py --preset llama-7b --steps 3 --nvme-path DIR --json OUT

It prints the bytes on the drive per parameter (the most the drive held at once), the bytes moved per step, the
drive's mixed read+write rate measured in the same process after training, and each step's share of that rate;
the JSON holds ``params``, ``drive_bytes``, ``peak_rss_bytes`` (the whole process, construction included),
``step_seconds``, ``losses``, ``bytes_moved`` (per step) and ``drive_mixed_gbps``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from tierstore.tools.upcast import COMPUTE_CHOICES, choice_text

MIB = 1024**2
# Llama shapes: (hidden, layers, heads, intermediate, vocab), the host budget they run under by default
LLAMA = {
    "llama-7b": ((4096, 32, 32, 11008, 32000), "1536MiB"),
    "llama-3b": ((3200, 26, 32, 8640, 32000), "1GiB"),
    "llama-1b": ((2048, 16, 16, 5504, 32000), "512MiB"),
    "llama-tiny": ((256, 2, 4, 704, 4096), "32MiB"),
}
# The allocator, thread stacks, torch's kernels' first buffers, autograd's bookkeeping: measured 50-65 MiB here in
# every mode, at 2.6M and 10.5M parameters alike.
OVERHEAD_BYTES = 96 * MIB


def _train_step(model, opt, mode: str, loss_of, batch_size: int) -> list[float]:
    """One optimizer step in ``mode`` (2 micro-batches and clipping for "accumulate"); ``loss_of(rows)`` is the
    loss of a slice of the batch. Returns each micro-batch's loss."""
    import torch

    micro = 2 if mode == "accumulate" else 1
    losses = []
    for i in range(micro):
        loss = loss_of(slice(i * batch_size // micro, (i + 1) * batch_size // micro)) / micro
        loss.backward()
        losses.append(loss.item() * micro)
    if mode == "accumulate":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return losses


def _llama_child(args: argparse.Namespace) -> dict:
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import tierstore as ts
    from tierstore.integrations import OffloadedAdamW, offload_model
    from tierstore.tools.bench_drive import measure_drive
    from tierstore.tools.rss import peak_rss_bytes, reset_peak_rss, rss_bytes
    from tierstore.tools.upcast import compute_in_fp32, resolve_compute

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    compute, product_s = resolve_compute(args.compute, torch.bfloat16)
    (hidden, layers, heads, inter, vocab), default_host = LLAMA[args.preset]
    host = ts.parse_bytes(args.host_budget or default_host, name="--host-budget")
    baseline = rss_bytes()
    if not reset_peak_rss():
        baseline = 0
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, intermediate_size=inter, vocab_size=vocab,
                         tie_word_embeddings=False, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    ids = torch.randint(0, vocab, (args.batch_size, args.tokens), generator=torch.Generator().manual_seed(0))
    with ts.TierStore(nvme_path=args.nvme_path, host_budget_bytes=host, device_budget_bytes="1MiB") as store:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device("meta"):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        if compute == "fp32":
            compute_in_fp32(model)
        off = offload_model(model, store, units=[LlamaDecoderLayer], init_fn=model._init_weights)
        params = sum(p.numel() for p in model.parameters())
        opt = OffloadedAdamW(off, lr=args.lr, step_in_backward=args.mode == "in-backward", moments=args.moments,
                             master=args.master)
        built_s = time.perf_counter() - t0
        losses, steps_s, moved = [], [], []
        for _ in range(args.steps):
            before = store.stats_dict()
            t0 = time.perf_counter()
            losses += _train_step(model, opt, args.mode, lambda rows: model(input_ids=ids[rows], labels=ids[rows]).loss,
                                  args.batch_size)
            opt.wait()  # the step's write-behind belongs to it
            steps_s.append(time.perf_counter() - t0)
            after = store.stats_dict()
            moved.append({k: after[k] - before[k] for k in ("bytes_read_nvme", "bytes_written_nvme")})
        opt.close()
        drive_bytes = store.memory()["nvme"]["peak_bytes"]
        peak = peak_rss_bytes()
        off.remove(keep_values=False)  # its values are not kept: nothing to read back at close
    share = moved[-1]["bytes_read_nvme"] / max(1, moved[-1]["bytes_read_nvme"] + moved[-1]["bytes_written_nvme"])
    drive = measure_drive(args.nvme_path, size_mib=args.drive_mib, read_fraction=round(share, 2))
    return {"preset": args.preset, "mode": args.mode, "moments": args.moments, "master": args.master,
            "compute": "fp32" if compute == "fp32" else "bf16", "product_seconds": product_s,
            "params": params, "host_budget_bytes": host, "drive_bytes": drive_bytes, "peak_rss_bytes": peak,
            "peak_rss_above_baseline": peak - baseline, "build_s": built_s, "step_seconds": steps_s,
            "losses": losses, "bytes_moved": moved, "drive_mixed_gbps": drive["mixed_gbps"],
            "drive_read_gbps": drive["read_gbps"], "drive_write_gbps": drive["write_gbps"]}


def _print_llama(results: list[dict]) -> None:
    for r in results:
        last = r["bytes_moved"][-1]
        step = r["step_seconds"][-1]
        total = last["bytes_read_nvme"] + last["bytes_written_nvme"]
        rate = total / step / 1e9
        chose = choice_text(r["product_seconds"], "bf16")
        print(f"{r['preset']} ({r['params'] / 1e9:.2f}B parameters, bf16 weights computed in {r['compute']}{chose}), "
              f"mode "
              f"{r['mode']}, moments={r['moments']}, master={r['master']}, host budget "
              f"{r['host_budget_bytes'] / MIB:.0f} MiB")
        print(f"  drive: {r['drive_bytes'] / 1e9:.1f} GB at most = {r['drive_bytes'] / r['params']:.2f} B/param; "
              f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB (whole process, construction included)")
        print(f"  steps: {' '.join(f'{s:.1f}' for s in r['step_seconds'])} s; losses "
              f"{' '.join(f'{x:.4f}' for x in r['losses'])}; built in {r['build_s']:.0f} s")
        print(f"  last step moved {last['bytes_read_nvme'] / 1e9:.1f} GB read + {last['bytes_written_nvme'] / 1e9:.1f} "
              f"GB written = {total / r['params']:.1f} B/param, at {rate:.2f} GB/s; the drive's mixed rate "
              f"(measured after, in the same process) {r['drive_mixed_gbps']:.2f} GB/s (read "
              f"{r['drive_read_gbps']:.2f}, write {r['drive_write_gbps']:.2f}): the step ran at "
              f"{rate / r['drive_mixed_gbps']:.2f}x of it")


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
        losses, steps_s = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            losses += _train_step(model, opt, args.mode, lambda rows: F.mse_loss(model(batch[rows]), target[rows]),
                                  args.batch_size)
            steps_s.append(time.perf_counter() - t0)
        opt.close()
        stats = store.stats_dict()
        off.remove(keep_values=False)  # its values are not kept: nothing to read back at close
    peak = peak_rss_bytes() - baseline
    activations = 2 * args.layers * args.batch_size * args.width * 4 * 2  # outputs and GELU inputs, with grads
    in_flight = 4 * (args.width * args.width + args.width)  # the gradient autograd makes before the store sees it
    backlog = opt.max_grad_backlog_bytes if args.mode == "in-backward" else 0
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
    p.add_argument("--preset", choices=sorted(LLAMA), help="a Llama of transformers instead of the Linear stack")
    p.add_argument("--moments", default=None, help="optimizer moments: fp32, bf16, 8bit (default: 8bit with "
                                                   "--preset, else fp32)")
    p.add_argument("--master-weights", dest="master", default=None,
                   help="masters of bf16 weights: fp32, split, none (default: split with --preset)")
    p.add_argument("--compute", default="auto", choices=COMPUTE_CHOICES,
                   help="--preset: compute the bf16 weights in bf16 (param) or in fp32; auto (the default) times "
                   "both on one small layer and keeps the faster")
    p.add_argument("--tokens", type=int, default=8, help="tokens per sequence (--preset)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW's learning rate (--preset; default 1e-5: at 1e-4 "
                   "the 7B model's loss on its repeated batch fell from 11.3 to 1.6 in one step, then rose)")
    p.add_argument("--drive-mib", type=int, default=2048, help="MiB the drive measurement moves (--preset)")
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
    if args.preset:
        args.moments = args.moments or "8bit"
        args.master = args.master or "split"
        if args.modes == ",".join(MODES):
            args.modes = "in-backward"  # kept gradients would take 4 more bytes a parameter on the drive
        if args.batch_size == 8:
            args.batch_size = 1
    if args.child:
        print(json.dumps(_llama_child(args) if args.preset else _child(args)))
        return {}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: {', '.join(bad) or 'none given'}; choose from {', '.join(MODES)}")
    if "accumulate" in modes and args.batch_size < 2:
        p.error(f"--modes accumulate splits each batch into 2 micro-batches: give --batch-size 2 or more (it is "
                f"{args.batch_size})")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-capacity-", dir=args.nvme_path or "/var/tmp") as d:
        load = ["--load", _write_pretrained(args, d)] if args.pretrained else []
        for mode in modes:
            preset = ["--preset", args.preset, "--moments", args.moments, "--master-weights", args.master, "--compute",
                      args.compute, "--tokens",
                      str(args.tokens), "--drive-mib", str(args.drive_mib), "--lr", str(args.lr)] if args.preset else []
            cmd = [sys.executable, os.path.abspath(__file__), "--child", *preset, "--mode", mode, "--layers",
                   str(args.layers),
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
    if args.preset:
        _print_llama(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return {"results": results, **results[0]}
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
