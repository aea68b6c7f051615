"""Every byte one step of transformers' Trainer loop moves over the drive, by phase and by what moved, against
what the loop's uses of its tensors would move, each once.

    python perf/bench_bytes.py --preset llama-150m --nvme-path DIR

A Llama (bench_trainer's presets) built on meta in bf16 is offloaded with 8-bit moments and split masters under
the preset's host budget and trained as Trainer trains it: 2 micro-batches, clipping to norm 1, the optimizer after
backward. The third step is recorded on the store's timeline and each drive transfer counted by its key (weights,
gradients, moments, masters) and direction, in each phase (each micro-batch's forward and backward, clipping, the
optimizer's step). Printed: the table in bytes a parameter, our total, and the reference: each use of a tensor
moving it once and nothing kept in the host tier (each weight read for each micro-batch's forward and backward,
each gradient written once a micro-batch and read back once a micro-batch after the first and by the
update, each state tensor read and written once); and their ratio. Above 1: bytes moved twice (re-reads under
eviction, write-backs of what is dropped after); below 1: what the host tier kept.
"""

from __future__ import annotations

import argparse
import collections
import json

from bench_trainer import PRESETS, llama_config

PHASES = ("micro-batch 1", "micro-batch 2", "clip", "step")


def _what(key: str) -> str:
    head, _, tail = key.rpartition("/")
    if key.startswith("param/"):
        return "weights"
    if key.startswith("grad"):
        return "gradients"
    return {"exp_avg": "moments", "exp_avg_sq": "moments"}.get(tail, tail or head)


def main(argv: list[str] | None = None) -> dict:
    import torch
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import tierstore as ts
    from tierstore.integrations import OffloadedAdamW, offload_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-150m")
    p.add_argument("--host-budget", default=None, help="default: the preset's")
    p.add_argument("--tokens", type=int, default=64, help="tokens a micro-batch (default 64)")
    p.add_argument("--keep-grads", choices=["yes", "no"], default="yes",
                   help="OffloadedAdamW's keep_grads: yes keeps each gradient until zero_grad() (the default), no "
                        "lets it go once applied")
    p.add_argument("--grad-dtype", choices=["float32", "param"], default="float32",
                   help="offload_model's grad_dtype: the kept gradients in fp32 (the default) or in the weights' "
                        "dtype (param)")
    p.add_argument("--nvme-path", required=True, help="directory on the drive for the swap files")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    config, host = llama_config(args.preset, args.host_budget, tokens=max(256, args.tokens))
    vocab = config.vocab_size
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    moved: dict[tuple[str, str, str], int] = collections.defaultdict(int)
    with ts.TierStore(nvme_path=args.nvme_path, host_budget_bytes=host, device_budget_bytes="1MiB") as store:
        off = offload_model(model, store, units=[LlamaDecoderLayer], init_fn=model._init_weights,
                            grad_dtype=args.grad_dtype)
        opt = OffloadedAdamW(off, lr=1e-4, moments="8bit", master="split", keep_grads=args.keep_grads == "yes",
                             speculate=False)  # the bytes of the updates at step(), as documented
        try:
            for step in range(3):
                timeline = store.record_timeline() if step == 2 else None
                marks = []
                for micro in range(2):
                    ids = torch.randint(0, vocab, (1, args.tokens),
                                        generator=torch.Generator().manual_seed(10 * step + micro))
                    (model(input_ids=ids, labels=ids).loss / 2).backward()
                    marks.append(len(timeline.events()) if timeline else 0)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                marks.append(len(timeline.events()) if timeline else 0)
                opt.step()
                opt.wait()  # the step's write-behind belongs to it
                opt.zero_grad()
                if timeline is not None:
                    events = timeline.events()
                    store.record_timeline(False)
                    for phase, start, end in zip(PHASES, [0, *marks], [*marks, len(events)]):
                        for e in events[start:end]:
                            if e.get("cat") == "transfer" and "nvme" in e["name"]:
                                way = "read" if e["name"].startswith("nvme->") else "write"
                                moved[phase, _what(e["args"]["key"]), way] += e["args"]["bytes"]
            state = sum(store.info(k)["nbytes"] for k in store.keys() if not k.startswith("grad"))
            weights = sum(store.info(k)["nbytes"] for k in store.keys() if k.startswith("param/"))
        finally:
            opt.close()
            off.remove(keep_values=False)  # its values are not kept: nothing to read back at close
    grads = (4 if args.grad_dtype == "float32" else 2) * params  # kept in the store from backward to the step
    once = 2 * 2 * weights + grads * (2 + 1 + 1) + 2 * state  # 2 micro-batches
    total = sum(moved.values())
    print(f"{params / 1e6:.1f}M parameters, host budget {host / 2**20:.0f} MiB, Trainer's loop (2 micro-batches of "
          f"{args.tokens} tokens, clip 1.0, after backward), bf16, 8-bit moments, split masters, {args.grad_dtype} "
          f"gradients, keep_grads {args.keep_grads}; bytes a parameter:")
    kinds = sorted({(w, d) for _, w, d in moved})
    print(f"{'phase':<15}" + "".join(f"{w + ' ' + d:>18}" for w, d in kinds))
    for phase in PHASES:
        print(f"{phase:<15}" + "".join(f"{moved.get((phase, w, d), 0) / params:>18.2f}" for w, d in kinds))
    print(f"moved a step (ours): {total / params:.1f} B/param ({total / 1e9:.2f} GB); each use once, nothing kept "
          f"(the reference): {once / params:.1f} B/param; ratio {total / once:.2f}")
    out = {"preset": args.preset, "keep_grads": args.keep_grads, "grad_dtype": args.grad_dtype, "params": params,
           "host_budget_bytes": host, "moved_bytes": total,
           "once_bytes": once, "ratio": total / once,
           "table": [{"phase": ph, "what": w, "direction": d, "bytes": b} for (ph, w, d), b in sorted(moved.items())]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
