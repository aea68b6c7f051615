"""One long sequence whose activations are several times the host budget: the layer-major step keeps them in the
store (spilled to the drive), against resident training with gradient checkpointing (the reference).

    python perf/bench_long_sequence.py --preset llama-150m --tokens 4096 --host-budget 48MiB --nvme-path DIR

Two fresh processes train the same fp32 Llama ``--steps`` steps on the same sequences (clipping to norm 1): the
offloaded model through ``off.accumulate`` (one micro-batch: its activations at the layers' boundaries go to the
store) and the resident model with ``activation_checkpointing_enable()`` and torch's AdamW. Printed: the boundary
activations against the host budget, the bytes of them written to and read from the drive, each run's peak RSS
(the offloaded one's against what the store reports it held), step times, and whether the losses and weights are
the same bits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_trainer import PRESETS, llama_config  # noqa: E402

MIB = 1024**2


def _child(args: argparse.Namespace) -> dict:
    import torch
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import tierstore as ts
    from tierstore.integrations import OffloadedAdamW, offload_model
    from tierstore.tools.rss import peak_rss_bytes

    config, host = llama_config(args.preset, args.host_budget, tokens=args.tokens)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    store = off = None
    if args.run == "offloaded":
        store = ts.TierStore(nvme_path=args.nvme_path, host_budget_bytes=host, device_budget_bytes="1MiB")
        off = offload_model(model, store, units=[LlamaDecoderLayer])
        opt = OffloadedAdamW(off, lr=1e-4)
    else:
        model.activation_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    losses, seconds = [], []
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(step))

        def step_fn(x: torch.Tensor) -> float:
            loss = model(x, labels=x).loss
            loss.backward()
            return loss.item()

        act = {"written": 0, "read": 0}  # the last step's
        timeline = store.record_timeline() if store is not None else None
        t0 = time.perf_counter()
        losses += off.accumulate(step_fn, [ids]) if off is not None else [step_fn(ids)]
        if off is not None:
            off.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - t0)
        if timeline is not None:
            store.record_timeline(False)
            for e in timeline.events():
                if e.get("cat") == "transfer" and e["args"]["key"].startswith("act/"):
                    kind = "written" if e["name"].startswith("host->nvme") else "read"
                    act[kind] += e["args"].get("bytes", 0)
    out = {"run": args.run, "losses": losses, "seconds": seconds, "activations_drive": act,
           "peak_rss_bytes": peak_rss_bytes(), "host_budget_bytes": host,
           "boundary_bytes": config.num_hidden_layers * args.tokens * config.hidden_size * 4,
           "params": sum(p.numel() for p in model.parameters())}
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.weights)
    if store is not None:
        out["host_peak_bytes"] = store.memory()["host"]["peak_bytes"]
        opt.close()
        off.remove(keep_values=False)  # its weights were saved above: nothing to read back at close
        store.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-150m")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the sequence")
    p.add_argument("--host-budget", default="48MiB")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--nvme-path", default=None, help="directory on the drive for the swap files")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--run", choices=["offloaded", "resident"], help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run:
        print(json.dumps(_child(args)))
        return {}
    import torch

    passed = list(argv if argv is not None else sys.argv[1:])
    if "--json" in passed:
        i = passed.index("--json")
        del passed[i:i + 2]
    results = {}
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as scratch:
        weights = {}
        for run in ("offloaded", "resident"):
            weights[run] = os.path.join(scratch, f"{run}.pt")
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *passed, "--run", run, "--weights",
                                   weights[run]], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"the {run} run failed:\n{done.stderr[-4000:]}")
            results[run] = json.loads(done.stdout.strip().splitlines()[-1])
        a, b = (torch.load(weights[r], weights_only=True) for r in ("offloaded", "resident"))
        same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ours, ref = results["offloaded"], results["resident"]
    same_losses = ours["losses"] == ref["losses"]
    act = ours["activations_drive"]
    print(f"{args.preset}: {ours['params'] / 1e6:.1f}M parameters, fp32, one sequence of {args.tokens} tokens; "
          f"boundary activations {ours['boundary_bytes'] / MIB:.0f} MiB = "
          f"{ours['boundary_bytes'] / ours['host_budget_bytes']:.1f}x the host budget "
          f"({ours['host_budget_bytes'] / MIB:.0f} MiB)")
    print(f"activations written to the drive {act['written'] / MIB:.0f} MiB, read back {act['read'] / MIB:.0f} MiB "
          f"(the last step)")
    print(f"offloaded (layer-major): peak RSS {ours['peak_rss_bytes'] / MIB:.0f} MiB, host tier peak "
          f"{ours['host_peak_bytes'] / MIB:.0f} MiB of {ours['host_budget_bytes'] / MIB:.0f}; steps "
          f"{' '.join(f'{s:.1f}' for s in ours['seconds'])} s")
    print(f"resident with checkpointing (the reference): peak RSS {ref['peak_rss_bytes'] / MIB:.0f} MiB; steps "
          f"{' '.join(f'{s:.1f}' for s in ref['seconds'])} s; ratio of peak RSS "
          f"{ours['peak_rss_bytes'] / ref['peak_rss_bytes']:.2f}x")
    print(f"losses {' '.join(f'{x:.6f}' for x in ours['losses'])}: the same bits as the reference's: {same_losses}; "
          f"weights the same bits: {same_weights}")
    out = {"preset": args.preset, "tokens": args.tokens, "results": results, "same_losses": same_losses,
           "same_weights": same_weights}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
