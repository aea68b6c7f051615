"""transformers' Trainer over an offloaded Llama built on meta: peak RSS with checkpoints against without.

    python perf/bench_trainer.py --preset llama-150m --nvme-path DIR [--lora 16] [--json OUT]

Three fresh processes, each training the same model in Trainer's own loop (2 micro-batches a step, clipping to
norm 1, the optimizer after backward): **plain** (no checkpoint), **save** (a checkpoint every step through
``stream_checkpoints``, then ``save_pretrained``) and **resume** (from save's last checkpoint, one step more).
Prints each one's peak RSS, the drive bytes moved a step and the step time, and the ratio of save's and resume's
peak RSS to plain's (the reference). With ``--lora R`` the base is frozen and LoRA of rank R trains on every
attention and MLP projection (peft). ``--runs plain`` runs the one without checkpoints alone.

``--accumulation N`` sets ``gradient_accumulation_steps`` (2 by default); ``--layer-major`` adds
``accumulate_layer_major(trainer)``: the step's micro-batches run unit by unit (see [Note: A layer-major step]).

``--measure-drive MIB`` then measures, in each process after its training, the drive's mixed read+write rate
(the store's, at the read share of the last step, moving MIB MiB) and prints each step's rate against it: the
step moves its bytes at that fraction of what the drive can do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from tierstore.tools.upcast import COMPUTE_CHOICES

MIB = 1024**2
# Llama shapes: (hidden, layers, heads, intermediate, vocab), the host budget they run under by default
PRESETS = {
    "llama-7b": ((4096, 32, 32, 11008, 32000), "2GiB"),
    "llama-1.9b": ((2048, 24, 16, 8192, 32000), "2GiB"),
    "llama-0.5b": ((2048, 8, 16, 5632, 32000), "800MiB"),  # 0.54B: few layers, wide
    "llama-150m": ((1024, 12, 16, 2816, 8000), "160MiB"),
    "llama-180m-deep": ((768, 24, 12, 2048, 8000), "96MiB"),  # narrow and deep: many boundaries a token
    "llama-tiny": ((128, 4, 4, 352, 1024), "4MiB"),
}
MODES = ("plain", "save", "resume")
WAIT_COUNTERS = ("stall_seconds", "hits", "late_prefetches", "misses", "prefetch_skipped", "budget_waits")


def llama_config(preset: str, host_budget: str | None = None, tokens: int = 256) -> tuple:
    """transformers' LlamaConfig of ``preset`` (no cache, untied head, ``tokens`` positions) and the host budget in
    bytes it runs under (``host_budget`` as given, else the preset's)."""
    import transformers

    import tierstore as ts

    (hidden, layers, heads, inter, vocab), default_host = PRESETS[preset]
    config = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=heads, intermediate_size=inter, vocab_size=vocab,
                                      max_position_embeddings=tokens, tie_word_embeddings=False, use_cache=False)
    return config, ts.parse_bytes(host_budget or default_host, name="--host-budget")


