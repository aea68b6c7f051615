"""Bytes, time, stall and peak RSS of a step against its micro-batches and its sequence length: the loop (one
micro-batch after another) against the layer-major step (``off.accumulate``; see [Note: A layer-major step]).

    python perf/bench_layer_major.py --preset llama-150m --nvme-path DIR [--micro-batches 1,2,4,8,16]
        [--tokens-sweep 256,1024,4096] [--plot OUT.png] [--json OUT]
    python perf/bench_layer_major.py --vit large --host-budget 256MiB --micro-batches 2,8 --nvme-path DIR
    python perf/bench_layer_major.py --preset llama-0.5b --tied --micro-batches 2,8 --tokens 128 --nvme-path DIR

Each run is a fresh process training an offloaded Llama built on meta (bf16, 8-bit moments, split masters,
clipping to norm 1, the optimizer after backward) in a plain PyTorch loop for ``--steps`` steps; the last step's
drive bytes, time and stall are reported, with the process's peak RSS. The two loops alternate, run by run, at
each size. Printed: each run, and per size the layer-major figure, the loop's (the reference) and their ratio;
then bytes a step at the most micro-batches against those at the fewest, for each loop.

With ``--vit PRESET`` the model is the demo's ViT of that preset instead (as timm writes one: its class token and
position embedding are parameters of the model itself, held across the blocks: see [Note: Parameters held around the
segments]), built in memory and cast to bf16, trained on the demo's synthetic images, ``--batch-size`` images a
micro-batch; ``--tokens`` does not apply. With ``--tied`` the Llama's head is its embedding (``tie_word_embeddings``,
as Llama-3.2, Qwen2.5 and Gemma have it; see [Note: Tied parameters layer by layer]). With ``--t5 PRESET`` the
model is a T5 v1.1 encoder-decoder (gated GELU, its embedding shared by both stacks, the head apart) built on meta,
its blocks the units (the decoder's take the encoder's output: see [Note: Values the segments take]), each
sequence ``--tokens`` tokens in and out.

    python perf/bench_layer_major.py --t5 large --micro-batches 2,8 --tokens 64 --nvme-path DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_trainer import PRESETS, llama_config  # noqa: E402

MIB = 1024**2
LOOPS = ("loop", "layer-major")
T5_PRESETS = {  # T5 v1.1 shapes: tiny for the suite, large ~ t5-v1_1-large's width at 8 + 8 blocks
    "tiny": {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4, "vocab_size": 128},
    "large": {"d_model": 1024, "d_kv": 64, "d_ff": 2816, "num_layers": 8, "num_heads": 16, "vocab_size": 32128},
}


def _child(args: argparse.Namespace) -> dict:
    import torch
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import tierstore as ts
    from tierstore.integrations import OffloadedAdamW, offload_model
    from tierstore.tools.rss import peak_rss_bytes

    torch.manual_seed(0)
    if args.vit:
        from tierstore.tools.vit import PRESETS as VIT_PRESETS
        from tierstore.tools.vit import Block, SyntheticImages, ViT

        host = ts.parse_bytes(args.host_budget or "256MiB", name="--host-budget")
        model = ViT(VIT_PRESETS[args.vit]).to(torch.bfloat16)
        images = SyntheticImages(VIT_PRESETS[args.vit])
        units, init = [Block], None
    elif args.t5:
        from transformers.models.t5.modeling_t5 import T5Block

        host = ts.parse_bytes(args.host_budget or "256MiB", name="--host-budget")
        config = transformers.T5Config(**T5_PRESETS[args.t5], feed_forward_proj="gated-gelu",
                                       tie_word_embeddings=False, dropout_rate=0.0, decoder_start_token_id=0,
                                       pad_token_id=0)
        with torch.device("meta"):
            model = transformers.T5ForConditionalGeneration(config).to(torch.bfloat16)
        units, init = [T5Block], model._init_weights
    else:
        config, host = llama_config(args.preset, args.host_budget, tokens=args.tokens)
        config.tie_word_embeddings = args.tied
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        units, init = [LlamaDecoderLayer], model._init_weights
    store = ts.TierStore(nvme_path=args.nvme_path, host_budget_bytes=host, device_budget_bytes="1MiB")
    try:
        off = offload_model(model, store, units=units, init_fn=init, grad_dtype="param")
        # updates at step(), as the figures in docs/layer-major.md were measured (bench_trainer.py --speculate: in
        # the last micro-batch's backward)
        opt = OffloadedAdamW(off, lr=1e-4, moments="8bit", master="split", keep_grads=False, speculate=False)
        n = args.micro_batch_count
        rows = []
        for step in range(args.steps):
            if args.vit:
                mbs = [images.batch(1000 * step + i, args.batch_size) for i in range(n)]
            else:
                mbs = [torch.randint(0, config.vocab_size, (args.batch_size, args.tokens),
                                     generator=torch.Generator().manual_seed(1000 * step + i)) for i in range(n)]

            def step_fn(mb: torch.Tensor | tuple) -> float:
                if args.vit:
                    loss = torch.nn.functional.cross_entropy(model(mb[0].to(torch.bfloat16)), mb[1]) / n
                else:
                    loss = model(mb, labels=mb).loss / n
                loss.backward()
                return loss.item()

            before = store.stats_dict()
            t0 = time.perf_counter()
            losses = off.accumulate(step_fn, mbs) if args.loop == "layer-major" else [step_fn(x) for x in mbs]
            off.clip_grad_norm_(1.0)
            opt.step()
            opt.wait()
            opt.zero_grad()
            seconds = time.perf_counter() - t0
            after = store.stats_dict()
            rows.append({"seconds": seconds, "stall_s": after["stall_seconds"] - before["stall_seconds"],
                         "moved": sum(after[k] - before[k] for k in ("bytes_read_nvme", "bytes_written_nvme")),
                         "loss": sum(losses)})
        params = sum(p.numel() for p in model.parameters())
        refused = off.layer_major_refused
        opt.close()
        off.remove(keep_values=False)  # its values are not kept: nothing to read back at close
    finally:
        store.close()
    return {"loop": args.loop, "micro_batches": args.micro_batch_count, "tokens": args.tokens, "params": params,
            "host_budget_bytes": host, "peak_rss_bytes": peak_rss_bytes(), "steps": rows,
            "layer_major_refused": refused}


def _run(argv: list[str], loop: str, micro_batches: int, tokens: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--loop", loop, "--micro-batch-count",
           str(micro_batches), "--tokens", str(tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the {loop} run ({micro_batches} micro-batches, {tokens} tokens) failed:\n"
                           f"{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-150m")
    p.add_argument("--vit", default=None, help="the demo's ViT of this preset (tiny, small, large, ...) instead")
    p.add_argument("--t5", default=None, choices=sorted(T5_PRESETS), help="a T5 v1.1 encoder-decoder instead")
    p.add_argument("--host-budget", default=None, help="default: the preset's")
    p.add_argument("--tied", action="store_true", help="the Llama's head tied to its embedding")
    p.add_argument("--micro-batches", default="1,2,4,8,16", help="micro-batch counts to run at --tokens")
    p.add_argument("--tokens", type=int, default=64, help="tokens a sequence in the micro-batch sweep")
    p.add_argument("--tokens-sweep", default="", help="sequence lengths to run with one micro-batch")
    p.add_argument("--batch-size", type=int, default=1, help="sequences a micro-batch")
    p.add_argument("--steps", type=int, default=3, help="steps a run; the last is reported")
    p.add_argument("--nvme-path", default=None, help="directory on the drive for the swap files")
    p.add_argument("--plot", default=None, help="draw bytes and seconds a step against micro-batches here (PNG)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--loop", choices=LOOPS, help=argparse.SUPPRESS)
    p.add_argument("--micro-batch-count", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.loop:
        print(json.dumps(_child(args)))
        return {}
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    for flag in ("--plot", "--json", "--tokens"):  # the sweeps set the tokens; the parent keeps the outputs
        while flag in passed:
            i = passed.index(flag)
            del passed[i:i + 2]
    sizes = [(n, args.tokens) for n in _ints(args.micro_batches)] + [(1, t) for t in _ints(args.tokens_sweep)]
    results = []
    for k, (n, tokens) in enumerate(sizes):
        for loop in (LOOPS if k % 2 == 0 else LOOPS[::-1]):  # alternating, size by size
            results.append(_run(passed, loop, n, tokens))
    params = results[0]["params"]
    for r in results:
        if r["loop"] == "layer-major" and r["layer_major_refused"]:
            print(f"the layer-major runs fell back to the loop: {r['layer_major_refused']}")
            break
    name = f"ViT-{args.vit}" if args.vit else f"T5-{args.t5}" if args.t5 else args.preset
    print(f"{name}{' tied' if args.tied else ''}: {params / 1e6:.1f}M "
          f"parameters, bf16, 8-bit moments, "
          f"split masters, host budget "
          f"{results[0]['host_budget_bytes'] / MIB:.0f} MiB; micro-batches of {args.batch_size} "
          f"{'image' if args.vit else 'sequence'}(s); the "
          f"last of {args.steps} steps")
    print(f"{'loop':<12}{'micro-batches':>14}{'tokens':>8}{'B/param':>9}{'GB moved':>10}{'step s':>8}{'stall s':>8}"
          f"{'peak RSS MiB':>14}")
    for r in results:
        last = r["steps"][-1]
        r["bytes_per_param"] = last["moved"] / params
        print(f"{r['loop']:<12}{r['micro_batches']:>14}{r['tokens']:>8}{r['bytes_per_param']:>9.1f}"
              f"{last['moved'] / 1e9:>10.2f}{last['seconds']:>8.2f}{last['stall_s']:>8.2f}"
              f"{r['peak_rss_bytes'] / MIB:>14.0f}")
    by = {(r["loop"], r["micro_batches"], r["tokens"]): r for r in results}
    print("layer-major against the loop (the reference), per size: bytes a step, step time, peak RSS")
    for n, tokens in sizes:
        ours, ref = by["layer-major", n, tokens], by["loop", n, tokens]
        o, f = ours["steps"][-1], ref["steps"][-1]
        print(f"  {n} x {tokens} tokens: {o['moved'] / 1e9:.2f} GB vs {f['moved'] / 1e9:.2f} GB = "
              f"{o['moved'] / f['moved']:.2f}x; {o['seconds']:.2f} s vs {f['seconds']:.2f} s = "
              f"{o['seconds'] / f['seconds']:.2f}x; {ours['peak_rss_bytes'] / MIB:.0f} MiB vs "
              f"{ref['peak_rss_bytes'] / MIB:.0f} MiB = {ours['peak_rss_bytes'] / ref['peak_rss_bytes']:.2f}x")
    counts = _ints(args.micro_batches)
    growth = {}
    if len(counts) > 1:
        lo, hi = min(counts), max(counts)
        for loop in LOOPS:
            growth[loop] = by[loop, hi, args.tokens]["steps"][-1]["moved"] / by[loop, lo, args.tokens]["steps"][-1][
                "moved"]
            print(f"{loop}: bytes a step with {hi} micro-batches = {growth[loop]:.2f}x those with {lo}")
    out = {"preset": name.lower(), "params": params, "results": results,
           "growth": growth}
    if args.plot:
        _plot(out, counts, args.tokens, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _plot(out: dict, counts: list[int], tokens: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["loop"], r["micro_batches"], r["tokens"]): r for r in out["results"]}
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7.5, 5.6))
    for loop, style in zip(LOOPS, ("o--", "s-")):
        rows = [by[loop, n, tokens] for n in counts]
        top.plot(counts, [r["bytes_per_param"] for r in rows], style, label=loop)
        bottom.plot(counts, [r["steps"][-1]["seconds"] for r in rows], style, label=loop)
    top.set_ylabel("drive bytes a parameter a step")
    bottom.set_ylabel("seconds a step")
    bottom.set_xlabel("micro-batches a step")
    bottom.set_xscale("log", base=2)
    bottom.set_xticks(counts, [str(n) for n in counts])
    top.set_ylim(bottom=0)
    bottom.set_ylim(bottom=0)
    top.legend(frameon=False)
    top.set_title(f"{out['preset']} ({out['params'] / 1e6:.0f}M), {tokens} tokens a micro-batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
