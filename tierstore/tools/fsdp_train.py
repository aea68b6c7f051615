"""Train the ViT with FSDP2 + NVMe offload on N ranks.

    torchrun --nproc_per_node 2 -m tierstore.tools.fsdp_train --preset small --steps 5 --nvme-path .

gloo on CPU, NCCL on CUDA, chosen automatically. Each rank has its own store
(its own private swap directory under ``--nvme-path``). Rank 0 prints per step
the mean loss, the slowest rank's step time and stall time, and the drive
bytes and GB/s summed over ranks; at the end each rank's bytes of parameter
shards and optimizer state per tier. ``--check`` also trains the same model
with FSDP2 alone (no offload, ``torch.optim.AdamW(foreach=False)``), prints
its step times, and fails unless losses, parameters and Adam moments are
bit-identical. ``--dtype bf16 --moments 8bit --master-weights split`` trains bf16
weights with compressed optimizer state (each rank's shards quantized on
their own); ``--check`` then has no torch reference to equal and is refused,
while ``--checkpoint`` still checks that a resumed run repeats every loss.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tierstore import StoreConfig, TierStore, default_nvme_path, parse_bytes
from tierstore.files import read_safetensors
from tierstore.integrations import (
    OffloadedAdamW,
    consolidate_checkpoint,
    load_checkpoint,
    offload_fsdp,
    save_checkpoint,
)

from . import flags
from .demo import DTYPES, default_budgets
from .rss import peak_rss_bytes
from .vit import PRESETS, SyntheticImages, ViT, num_params

MIB = 1024**2


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _model(preset: str, dtype: str) -> torch.nn.Module:
    return ViT(PRESETS[preset]).to(DTYPES[dtype])


def _batch(data: SyntheticImages, step: int, batch_size: int, rank: int, world: int):
    x, y = data.batch(step, batch_size * world)
    return x[rank::world], y[rank::world]


def _train_step(model, opt, data, step, batch_size, rank, world, micro_batches: int = 1, off=None) -> float:
    """One step of this rank's ``batch_size`` images in ``micro_batches`` micro-batches, each loss divided by
    their number: one after another with gradient sync on the last only (FSDP2's recipe), or layer by layer
    through ``off.accumulate`` where ``off`` is given. The step's loss."""
    x, y = _batch(data, step, batch_size, rank, world)

    def one(mb) -> float:
        loss = F.cross_entropy(model(mb[0].to(model.pos.dtype)).float(), mb[1]) / micro_batches
        loss.backward()
        return loss.item()

    mbs = list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
    if off is not None:
        losses = off.accumulate(one, mbs)
    else:
        losses = []
        for m, mb in enumerate(mbs):
            if micro_batches > 1:
                model.set_requires_gradient_sync(m == micro_batches - 1)
            losses.append(one(mb))
    opt.step()
    opt.zero_grad()
    return sum(losses)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        torch.manual_seed(0)
        cfg = PRESETS[args.preset]
        base = _model(args.preset, args.dtype)
        n = num_params(base)
        data = SyntheticImages(cfg)
        reference = None
        reference_step_s: list[float] = []
        if args.check:
            ref_model = _shard(copy.deepcopy(base))
            ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
            ref_losses, ref_full_at_save = [], None
            for s in range(args.steps):
                if args.checkpoint and s == args.save_at:  # full parameters as a checkpoint there holds them
                    ref_full_at_save = {n: p.full_tensor() for n, p in ref_model.named_parameters()}
                dist.barrier()
                t0 = time.perf_counter()
                ref_losses.append(_train_step(ref_model, ref_opt, data, s, args.batch_size, rank, world,
                                              args.micro_batches))
                reference_step_s.append(_slowest(time.perf_counter() - t0))
            reference = (ref_model, ref_opt, ref_losses, ref_full_at_save)
            if rank == 0:
                print("FSDP2 alone (no offload), slowest rank's step s: "
                      + " ".join(f"{t:.3f}" for t in reference_step_s), flush=True)
        model = _shard(copy.deepcopy(base))
        del base
        state_bytes, host, device = default_budgets(n // world, args.host_budget, args.device_budget)  # per rank
        config = StoreConfig(nvme_path=args.nvme_path, host_budget_bytes=host, device_budget_bytes=device)
        if rank == 0:
            print(f"FSDP2 + NVMe: ViT-{args.preset}, {n / 1e6:.1f}M parameters on {world} ranks "
                  f"({dist.get_backend()}), ~{state_bytes / MIB:.0f} MiB of fp32 shards + AdamW state per rank "
                  f"on NVMe under {args.nvme_path!r}, host budget {host / MIB:.0f} MiB per rank, "
                  f"prefetch depth {args.prefetch_depth}", flush=True)
            print(f"{'step':>4} {'loss':>8} {'step s':>8} {'stall s':>8} {'read MiB':>9} {'write MiB':>9} "
                  f"{'NVMe GB/s':>9}", flush=True)
        rows = []
        with TierStore(config) as store:
            off = offload_fsdp(model, store, prefetch_depth=args.prefetch_depth)
            opt = OffloadedAdamW(off, lr=args.lr, weight_decay=0.01, step_in_backward=args.optimizer_step == "in-backward",
                                 speculate=False, moments=args.moments, master=args.master)
            store.flush()
            for step in range(args.steps):
                if args.checkpoint and step == args.save_at:
                    save_checkpoint(args.checkpoint, off, opt, extra={"step": step})
                before = store.stats_dict()
                dist.barrier()
                t0 = time.perf_counter()
                with _CollectiveBytes(world) as collectives:
                    loss = _train_step(model, opt, data, step, args.batch_size, rank, world, args.micro_batches,
                                       off if args.layer_major else None)
                dt = time.perf_counter() - t0
                after = store.stats_dict()
                local = torch.tensor([loss, dt, after["stall_seconds"] - before["stall_seconds"],
                                      after["bytes_read_nvme"] - before["bytes_read_nvme"],
                                      after["bytes_written_nvme"] - before["bytes_written_nvme"],
                                      collectives.bytes["all_gather"], collectives.bytes["reduce_scatter"]],
                                     dtype=torch.float64)
                rows.append(_aggregate(local, world))
                if rank == 0:
                    r = rows[-1]
                    print(f"{step:>4} {r['loss']:>8.4f} {r['step_s']:>8.3f} {r['stall_s']:>8.3f} "
                          f"{r['read_bytes'] / MIB:>9.1f} {r['written_bytes'] / MIB:>9.1f} {r['nvme_gbps']:>9.2f}",
                          flush=True)
            opt.close()
            per_rank = [None] * world
            shards = [sh.local for sh in off.params.values() if sh.local.numel()]
            mine = {"rank": rank, "state_bytes_by_tier": off.local_state_bytes(), "memory": store.memory(),
                    "peak_rss_bytes": peak_rss_bytes(), "shards": len(shards),
                    "layer_major_steps": off.stats.layer_major_steps,
                    "shards_in_memory": sum(t.untyped_storage().nbytes() > 0 for t in shards)}
            dist.all_gather_object(per_rank, mine)
            ok = None
            if reference is not None:
                ok = _all(_compare(off, opt, reference, [r["local_loss"] for r in rows]))
                # Detaching gives every shard its current value back in memory, as FSDP2 alone has it.
                opt.wait()
                off.remove()
                ok = ok and _all(all(torch.equal(p.to_local(), q.to_local()) for p, q in
                                     zip(model.parameters(), reference[0].parameters())))
        resumed = None
        if args.checkpoint:
            resumed = _all(_resume(args, config, data, rank, world, [r["local_loss"] for r in rows]))
            if reference is not None:
                ok = ok and _all(_check_consolidated(args.checkpoint, reference[3], rank))
        result = {"preset": args.preset, "params": n, "ranks": world, "backend": dist.get_backend(),
                  "steps": rows, "per_rank": per_rank, "bit_identical": ok, "host_budget_bytes": host,
                  "resumed_identical": resumed, "reference_step_s": reference_step_s}
        if rank == 0:
            for r in per_rank:
                tiers = "  ".join(f"{t} {b / MIB:.2f} MiB" for t, b in sorted(r["state_bytes_by_tier"].items()))
                print(f"rank {r['rank']}: parameter shards + optimizer state: {tiers}; {r['shards_in_memory']} of "
                      f"{r['shards']} shards in memory between steps; peak RSS {r['peak_rss_bytes'] / MIB:.0f} MiB",
                      flush=True)
            if ok is not None:
                print("bit-identical to FSDP2 without offload: " + ("yes" if ok else "NO"), flush=True)
            if resumed is not None:
                print(f"resumed from the step-{args.save_at} checkpoint, same losses: " + ("yes" if resumed else "NO"),
                      flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=2, default=str)
        dist.barrier()  # no rank tears gloo down while another still talks to it
        return result
    finally:
        dist.destroy_process_group()


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _all(ok: bool) -> bool:
    oks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(oks, ok)
    return all(oks)


def _resume(args, config, data, rank: int, world: int, losses: list[float]) -> bool:
    """A fresh model (other initial values) loads the checkpoint and trains the remaining steps."""
    torch.manual_seed(1)
    model = _shard(_model(args.preset, args.dtype))
    with TierStore(config) as store:
        off = offload_fsdp(model, store, prefetch_depth=args.prefetch_depth)
        opt = OffloadedAdamW(off, lr=args.lr, weight_decay=0.01, step_in_backward=args.optimizer_step == "in-backward",
                             speculate=False, moments=args.moments, master=args.master)
        extra = load_checkpoint(args.checkpoint, off, opt)
        again = [_train_step(model, opt, data, s, args.batch_size, rank, world, args.micro_batches,
                             off if args.layer_major else None) for s in range(extra["step"], args.steps)]
        opt.close()
    if again != losses[args.save_at:]:
        print(f"rank {rank}: resumed losses {again} vs {losses[args.save_at:]}", file=sys.stderr)
        return False
    return True


def _check_consolidated(path: str, full_at_save: dict[str, torch.Tensor], rank: int) -> bool:
    """Rank 0 joins the checkpoint's shards into one file: it must hold FSDP2's full parameters at the save."""
    if rank != 0:
        return True
    out = path + ".consolidated.safetensors"
    consolidate_checkpoint(path, out)
    loaded = read_safetensors(out)
    bad = sorted(n for n in full_at_save if n not in loaded or not torch.equal(loaded[n], full_at_save[n]))
    if bad or set(loaded) != set(full_at_save):
        print(f"consolidated checkpoint differs: {bad[:5]}", file=sys.stderr)
        return False
    print(f"consolidated {len(loaded)} full parameters into {out}", flush=True)
    return True


def _aggregate(local: torch.Tensor, world: int) -> dict[str, float]:
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    g = torch.stack(gathered)
    step_s = g[:, 1].max().item()
    read, written = g[:, 3].sum().item(), g[:, 4].sum().item()
    return {"local_loss": local[0].item(), "loss": g[:, 0].mean().item(), "step_s": step_s,
            "stall_s": g[:, 2].max().item(), "read_bytes": read, "written_bytes": written,
            "nvme_gbps": (read + written) / step_s / 1e9,
            # per rank (the mean over ranks): what `tierstore plan` predicts for these links
            "all_gather_bytes_per_rank": g[:, 5].mean().item(), "reduce_scatter_bytes_per_rank": g[:, 6].mean().item()}


class _CollectiveBytes:
    """Bytes this rank receives in FSDP2's all-gathers and sends in its reduce-scatters, counted where FSDP2 calls
    torch.distributed (``all_gather_single`` / ``reduce_scatter_single``, or the ``*_tensor`` forms)."""

    _CALLS = {"all_gather": (("all_gather_single", "all_gather_into_tensor"), 0, ("output_tensor", "output")),
              "reduce_scatter": (("reduce_scatter_single", "reduce_scatter_tensor"), 1, ("input", "input_tensor"))}

    def __init__(self, world: int) -> None:
        self.world = world
        self.bytes = {kind: 0.0 for kind in self._CALLS}
        self._saved: list[tuple[str, Any]] = []

    def __enter__(self) -> _CollectiveBytes:
        for kind, (names, index, keywords) in self._CALLS.items():
            for name in names:
                fn = getattr(dist, name, None)
                if fn is not None:
                    self._saved.append((name, fn))
                    setattr(dist, name, self._counted(fn, kind, index, keywords))
        return self

    def _counted(self, fn: Any, kind: str, index: int, keywords: tuple[str, ...]) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t = next((kwargs[k] for k in keywords if k in kwargs), None)
            t = args[index] if t is None else t
            self.bytes[kind] += t.numel() * t.element_size() * (self.world - 1) / self.world
            return fn(*args, **kwargs)
        return call

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved:
            setattr(dist, name, fn)


def _compare(off, opt, reference, losses: list[float]) -> bool:
    ref_model, ref_opt, ref_losses, _ = reference
    if losses != ref_losses:
        print(f"rank {dist.get_rank()}: losses differ: {losses} vs {ref_losses}", file=sys.stderr)
        return False
    sd = opt.state_dict(beyond_host_budget=True)  # by index, as torch's: the names under "param_names"
    names = [n for g in sd["param_groups"] for n in g["param_names"]]
    ours = {names[i]: entry for i, entry in sd["state"].items()}  # each piece a DTensor, as torch's AdamW's
    for name, p in ref_model.named_parameters():
        mine = off.read_param(name)
        st = ref_opt.state[p]
        if not torch.equal(mine, p.to_local()) or any(not torch.equal(ours[name][m].to_local(), st[m].to_local())
                                                       for m in ("exp_avg", "exp_avg_sq")):
            print(f"rank {dist.get_rank()}: {name} differs", file=sys.stderr)
            return False
    return True


def _bytes(text: str) -> int:
    return parse_bytes(text, name="budget")


def build_parser() -> argparse.ArgumentParser:
    """The example's command line (its vocabulary: tierstore/tools/flags.py)."""
    p = argparse.ArgumentParser(prog="python -m tierstore.tools.fsdp_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=list(PRESETS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8, help="images per rank per step (default 8)")
    flags.add_nvme_path(p)
    flags.add_prefetch_depth(p)
    flags.add_budgets(p, per_rank=True, parse=_bytes)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches a step, the batch split evenly; "
                   "one after another with gradient sync on the last only (default 1)")
    p.add_argument("--layer-major", action="store_true", help="run the micro-batches layer by layer "
                   "(off.accumulate; see docs/fsdp.md)")
    flags.add_optimizer_step(p)
    flags.add_dtype(p, choices=list(DTYPES))
    flags.add_layout(p)
    p.add_argument("--check", action="store_true", help="also train without offload and compare bit for bit "
                   "(fp32 weights and moments: the layout that is torch's AdamW)")
    p.add_argument("--json", metavar="FILE", help="rank 0 writes the figures here")
    p.add_argument("--checkpoint", metavar="DIR", help="save a checkpoint here before step --save-at, then "
                   "resume a fresh model from it and check it gives the same losses")
    p.add_argument("--save-at", type=int, default=1, help="step before which to save (default 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.micro_batches < 1 or args.batch_size % args.micro_batches:
        p.error(f"--micro-batches must divide --batch-size ({args.batch_size}) evenly")
    if args.check and (args.dtype, args.moments) != ("fp32", "fp32"):
        p.error("--check compares with torch's AdamW bit for bit, which only fp32 weights with fp32 moments are; "
                "drop --check, or --checkpoint DIR to check a resumed run repeats every loss")
    args.nvme_path = args.nvme_path or default_nvme_path()
    result = run(args)
    return 0 if result["bit_identical"] in (None, True) and result["resumed_identical"] in (None, True) else 1


if __name__ == "__main__":
    code = main()
    # Every store is closed (swap directories removed) and the process group destroyed by now. A run was seen
    # to abort after that, in C++ teardown at interpreter exit ("terminate called without an active
    # exception"), turning a finished, checked run into a failure: leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
