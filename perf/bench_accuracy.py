"""Accuracy of the optimizer state layouts: a small causal LM trained with each against torch's fp32 AdamW.

    python perf/bench_accuracy.py --steps 1000 --json accuracy.json

The model is transformers' ``LlamaForCausalLM`` (3.4M parameters by default, built from a config); the corpus
is text from a fixed random Markov chain made in-process (each token has 16 possible successors with random
probabilities), so the loss has a known floor: the chain's entropy rate, printed. Every layout trains the same
model from the same initial weights on the same batches, with a warm-up and cosine learning-rate schedule:

- ``torch``: the reference, resident ``torch.optim.AdamW``, fp32 weights;
- ``W/M/S``: offloaded with weights W (fp32 or bf16), moments M (fp32, bf16, 8bit) and masters S (fp32,
  split, none; "-" for fp32 weights, which need none), through OffloadedAdamW's layouts
  (see [Note: Compressed optimizer state]); gradients kept in fp32 from backward to the step;
- ``W/M/S/bf16``: the same with the gradients kept (and accumulated) in the weights' dtype
  (``offload_model(..., grad_dtype="param")``), as torch keeps them;
- ``torchao``: torchao's ``AdamW8bit``, resident, fp32 weights, where torchao imports.

bf16 weights are computed in fp32: each Linear and Embedding casts its weight up in its forward (this CPU's bf16
matrix product is hundreds of times slower than its fp32 one); gradients reach the weights as bf16, and the
optimizer keeps them in fp32 from there (unless the layout says bf16). ``--accumulation N`` adds N micro-batches
into each step (each of ``--batch`` sequences, their losses divided by N) and ``--clip X`` clips the gradients'
global norm to X before each step, as transformers' Trainer does. Printed per layout: the bytes a parameter costs
at rest (weights and optimizer state, from the store), the final loss (mean of the last 50 steps), the mean loss
over the whole run, the loss on held-out batches, and each against the reference's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

LAYOUTS = ("torch", "fp32/fp32/-", "bf16/fp32/fp32", "fp32/8bit/-", "bf16/bf16/split", "bf16/8bit/split",
           "bf16/8bit/split/bf16", "bf16/8bit/none", "torchao")


def markov_chain(vocab: int, successors: int, seed: int):
    """(transition matrix, entropy rate in nats) of a random chain: each token has ``successors`` next tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    probs = torch.zeros(vocab, vocab, dtype=torch.float64)
    for row in range(vocab):
        nxt = torch.randperm(vocab, generator=g)[:successors]
        w = torch.rand(successors, generator=g, dtype=torch.float64) ** 2 + 1e-3
        probs[row, nxt] = w / w.sum()
    # stationary distribution by power iteration, then the entropy rate sum_i pi_i H(P_i)
    pi = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    for _ in range(500):
        pi = pi @ probs
    logs = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
    return probs, float(-(pi * (probs * logs).sum(1)).sum())