def _child(args: argparse.Namespace) -> dict:
    import torch
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import tierstore as ts
    from tierstore.integrations import OffloadedAdamW, accumulate_layer_major, offload_model, stream_checkpoints
    from tierstore.tools.bench_drive import measure_drive
    from tierstore.tools.rss import peak_rss_bytes
    from tierstore.tools.upcast import compute_in_fp32, resolve_compute

    config, host = llama_config(args.preset, args.host_budget)
    vocab = config.vocab_size
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    compute, _ = resolve_compute(args.compute, dtype)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1024

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    if compute == "fp32":
        compute_in_fp32(model)
    init = model._init_weights
    if args.lora:
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=args.lora, target_modules=targets, lora_dropout=0.0))
    store = ts.TierStore(nvme_path=args.nvme_path, host_budget_bytes=host, device_budget_bytes="1MiB",
                         nvme_budget_bytes=args.nvme_budget)
    try:
        t0 = time.perf_counter()
        off = offload_model(model, store, units=[LlamaDecoderLayer], init_fn=init, grad_dtype=args.grad_dtype)
        opt = OffloadedAdamW(off, lr=1e-4, moments=args.moments, master=args.master,
                             keep_grads=args.keep_grads == "yes", stream_update=args.stream_update,
                             speculate={"no": False, "yes": True, "auto": "auto"}[args.speculate])
        built_s = time.perf_counter() - t0
        steps = args.steps + (1 if args.mode == "resume" else 0)
        training = transformers.TrainingArguments(
            output_dir=args.output, per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.accumulation,
            max_grad_norm=args.max_grad_norm, max_steps=steps, learning_rate=1e-4, logging_steps=1, report_to=[],
            save_strategy="no" if args.mode == "plain" else "steps", save_steps=1, seed=0,
            use_cpu=not torch.cuda.is_available())
        trainer = transformers.Trainer(model=model, args=training, train_dataset=Tokens(), optimizers=(opt, None))
        stream_checkpoints(trainer)
        if args.layer_major:
            accumulate_layer_major(trainer)
        moved: list[int] = []
        read: list[int] = []
        seconds: list[float] = []
        inside: list[int] = []  # drive bytes moved inside opt.step(), while the loop waited for it

        waits: list[dict[str, float]] = []  # a step's stall time and what its gets found (store counters)

        class Meter(transformers.TrainerCallback):
            def on_step_begin(self, *_: object, **__: object) -> None:
                s = store.stats_dict()
                self.start = (time.perf_counter(), s["bytes_read_nvme"] + s["bytes_written_nvme"], s["bytes_read_nvme"])
                self.counts = {k: s[k] for k in WAIT_COUNTERS}

            def on_pre_optimizer_step(self, *_: object, **__: object) -> None:
                s = store.stats_dict()
                self.before_step = s["bytes_read_nvme"] + s["bytes_written_nvme"]

            def on_optimizer_step(self, *_: object, **__: object) -> None:
                s = store.stats_dict()
                inside.append(s["bytes_read_nvme"] + s["bytes_written_nvme"] - self.before_step)

            def on_step_end(self, _args: object, state: transformers.TrainerState, *__: object, **___: object) -> None:
                if not args.stream_update or state.global_step == steps:
                    opt.wait()  # the step's write-behind belongs to it (streamed: its updates run in the next)
                s = store.stats_dict()
                seconds.append(time.perf_counter() - self.start[0])
                moved.append(s["bytes_read_nvme"] + s["bytes_written_nvme"] - self.start[1])
                read.append(s["bytes_read_nvme"] - self.start[2])
                waits.append({k: s[k] - self.counts[k] for k in WAIT_COUNTERS})

        trainer.add_callback(Meter())
        resume = os.path.join(args.output, f"checkpoint-{args.steps}") if args.mode == "resume" else None
        trainer.train(resume_from_checkpoint=resume)
        if args.mode == "save":
            model.save_pretrained(os.path.join(args.output, "final"))
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        params = sum(p.numel() for p in model.parameters())
        speculation = {k: store.stats_dict()[k] for k in ("updates_speculated", "speculated_kept",
                                                           "speculated_undone")}
        opt.close()
        drive = store.memory()["nvme"]["peak_bytes"]
        off.remove(keep_values=False)  # its values are not kept: nothing to read back at close
    finally:
        store.close()
    out = {"mode": args.mode, "compute": "fp32" if compute == "fp32" else args.dtype, "params": params,
           "host_budget_bytes": host, "peak_rss_bytes": peak_rss_bytes(),
           "drive_bytes": drive, "build_s": built_s, "step_seconds": seconds, "bytes_moved": moved,
           "bytes_read": read, "waits": waits, "losses": losses, "inside_step_bytes": inside,
           "speculation": speculation}
    if args.measure_drive:  # after training, so that it costs the peak nothing
        share = read[-1] / max(1, moved[-1])
        out["drive"] = measure_drive(args.nvme_path or tempfile.gettempdir(), size_mib=args.measure_drive,
                                     read_fraction=round(share, 2))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-150m")
    p.add_argument("--host-budget", default=None, help="default: the preset's")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--compute", default="auto", choices=COMPUTE_CHOICES,
                   help="compute bf16 weights in bf16 (param) or in fp32; auto (the default) times both here and "
                        "takes the faster (see tierstore/tools/upcast.py)")
    p.add_argument("--moments", default="8bit", help="OffloadedAdamW's moments: fp32, bf16 or 8bit")
    p.add_argument("--master-weights", dest="master", default="split",
                   help="OffloadedAdamW's master weights: fp32, split or none")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="train LoRA of rank R on a frozen base")
    p.add_argument("--keep-grads", choices=["yes", "no"], default="yes",
                   help="OffloadedAdamW's keep_grads: no lets each gradient go once applied")
    p.add_argument("--grad-dtype", choices=["float32", "param"], default="float32",
                   help="offload_model's grad_dtype: what the kept gradients are stored in (param: the weights' "
                        "dtype, as torch keeps them)")
    p.add_argument("--runs", default=",".join(MODES), help=f"which of {', '.join(MODES)} (default all; resume needs "
                                                            "save)")
    p.add_argument("--measure-drive", type=int, default=0, metavar="MIB",
                   help="measure the drive's mixed rate after training, moving MIB MiB (default: not measured)")
    p.add_argument("--steps", type=int, default=2, help="steps before the checkpoint resumed from")
    p.add_argument("--batch-size", type=int, default=1, help="sequences a micro-batch")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches a step (gradient_accumulation_steps)")
    p.add_argument("--layer-major", action="store_true",
                   help="run each step's micro-batches unit by unit (accumulate_layer_major)")
    p.add_argument("--tokens", type=int, default=64, help="tokens a sequence")
    p.add_argument("--nvme-path", default=None, help="directory on the drive for the swap files")
    p.add_argument("--nvme-budget", default=None,
                   help="the most the swap files may take (nvme_budget_bytes, as 60GB): a drive with that room")
    p.add_argument("--output", default=None, help="Trainer's output directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--stream-update", action="store_true",
                   help="OffloadedAdamW(stream_update=True): each step's updates run while the next forward computes")
    p.add_argument("--speculate", choices=["no", "yes", "auto"], default="no",
                   help="OffloadedAdamW(speculate=...): each update made in the backward that completes its gradient, "
                        "kept where the clip does not clip (default no, the loop without it; the optimizer's own "
                        "default is auto)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="Trainer's max_grad_norm")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mode:
        print(json.dumps(_child(args)))
        return {}
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or set(runs) - set(MODES) or ("resume" in runs and "save" not in runs):
        p.error(f"--runs {args.runs!r}: a comma-separated list of {', '.join(MODES)}; resume needs save before it")
    # "auto" is timed once, here: timed in each run, the runs could compute in different dtypes and differ
    compute = args.compute
    if compute == "auto":
        import torch

        from tierstore.tools.upcast import resolve_compute

        compute = resolve_compute("auto", torch.bfloat16 if args.dtype == "bf16" else torch.float32)[0]
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as scratch:
        output = args.output or scratch
        results = []
        for mode in [m for m in MODES if m in runs]:
            cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                   "--mode", mode, "--output", output, "--compute", compute]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"the {mode} run failed:\n{done.stderr[-4000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    plain = results[0]["peak_rss_bytes"]  # the first run's: plain's, unless it was not run
    print(f"{results[0]['params'] / 1e6:.1f}M parameters, host budget {results[0]['host_budget_bytes'] / MIB:.0f} "
          f"MiB, {'LoRA r=%d' % args.lora if args.lora else 'full fine-tune'}, {args.dtype} computed in "
          f"{results[0]['compute']}, "
          f"{args.moments} moments, {args.master} masters, {args.grad_dtype} gradients, keep_grads {args.keep_grads}, "
          f"{args.accumulation} micro-batches of {args.batch_size}x{args.tokens} tokens a step, max_grad_norm "
          f"{args.max_grad_norm:g}"
          f"{', layer-major' if args.layer_major else ''}")
    print(f"{'run':<8}{'peak RSS MiB':>14}{'vs plain':>10}{'drive GB':>10}{'moved GB/step':>15}{'s/step':>9}")
    for r in results:
        r["rss_ratio"] = r["peak_rss_bytes"] / plain
        moved = " ".join(f"{b / 1e9:.2f}" for b in r["bytes_moved"])
        secs = " ".join(f"{s:.1f}" for s in r["step_seconds"])
        print(f"{r['mode']:<8}{r['peak_rss_bytes'] / MIB:>14.0f}{r['rss_ratio']:>9.2f}x"
              f"{r['drive_bytes'] / 1e9:>10.2f}  {moved:>13}  {secs}")
    for r in results:
        params = r["params"]
        print(f"{r['mode']}: {' '.join(f'{b / params:.1f}' for b in r['bytes_moved'])} B/param a step; drive peak "
              f"{r['drive_bytes'] / params:.2f} B/param; losses {' '.join(f'{x:.4f}' for x in r['losses'])}")
        shares = [b / max(1, m) for b, m in zip(r["inside_step_bytes"], r["bytes_moved"])]
        print(f"  inside opt.step(): {' '.join(f'{x:.0%}' for x in shares)} of each step's drive bytes"
              f"{' (updates streamed into the next forward)' if args.stream_update else ''}")
        if args.speculate != "no":
            s = r["speculation"]
            print(f"  speculate={args.speculate}: {s['updates_speculated']} updates made in backward, "
                  f"{s['speculated_kept']} kept, {s['speculated_undone']} undone")
        for i, w in enumerate(r["waits"]):
            print(f"  step {i + 1}: stalled {w['stall_seconds']:.1f} s; gets {w['hits']:.0f} found, "
                  f"{w['late_prefetches']:.0f} waited on a prefetch, {w['misses']:.0f} fetched; "
                  f"{w['prefetch_skipped']:.0f} prefetches skipped; {w['budget_waits']:.0f} waits for room")
        if "drive" in r:
            d = r["drive"]
            rates = [b / s / 1e9 for b, s in zip(r["bytes_moved"], r["step_seconds"])]
            r["drive_ratio"] = [x / d["mixed_gbps"] for x in rates]
            print(f"  the drive's mixed rate after training ({d['read_fraction']:.0%} reads): {d['mixed_gbps']:.2f} "
                  f"GB/s (read {d['read_gbps']:.2f}, write {d['write_gbps']:.2f}); the steps moved "
                  f"{' '.join(f'{x:.2f}' for x in rates)} GB/s = "
                  f"{' '.join(f'{x:.2f}' for x in r['drive_ratio'])}x of it")
    out = {"preset": args.preset, "lora": args.lora, "dtype": args.dtype, "moments": args.moments,
           "master": args.master, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
