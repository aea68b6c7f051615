"""Run under torchrun: a transformers Llama (untied) under ``fully_shard`` on each layer and the root, its steps
``--micro-batches`` micro-batches each and torch's ``clip_grad_norm_`` before the optimizer, trained by
``off.accumulate`` (layer by layer) on ``offload_fsdp`` against FSDP2 alone's accumulation loop with gradient sync on
the last micro-batch only (FSDP2's recipe), torch's AdamW both sides. Prints one JSON object per rank: both runs'
losses and clip norms, whether the final local shards and Adam moments are bit-identical, and each offloaded step's
collectives (all-gather and reduce-scatter calls and bytes, this rank's) and drive bytes; with ``--offloaded-only``
the reference is not run and ``peak_rss`` is this process's peak resident memory (a fresh process per figure)."""

import argparse
import copy
import json
import os
import resource
import sys
import warnings

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

from tierstore import StoreConfig, TierStore
from tierstore.integrations.fsdp import offload_fsdp
from tierstore.integrations.optim import OffloadedAdamW

VOCAB = 96


class Collectives:
    """Counts FSDP2's all-gathers and reduce-scatters (calls, and the bytes this rank sends into each)."""

    def __init__(self) -> None:
        self.counts = {"all_gather": [0, 0], "reduce_scatter": [0, 0]}
        for name, kind in (("all_gather_single", "all_gather"), ("reduce_scatter_single", "reduce_scatter")):
            real = getattr(dist, name)

            def counted(*args, _real=real, _kind=kind, **kwargs):
                inp = kwargs.get("input", args[1] if len(args) > 1 else None)
                self.counts[_kind][0] += 1
                self.counts[_kind][1] += inp.numel() * inp.element_size()
                return _real(*args, **kwargs)

            setattr(dist, name, counted)

    def take(self) -> dict:
        out = {k: {"calls": c, "bytes": b} for k, (c, b) in self.counts.items()}
        self.counts = {k: [0, 0] for k in self.counts}
        return out


class _Out:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class _Block(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(h)))


class Mixed(torch.nn.Module):
    """A root parameter (``scale``) used before the first block and after the last: its gradient's parts come from
    the head's stretch and from the embedding's."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.scale = torch.nn.Parameter(torch.ones(hidden))
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(_Block(hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> _Out:
        h = self.embed(input_ids) * self.scale
        for layer in self.model.layers:
            h = layer(h)
        logits = self.head(h * self.scale)
        return _Out(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def build(layers: int, hidden: int, tied: bool = False, mixed: bool = False) -> torch.nn.Module:
    if mixed:
        torch.manual_seed(0)
        return Mixed(layers, hidden)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 7 // 4,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def shard(model: torch.nn.Module, reshard_after_forward: bool = True) -> torch.nn.Module:
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    return model


def micro_batches(step: int, n: int, rank: int, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (n, 2 * world, 12), generator=g)
    return [ids[m, rank::world] for m in range(n)]


def step_fn(model, fail_at=None):
    """One micro-batch's forward and backward; ``fail_at``: the micro-batch whose backward raises instead."""
    def one(ids):
        loss = model(input_ids=ids, labels=ids).loss
        if fail_at is not None and ids is fail_at:
            raise KeyboardInterrupt("stopped in a micro-batch")
        loss.backward()
        return loss.item()
    return one


def reference(model, opt, steps, n, rank, world, max_norm, sync_every=False):
    """FSDP2 alone: sync on the last micro-batch only (``sync_every``: on each)."""
    losses = []
    for step in range(steps):
        for m, ids in enumerate(micro_batches(step, n, rank, world)):
            model.set_requires_gradient_sync(sync_every or m == n - 1)
            losses.append(step_fn(model)(ids))
        losses.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).full_tensor().item())
        opt.step()
        opt.zero_grad()
    return losses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--host-budget", default="64KiB")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--loop", action="store_true", help="the offloaded run as FSDP2's loop (sync on the last only)")
    p.add_argument("--offloaded-only", action="store_true")
    p.add_argument("--tied", action="store_true", help="tied embeddings (they run as the loop, said once)")
    p.add_argument("--mixed", action="store_true", help="a root parameter used before the first layer and after "
                   "the last (found in the first step, which then runs as the loop, syncing each micro-batch as "
                   "the user left it: so does the reference)")
    p.add_argument("--speculate", action="store_true", help='OffloadedAdamW(speculate="auto")')
    p.add_argument("--keep-gathered", action="store_true", help="fully_shard(layer, reshard_after_forward=False)")
    p.add_argument("--fail-once", action="store_true",
                   help="the first step is stopped in its second micro-batch, then run again after zero_grad()")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = args.micro_batches
    base = build(args.layers, args.hidden, args.tied, args.mixed)
    counter = Collectives()
    out: dict = {"rank": rank}
    if not args.offloaded_only:
        ref = shard(copy.deepcopy(base), not args.keep_gathered)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
        out["ref"] = reference(ref, ref_opt, args.steps, n, rank, world, args.max_norm, sync_every=args.mixed)
        out["ref_collectives"] = counter.take()
    model = shard(base, not args.keep_gathered)
    with TierStore(StoreConfig(nvme_path=args.nvme_path, host_budget_bytes=args.host_budget,
                               file_size_bytes="4MiB", block_size_bytes="64KiB")) as store:
        off = offload_fsdp(model, store)
        opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, speculate=True if args.speculate else False)
        losses, steps = [], []
        counter.take()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for step in range(args.steps):
                read0 = store.stats_dict()["bytes_read_nvme"]
                mbs = micro_batches(step, n, rank, world)
                if args.fail_once and step == 0:
                    try:
                        off.accumulate(step_fn(model, fail_at=mbs[1]), mbs)
                    except KeyboardInterrupt:
                        opt.zero_grad()
                        out["stopped"] = True
                if args.loop:
                    for m, ids in enumerate(mbs):
                        model.set_requires_gradient_sync(m == n - 1)
                        losses.append(step_fn(model)(ids))
                else:
                    losses.extend(off.accumulate(step_fn(model), mbs))
                losses.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm).full_tensor().item())
                opt.step()
                opt.zero_grad()
                opt.wait()
                steps.append({**counter.take(), "drive_read": store.stats_dict()["bytes_read_nvme"] - read0})
        out.update(ours=losses, steps=steps, layer_major_steps=off.stats.layer_major_steps,
                   loop_steps=off.stats.loop_steps, refused=off.layer_major_refused,
                   warned=[str(w.message) for w in said if "tierstore" in str(w.message) or "offload_fsdp" in
                           str(w.message)],
                   params=sum(p.numel() for p in model.parameters()),
                   speculated={k: store.stats_dict()[k] for k in ("updates_speculated", "speculated_kept",
                                                                  "speculated_undone")})
        if not args.offloaded_only:
            moments = {n_: {w: store.read(k) for _, w, k in opt.state_tensors() if _ == n_}
                       for n_, _, _ in opt.state_tensors()}
            out["same_parameters"] = all(torch.equal(off.read_param(name), q.to_local())
                                         for name, q in ref.named_parameters())
            out["same_moments"] = all(torch.equal(moments[name][m], ref_opt.state[q][m].to_local())
                                      for name, q in ref.named_parameters() for m in ("exp_avg", "exp_avg_sq"))
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
