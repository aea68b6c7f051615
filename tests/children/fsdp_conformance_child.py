"""Run under torchrun: a model tierstore did not write (see conformance.py), sharded with FSDP2 per layer, trained
offloaded against FSDP2 alone. Prints one JSON line per rank: both runs' losses and whether the offloaded shards and
Adam moments end bit-identical to FSDP2's. With a third argument ``views`` each step's loss sums that many forwards
(two views of a batch) before its one backward, and gradients are zeroed in place (``zero_grad(set_to_none=False)``)
rather than dropped. Flags after it: ``fused`` runs torch's fused AdamW on both sides; ``accumulate-clip`` makes
each step two micro-batches and torch's ``clip_grad_norm_(model.parameters(), 1.0)`` before the step, and reports
the gradient shards found in the store and on the drive after each backward and whether ``param.grad`` read equal to
FSDP2's (see [Note: Gradient shards in the tiers]); ``8bit-split`` trains the model in bf16 with 8-bit moments and
split masters, FSDP2 alone stepping each local shard with the layout's reference update (torch operations, the state
kept beside it), and compares the stored state byte for byte; ``frozen`` freezes every parameter but the first
layer's (a frozen backbone: most groups have nothing to reduce in backward, yet are all-gathered for it); ``stream``
streams the updates into the next forward (``OffloadedAdamW(stream_update=True)``) of the model with 8 layers, each
layer's forward slowed so that the worker would run ahead of it, and reports for each update the worker started
while the next forward ran how far that forward was from its parameter and how far it may be (see [Note: Paced
streamed updates]); ``no-sync`` turns FSDP2's gradient sync off for each step's first micro-batch (with
``accumulate-clip``), as FSDP2's recipe for accumulation does, and reports the warnings that say so; ``speculate``
makes each update in the last micro-batch's backward (``OffloadedAdamW(speculate="auto")``,
``opt.set_is_last_micro_batch``) and reports the store's counts of them; ``clip-never`` clips at a norm never
reached."""

import copy
import json
import os
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the tests' shared modules
from conformance import CASES  # noqa: E402
from tierstore import StoreConfig, TierStore
from tierstore.integrations import _layouts as L
from tierstore.integrations.fsdp import offload_fsdp
from tierstore.integrations.optim import OffloadedAdamW

LAYERS = {"llama-tied": lambda m: m.model.layers, "mha-encoder": lambda m: m.layers, "gpt2": lambda m: m.transformer.h,
          "albert": lambda m: m.albert.encoder.albert_layer_groups}  # albert: one group, used at every depth


def shard(model, layers):
    for layer in layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def train(model, opt, case, rank, world, views, clip=False, store=None, no_sync=False, max_norm=1.0):
    losses, seen = [], []
    for step in range(3 if views == 1 else 6):
        for micro in range(2 if clip else 1):
            if hasattr(opt, "set_is_last_micro_batch"):
                opt.set_is_last_micro_batch(micro == (1 if clip else 0))
            if no_sync:  # FSDP2's recipe: gradient sync on the last micro-batch only
                model.set_requires_gradient_sync(micro == 1)
            torch.manual_seed(100 + rank * 10 + step)  # dropout: the same masks in both runs
            loss = sum(case.loss(model, case.batch(10 * step + v + 5 * micro, batch=2 * world)[rank::world])
                       for v in range(views))
            loss.backward()
            losses.append(loss.item())
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            losses.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
            grads = [p.grad.to_local().clone() for p in model.parameters() if p.grad is not None]
            seen.append({"grads": grads, "in_store": _grads_in_store(store)})
        opt.step()
        opt.zero_grad(set_to_none=views == 1)  # two views: gradients zeroed in place, accumulated into next step
    return losses, seen


