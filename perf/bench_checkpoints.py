"""Peak RSS of checkpoints through the frameworks' own APIs, against the same training without them.

Each run is a fresh process: a transformers Llama (from a config, fp32) offloaded with its AdamW state under a host
budget several times smaller than the state, trained ``--steps`` steps of 2 micro-batches with clipping, in one of
four flows as their users write them:

- ``loop``: a loop of one's own; ``torch_save`` saves ``torch.save({"model": model.state_dict(), "optimizer":
  opt.state_dict()})`` and resumes from ``torch.load(..., mmap=True)``; ``dcp`` saves and resumes through
  torch.distributed.checkpoint (``get_state_dict``, ``dcp.save``, ``dcp.load``, ``set_state_dict``);
- ``accelerate``: ``prepare``, ``accumulate``, ``clip_grad_norm_``; ``save_state`` and ``load_state`` (the
  optimizer's file mapped);
- ``lightning``: the offload in ``configure_model``, ``configure_optimizers``, ``gradient_clip_val``,
  ``accumulate_grad_batches``; ``ModelCheckpoint``
  at the end of the run with ``MappedCheckpointIO``, and a resume with ``ckpt_path=`` for one more step;
- ``dcp-fsdp``: FSDP2 on 2 gloo ranks (``fully_shard`` on each decoder layer and the root, ``offload_fsdp``, torch's
  ``clip_grad_norm_``), each rank with its own store (half the host budget, for its half of the state) and data,
  saved and resumed through torch.distributed.checkpoint as ``dcp``; each figure the larger of the two ranks'.

For each flow: the run that trains and saves, and the run that resumes from it (and trains one more step), each
set against the run that only trains (the reference): peak RSS (the kernel's high-water mark, pages mapped from
files included) and the peak of the anonymous RSS (sampled every 2 ms: what the kernel cannot drop), with their
ratios.

    python perf/bench_checkpoints.py --preset llama-30m --nvme-path DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

MIB = 2**20
PRESETS = {  # hidden, layers, intermediate, vocab, heads, tokens, host budget
    "tiny": (64, 2, 176, 512, 4, 16, "1MiB"),
    "llama-30m": (512, 8, 1376, 4000, 8, 64, "56MiB"),
}
SAVERS = ("torch_save", "dcp", "accelerate", "lightning", "dcp-fsdp")
RANKS = 2  # of the dcp-fsdp flow


def _model(preset: str):
    import torch
    import transformers

    hidden, layers, inter, vocab, heads, _, _ = PRESETS[preset]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                                      vocab_size=vocab, num_attention_heads=heads, num_key_value_heads=heads,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


def _batches(preset: str, n: int, rank: int = 0):
    import torch

    _, _, _, vocab, _, tokens, _ = PRESETS[preset]
    g = torch.Generator().manual_seed(1 + rank)
    return [torch.randint(0, vocab, (2, tokens), generator=g) for _ in range(n)]


def _child(args: argparse.Namespace) -> dict:
    import warnings

    warnings.simplefilter("ignore")
    import tierstore as ts
    from tierstore.integrations import OffloadedAdamW, offload_model
    from tierstore.tools.rss import AnonRssPeak, peak_rss_bytes

    flow, what = args.flow, args.what  # what: train | save | resume
    ckpt = os.path.join(args.work, f"ckpt-{flow}")
    budget = ts.parse_bytes(PRESETS[args.preset][6], name="host budget")
    rank = 0
    if flow == "dcp-fsdp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        budget //= RANKS  # each rank holds its share of the state
    nvme = os.path.join(args.work, "nvme", str(rank))
    os.makedirs(nvme, exist_ok=True)
    store = ts.TierStore(nvme_path=nvme, host_budget_bytes=budget)
    model = _model(args.preset)
    micro = _batches(args.preset, 2 * (args.steps + 1), rank)
    steps = 1 if what == "resume" else args.steps
    losses: list[float] = []
    with AnonRssPeak() as anon:
        if flow == "lightning":
            state_bytes = _lightning(args, model, store, micro, what, ckpt, losses)
        else:
            if flow == "dcp-fsdp":
                import torch
                from torch.distributed.fsdp import fully_shard

                from tierstore.integrations import offload_fsdp

                for layer in model.model.layers:
                    fully_shard(layer)
                off = offload_fsdp(fully_shard(model), store)
                clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731 (all-reduced)
            else:
                off = offload_model(model, store)
                clip = lambda: off.clip_grad_norm_(1.0)  # noqa: E731
            opt = OffloadedAdamW(off, lr=1e-4)
            accelerator = None
            if flow == "accelerate":
                import accelerate

                accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
                model, opt = accelerator.prepare(model, opt)
            if what == "resume":
                _load(flow, model, opt, accelerator, ckpt)
            for step in range(steps):
                for ids in micro[2 * step:2 * step + 2]:
                    loss = model(ids, labels=ids).loss / 2
                    if accelerator is not None:
                        with accelerator.accumulate(model):
                            accelerator.backward(loss)
                            if accelerator.sync_gradients:
                                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                            opt.step()
                            opt.zero_grad()
                    else:
                        loss.backward()
                    losses.append(loss.item())
                if accelerator is None:
                    clip()
                    opt.step()
                    opt.zero_grad()
            if what == "save":
                _save(flow, model, opt, accelerator, ckpt)
            state_bytes = _state_bytes(store)
            if flow != "dcp-fsdp":  # FSDP2 keeps no shard without memory: the process ends with its store
                off.remove(keep_values=False)
    out = {"flow": flow, "what": what, "peak_rss_bytes": peak_rss_bytes(), "peak_anon_bytes": anon.peak_bytes,
           "state_bytes": state_bytes, "host_budget_bytes": store.config.host_budget_bytes, "losses": losses}
    if flow == "dcp-fsdp":  # each figure the larger of the ranks', rank 0's losses
        every: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, out)
        out = {**out, **{k: max(r[k] for r in every) for k in ("peak_rss_bytes", "peak_anon_bytes", "state_bytes")}}
        dist.destroy_process_group()
    else:
        store.close()
    return out if rank == 0 else {}


def _state_bytes(store) -> int:
    return sum(store.info(k)["nbytes"] for k in store.keys())


def _save(flow: str, model, opt, accelerator, ckpt: str) -> None:
    import torch

    if flow == "torch_save":
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)
    elif flow in ("dcp", "dcp-fsdp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    else:
        accelerator.save_state(ckpt)


def _load(flow: str, model, opt, accelerator, ckpt: str) -> None:
    import torch

    if flow == "torch_save":
        sd = torch.load(ckpt, mmap=True, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
    elif flow in ("dcp", "dcp-fsdp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    else:
        accelerator.load_state(ckpt, load_kwargs={"mmap": True})


def _lightning(args, model, store, micro, what, ckpt, losses) -> int:
    """One Lightning run; the bytes of its state in the store."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint

    from tierstore.integrations import OffloadedAdamW, offload_model
    from tierstore.integrations.lightning import MappedCheckpointIO

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, ids, batch_idx):
            loss = self.model(ids, labels=ids).loss
            losses.append(loss.item())
            return loss

        def configure_model(self):  # before a resume loads the weights: they go straight into the store
            if not hasattr(self, "offload"):
                self.offload = offload_model(self.model, store)

        def configure_optimizers(self):
            return OffloadedAdamW(self.offload, lr=1e-4)

    saving = what != "train"
    trainer = pl.Trainer(max_steps=args.steps + (what == "resume"), accelerator="cpu", devices=1,
                         gradient_clip_val=1.0, accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=saving,
                         callbacks=[ModelCheckpoint(dirpath=ckpt)] if saving else [],
                         plugins=[MappedCheckpointIO()])
    lit = Lit()
    path = None
    if what == "resume":
        path = os.path.join(ckpt, sorted(os.listdir(ckpt))[-1])
    trainer.fit(lit, torch.utils.data.DataLoader(micro, batch_size=None), ckpt_path=path)
    state_bytes = _state_bytes(store)
    lit.offload.remove(keep_values=False)
    return state_bytes


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-30m")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps of 2 micro-batches before the save")
    p.add_argument("--flows", default=",".join(SAVERS), help=f"comma-separated, of {', '.join(SAVERS)}")
    p.add_argument("--nvme-path", default=None, help="where the runs' swap files and checkpoints go")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--flow", help=argparse.SUPPRESS)
    p.add_argument("--what", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.flow:
        out = _child(args)
        if out:
            print(json.dumps(out))
        return {}
    flows = [f for f in args.flows.split(",") if f]
    unknown = sorted(set(flows) - set(SAVERS))
    if unknown or not flows:
        p.error(f"--flows: unknown {unknown} (choose from {', '.join(SAVERS)})")
    base = args.nvme_path or os.environ.get("TIERSTORE_NVME_PATH") or tempfile.gettempdir()
    work = tempfile.mkdtemp(prefix="bench-checkpoints-", dir=base)
    os.makedirs(os.path.join(work, "nvme"))
    results = []
    try:
        for flow in flows:
            runs = {}
            for what in ("train", "save", "resume"):
                launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS)] \
                    if flow == "dcp-fsdp" else []
                cmd = [sys.executable, *launch, os.path.abspath(__file__), "--preset", args.preset, "--steps",
                       str(args.steps), "--flow", flow, "--what", what, "--work", work]
                env = dict(os.environ, OMP_NUM_THREADS="1") if launch else None  # 2 ranks on the machine's cores
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    raise SystemExit(f"{flow} {what} failed:\n{done.stderr[-4000:]}")
                runs[what] = json.loads(done.stdout.strip().splitlines()[-1])
            ref = runs["train"]
            for what in ("save", "resume"):
                r = runs[what]
                r["rss_ratio"] = r["peak_rss_bytes"] / ref["peak_rss_bytes"]
                r["anon_ratio"] = r["peak_anon_bytes"] / ref["peak_anon_bytes"]
            results.extend(runs.values())
            if runs["save"]["losses"] != ref["losses"]:
                raise SystemExit(f"{flow}: the run that saved trained otherwise than the one that did not")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    state, budget = results[0]["state_bytes"], results[0]["host_budget_bytes"]
    print(f"{args.preset}: state {state / MIB:.1f} MiB, {state / budget:.1f}x the host budget of "
          f"{budget / MIB:.1f} MiB; {args.steps} steps of 2 micro-batches, clip 1.0; fresh processes")
    print(f"{'flow':<12}{'run':<8}{'peak RSS MiB':>14}{'vs train':>10}{'peak anon MiB':>15}{'vs train':>10}")
    for r in results:
        ratio = f"{r['rss_ratio']:.2f}x" if "rss_ratio" in r else "ref"
        anon = f"{r['anon_ratio']:.2f}x" if "anon_ratio" in r else "ref"
        print(f"{r['flow']:<12}{r['what']:<8}{r['peak_rss_bytes'] / MIB:>14.0f}{ratio:>10}"
              f"{r['peak_anon_bytes'] / MIB:>15.0f}{anon:>10}")
    out = {"preset": args.preset, "steps": args.steps, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
