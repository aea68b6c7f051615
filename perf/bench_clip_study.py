"""How often a fine-tune clips, and what each ``speculate`` policy makes of it.

    python perf/bench_clip_study.py --nvme-path DIR [--steps 200] [--pretrain-steps 600]

A small Llama (``--width``, ``--layers``, a vocabulary of ``--vocab``) is pretrained here, resident, on one
synthetic corpus: sequences of a random Markov chain (each token followed by one of ``--successors`` tokens, drawn
with fixed odds). It is then fine-tuned with transformers' ``Trainer`` and its defaults (lr 5e-5, linear decay,
``max_grad_norm=1.0``, no weight decay) on a shifted corpus (the same chain with its successors drawn anew), its
parameters offloaded and stepped by ``OffloadedAdamW`` under a ``--host-budget`` host tier, once for each policy:
``speculate=False`` (the reference), ``"auto"`` and ``True``, each in a fresh store from the same pretrained weights
and on the same batches. Printed: the share of fine-tuning steps whose gradient norm passed ``max_grad_norm`` (so
that the clip clipped), each policy's median step time, drive bytes a step, and updates speculated, kept and undone,
its ratio to the reference, and whether the three end bit-identical.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time


def _corpus(vocab: int, successors: int, seed: int):
    """A random Markov chain over ``vocab`` tokens: (each token's successors, their odds)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    nxt = torch.stack([torch.randperm(vocab, generator=g)[:successors] for _ in range(vocab)])
    odds = torch.rand(vocab, successors, generator=g) ** 2 + 0.05
    return nxt, odds / odds.sum(1, keepdim=True)


def _sequence(chain, tokens: int, seed: int):
    import torch

    nxt, odds = chain
    g = torch.Generator().manual_seed(seed)
    out = [int(torch.randint(0, nxt.shape[0], (1,), generator=g))]
    for _ in range(tokens - 1):
        out.append(int(nxt[out[-1], torch.multinomial(odds[out[-1]], 1, generator=g)]))
    return torch.tensor(out)


def _model(args: argparse.Namespace):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.width * 3,
                                   num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=args.tokens, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def pretrain(args: argparse.Namespace):
    """The model pretrained on the first corpus, resident, with torch's AdamW."""
    import torch

    model = _model(args)
    chain = _corpus(args.vocab, args.successors, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.pretrain_steps):
        ids = torch.stack([_sequence(chain, args.tokens, 10_000 + step * args.batch + i) for i in range(args.batch)])
        model(ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return model


def finetune(pretrained, policy, args: argparse.Namespace, nvme: str, batches: list) -> dict:
    """``Trainer`` with its defaults over ``batches`` (one per step), OffloadedAdamW(speculate=policy)."""
    import torch
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import tierstore as ts
    from tierstore.integrations import OffloadedAdamW, offload_model

    model = copy.deepcopy(pretrained)
    store = ts.TierStore(nvme_path=nvme, host_budget_bytes=ts.parse_bytes(args.host_budget, name="--host-budget"),
                         device_budget_bytes="1MiB")
    off = offload_model(model, store, units=[LlamaDecoderLayer])
    training = transformers.TrainingArguments(output_dir=nvme, per_device_train_batch_size=args.batch,
                                              max_steps=len(batches), logging_steps=1, report_to=[],
                                              save_strategy="no", seed=0, use_cpu=True)
    opt = OffloadedAdamW(off, lr=training.learning_rate, weight_decay=training.weight_decay,
                         speculate=policy, stream_update=policy is not False)
    rows = [{"input_ids": ids, "labels": ids} for b in batches for ids in b]

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> dict:
            return rows[i]

    seconds: list[float] = []
    moved: list[int] = []

    def drive() -> int:
        s = store.stats_dict()
        return s["bytes_read_nvme"] + s["bytes_written_nvme"]

    class Meter(transformers.TrainerCallback):
        def on_step_begin(self, *_: object, **__: object) -> None:
            self.start = (time.perf_counter(), drive())

        def on_step_end(self, *_: object, **__: object) -> None:
            seconds.append(time.perf_counter() - self.start[0])
            moved.append(drive() - self.start[1])

    trainer = transformers.Trainer(model=model, args=training, train_dataset=Rows(), optimizers=(opt, None),
                                   callbacks=[Meter()])
    trainer.train()
    opt.wait()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    stats = store.stats_dict()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()
    off.remove(keep_values=False)
    store.close()
    return {"policy": policy, "norms": norms, "losses": losses, "step_seconds": seconds, "bytes_moved": moved,
            "speculation": {k: stats[k] for k in ("updates_speculated", "speculated_kept", "speculated_undone")},
            "state": state}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nvme-path", default=None, help="where the swap files go (a temporary folder by default)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--successors", type=int, default=4)
    p.add_argument("--pretrain-steps", type=int, default=600)
    p.add_argument("--steps", type=int, default=200, help="fine-tuning steps")
    p.add_argument("--host-budget", default="2MiB")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    import torch

    pretrained = pretrain(args)
    shifted = _corpus(args.vocab, args.successors, seed=2)
    batches = [[_sequence(shifted, args.tokens, step * args.batch + i) for i in range(args.batch)]
               for step in range(args.steps)]
    runs = []
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme:
        for policy in (False, "auto", True):
            runs.append(finetune(pretrained, policy, args, nvme, batches))
    params = sum(t.numel() for t in pretrained.parameters())
    norms = runs[0]["norms"]
    clipped = sum(n > 1.0 for n in norms)
    print(f"{params / 1e6:.2f}M-parameter Llama pretrained {args.pretrain_steps} steps on a Markov chain, fine-tuned "
          f"{args.steps} steps on a shifted one with Trainer's defaults (lr 5e-5, max_grad_norm 1.0), host budget "
          f"{args.host_budget}")
    print(f"steps that clipped: {clipped} of {len(norms)} ({clipped / max(1, len(norms)):.0%}); gradient norm median "
          f"{statistics.median(norms):.3g}, first {norms[0]:.3g}, last {norms[-1]:.3g}")
    ref = statistics.median(runs[0]["step_seconds"])
    print(f"{'speculate':<11}{'step s':>8}{'vs ref':>8}{'MB/step':>9}{'made':>7}{'kept':>7}{'undone':>8}")
    results = []
    for r in runs:
        med = statistics.median(r["step_seconds"])
        mb = statistics.median(r["bytes_moved"]) / 1e6
        s = r["speculation"]
        results.append({"policy": r["policy"], "step_seconds": med, "ratio": med / ref, "bytes_per_step": mb * 1e6,
                        **s})
        print(f"{str(r['policy']):<11}{med:>8.3f}{med / ref:>7.2f}x{mb:>9.1f}{s['updates_speculated']:>7}"
              f"{s['speculated_kept']:>7}{s['speculated_undone']:>8}")
    identical = all(torch.equal(runs[0]["state"][k], r["state"][k]) for r in runs[1:] for k in runs[0]["state"])
    same_losses = all(r["losses"] == runs[0]["losses"] for r in runs[1:])
    print(f"the reference: speculate=False, {ref:.3f} s a step; bit-identical: {identical}, same losses: {same_losses}")
    out = {"params": params, "steps": len(norms), "steps_clipped": clipped, "norms": norms, "results": results,
           "identical": identical and same_losses}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