class CompressedReference:
    """FSDP2 alone with OffloadedAdamW's 8-bit moments and split masters, on each rank's local shards: the state
    as the layout stores it, updated by the layout's torch operations (native=False)."""

    def __init__(self, model):
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.state = {}
        self.steps = 0

    def step(self):
        self.steps += 1
        for name, p in self.params:
            if p.grad is None:
                continue
            local = p._local_tensor  # the shard itself, stepped in place
            n = local.numel()
            how = "8bit" if n >= L.MIN_COMPRESSED else "plain"
            if name not in self.state:
                moment = (lambda: torch.zeros(L.packed_size(n), dtype=torch.uint8)) if how == "8bit" else (
                    lambda: torch.zeros_like(local, dtype=torch.float32))
                self.state[name] = {"exp_avg": moment(), "exp_avg_sq": moment(),
                                    "master": torch.zeros_like(local, dtype=torch.int16)}
            st = self.state[name]
            L.compressed_update(moments=how, master="split", weight=local, low=st["master"], exp_avg=st["exp_avg"],
                                exp_avg_sq=st["exp_avg_sq"], grad=p.grad.to_local(), step=float(self.steps),
                                hyper=(1e-3, (0.9, 0.999), 1e-8, 0.01, False), seed=0, native=False)

    def zero_grad(self, set_to_none=True):
        for _, p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def _watch_pacing(off, opt, layers, began, paced):
    """Slow each layer's forward, and record (how far the forward is from its parameter, how far it may be) for
    each update the worker starts while a forward runs: the updates step() queues wait for the next forward to
    begin (before it they would run at once)."""
    from tierstore.integrations._streamed import AHEAD

    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: time.sleep(0.02))
    begin_step, timed_step, pace = off._begin_step, opt._timed_step, opt._streamed._pace
    off._begin_step = lambda: (begin_step(), began.set())  # before the forward all-gathers

    def record(name, key, *args, **kw):
        if threading.current_thread() is not threading.main_thread():
            d = off.forward_distance(key)
            if d < float("inf"):
                paced.append((d, off.prefetch_policy.depth + AHEAD))
        return timed_step(name, key, *args, **kw)

    def gated(i, it):
        began.wait(60)
        pace(i, it)

    step = opt.step

    def gated_step():
        began.clear()  # the updates it queues wait for the next forward
        return step()

    opt._timed_step, opt._streamed._pace, opt.step = record, gated, gated_step


def _grads_in_store(store):
    """(gradient keys in the store, how many of them have a copy on the drive); None without a store."""
    if store is None:
        return None
    keys = [k for k in store.keys() if k.startswith("grad/")]
    return len(keys), sum("nvme" in store.info(k)["copies"] for k in keys)