def batch(probs, n: int, length: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(n, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, probs.shape[0], (n,), generator=g)
    for t in range(1, length):
        ids[:, t] = torch.multinomial(probs[ids[:, t - 1]], 1, generator=g).squeeze(1)
    return ids


def build(args: argparse.Namespace, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=args.length,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    from tierstore.tools.upcast import compute_in_fp32

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # fp32 init: every layout starts from the same values (rounded for bf16)
    model.to(dtype)
    if dtype != torch.float32:
        compute_in_fp32(model)
    return model


def run_layout(args: argparse.Namespace, layout: str, probs) -> dict | None:
    import torch

    import tierstore as ts
    from tierstore.integrations import OffloadedAdamW, offload_model

    parts = ["fp32", "fp32", "-"] if layout in ("torch", "torchao") else layout.split("/")
    weights, moments, master = parts[:3]
    grads = parts[3] if len(parts) > 3 else "fp32"
    model = build(args, torch.bfloat16 if weights == "bf16" else torch.float32)
    params = sum(p.numel() for p in model.parameters())
    store = None
    hyper = {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
    if layout == "torch":
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **hyper)
        at_rest = params * 12
    elif layout == "torchao":
        try:
            from torchao.optim import AdamW8bit
        except ImportError as e:
            print(f"  torchao: not run ({type(e).__name__}: {e})")
            return None
        opt = AdamW8bit(model.parameters(), **hyper)
        at_rest = None
    else:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        tmp = tempfile.mkdtemp(prefix="bench-accuracy-", dir=args.nvme_path)
        store = ts.TierStore(nvme_path=tmp, host_budget_bytes="1GiB")
        off = offload_model(model, store, units=[LlamaDecoderLayer],
                            grad_dtype="param" if grads == weights else "float32")
        opt = OffloadedAdamW(off, moments=moments, master="fp32" if master == "-" else master, **hyper)
        at_rest = sum(store.info(k)["nbytes"] for k in store.keys())
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        loss = 0.0
        for micro in range(args.accumulation):
            ids = batch(probs, args.batch, args.length, seed=1_000_000 + step * args.accumulation + micro)
            part = model(input_ids=ids, labels=ids).loss / args.accumulation
            part.backward()
            loss += part.item()
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss)
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        held_out = sum(model(input_ids=(ids := batch(probs, args.batch, args.length, seed=i)), labels=ids).loss.item()
                       for i in range(8)) / 8
    if store is not None:
        opt.close()
        off.remove()
        store.close()
        os.rmdir(tmp)  # the store removed its own directory in it
    tail = losses[-min(50, len(losses)):]
    return {"layout": layout, "params": params, "bytes_per_param": None if at_rest is None else at_rest / params,
            "final_loss": sum(tail) / len(tail), "mean_loss": sum(losses) / len(losses), "held_out_loss": held_out,
            "seconds": seconds, "losses": losses}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches a step (default 1)")
    p.add_argument("--clip", type=float, default=None, help="clip the gradients' global norm to this (default none)")
    p.add_argument("--nvme-path", default=None, help="where the offloaded runs' swap files go (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    unknown = [s for s in layouts if s not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    probs, floor = markov_chain(args.vocab, 16, seed=0)
    print(f"corpus: Markov chain over {args.vocab} tokens, entropy rate (the loss floor) {floor:.4f} nats; "
          f"{args.steps} steps of {args.accumulation}x{args.batch}x{args.length} tokens, clip "
          f"{'none' if args.clip is None else args.clip}")
    head = {"entropy_rate": floor, "steps": args.steps, "accumulation": args.accumulation, "clip": args.clip}
    results = []
    for layout in layouts:
        r = run_layout(args, layout, probs)
        if r is not None:
            results.append(r)
            print(f"  {layout:16s} done in {r['seconds']:.0f} s: final {r['final_loss']:.4f}, mean "
                  f"{r['mean_loss']:.4f}, held-out {r['held_out_loss']:.4f}", flush=True)
            if args.json:  # as each layout ends: a long run stopped part-way keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({**head, "results": results}, f, indent=1)
    ref = next((r for r in results if r["layout"] == "torch"), None)
    print(f"\n{'layout (weights/moments/master[/grads])':40s} {'B/param':>8s} {'final':>8s} {'mean':>8s} "
          f"{'held-out':>9s} {'vs torch (final, held-out)':>28s}")
    for r in results:
        bpp = "-" if r["bytes_per_param"] is None else f"{r['bytes_per_param']:.2f}"
        vs = "" if ref is None else (f"{r['final_loss'] / ref['final_loss']:.4f}x, "
                                     f"{r['held_out_loss'] / ref['held_out_loss']:.4f}x")
        print(f"{r['layout']:40s} {bpp:>8s} {r['final_loss']:8.4f} {r['mean_loss']:8.4f} {r['held_out_loss']:9.4f} "
              f"{vs:>28s}")
    out = {**head, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