def main(name: str, nvme_path: str, views: int, fused: bool, clip: bool, compressed: bool = False,
         frozen: bool = False, stream: bool = False, no_sync: bool = False, speculate: bool = False,
         max_norm: float = 1.0) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    case = CASES[name]
    torch.manual_seed(0)
    base = case.build()
    if stream:  # deep enough that a worker running ahead of the forward would start updates far from it
        base.config.num_hidden_layers = 8
        torch.manual_seed(0)
        base = type(base)(base.config)
    if compressed:
        base = base.to(torch.bfloat16)
        L.MIN_COMPRESSED = 256  # these models' shards are smaller than the default's bar: compress them all
    if frozen:
        first = next(iter(LAYERS[name](base)))
        for p in base.parameters():
            p.requires_grad_(False)
        first.requires_grad_(True)
    ref = shard(copy.deepcopy(base), LAYERS[name])
    ref_opt = CompressedReference(ref) if compressed else torch.optim.AdamW(
        ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False, fused=fused)
    ref_losses, ref_seen = train(ref, ref_opt, case, rank, world, views, clip, no_sync=no_sync, max_norm=max_norm)
    model = shard(copy.deepcopy(base), LAYERS[name])
    with TierStore(StoreConfig(nvme_path=nvme_path, host_budget_bytes="256KiB", device_budget_bytes="1MiB",
                               file_size_bytes="4MiB", block_size_bytes="64KiB")) as store:
        off = offload_fsdp(model, store)
        opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, fused=fused, stream_update=stream,
                             speculate="auto" if speculate else False,
                             **({"moments": "8bit", "master": "split"} if compressed else {}))
        paced, began = [], threading.Event()
        if stream:
            _watch_pacing(off, opt, LAYERS[name](model), began, paced)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            losses, seen = train(model, opt, case, rank, world, views, clip, store, no_sync=no_sync,
                                 max_norm=max_norm)
        warned = [str(w.message) for w in said if "offload_fsdp" in str(w.message)]
        began.set()  # no forward comes: the last step's updates run at once
        opt.wait()
        moments: dict[str, dict[str, torch.Tensor]] = {}  # each rank's state as stored
        for n, what, key in opt.state_tensors():
            moments.setdefault(n, {})[what] = store.read(key)
        same = all(torch.equal(off.read_param(n), p.to_local()) for n, p in ref.named_parameters())
        if compressed:  # the stored bytes: packed 8-bit moments (fp32 for small shards), masters' low halves
            differ = [f"{n}/{m}: {tuple(moments[n][m].shape)} {moments[n][m].dtype} against "
                      f"{tuple(ref_opt.state[n][m].shape)} {ref_opt.state[n][m].dtype}"
                      for n in ref_opt.state for m in ("exp_avg", "exp_avg_sq", "master")
                      if not torch.equal(moments[n][m].view(-1), ref_opt.state[n][m].view(-1))]
            same_moments = not differ and set(ref_opt.state) == set(moments) and any(
                v["exp_avg"].dtype == torch.uint8 for v in moments.values())
            if not same_moments:
                print(json.dumps({"rank": rank, "moments_differ": differ[:4], "ours": sorted(moments)[:6],
                                  "ref": sorted(ref_opt.state)[:6]}), file=sys.stderr, flush=True)
        else:
            same_moments = all(torch.equal(moments[n][m], ref_opt.state[p][m].to_local())
                               for n, p in ref.named_parameters() if p.requires_grad
                               for m in ("exp_avg", "exp_avg_sq"))
        read = store.stats_dict()["bytes_read_nvme"]
        speculated = {k: store.stats_dict()[k] for k in ("updates_speculated", "speculated_kept",
                                                          "speculated_undone")}
        # A layer: its uses in the step's trace.
        first = next(g for g in off.units() if "layers" in g or ".h." in g or "layer_groups" in g)
        uses = off.prefetch_policy.trace.count(first)
        forward = off.prefetch_policy.trace[:off.prefetch_policy.forward_uses or 0]
        removed_clean = None
        if clip:  # gradients kept in the store when the offload is removed: they go with it
            case.loss(model, case.batch(99, batch=2 * world)[rank::world]).backward()
            kept = _grads_in_store(store)[0]
            off.remove()
            removed_clean = kept > 0 and _grads_in_store(store)[0] == 0 and all(
                p.grad is None for p in model.parameters())
    print(json.dumps({"rank": rank, "ref": ref_losses, "ours": losses, "same_parameters": same, "warned": warned,
                      "same_moments": same_moments, "read_bytes": read, "speculated": speculated,
                      "paced": paced, "trained": len(moments), "parameters": len(list(model.parameters())),
                      "uses_of_a_layer": uses,
                      "uses_of_it_in_forward": forward.count(first), "verdict": off.placement_verdict,
                      "grads_in_store": [x["in_store"] for x in seen], "removed_clean": removed_clean,
                      "same_grads": [len(a["grads"]) == len(b["grads"]) and all(map(torch.equal, a["grads"], b["grads"]))
                                     for a, b in zip(seen, ref_seen)]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1, "fused" in sys.argv[4:],
         "accumulate-clip" in sys.argv[4:], "8bit-split" in sys.argv[4:], "frozen" in sys.argv[4:],
         "stream" in sys.argv[4:], "no-sync" in sys.argv[4:], "speculate" in sys.argv[4:],
         1e9 if "clip-never" in sys.argv[4:] else 1.0)
    sys.stdout.flush()
    os._exit(0)  # skip C++ teardown at exit, as the torchrun example does (see tierstore/tools/fsdp_train.py)
