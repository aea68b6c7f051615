"""Run under torchrun: the project's ViT built on the meta device and sharded with FSDP2, then given memory one
module at a time by offload_fsdp, against FSDP2's own recipe for meta models (``to_empty``, then each module's
``reset_parameters()``) from the same seed. With a tied head, the recipe's later module overwrites the tied
weight; offload_fsdp keeps the first module's values (see [Note: Building on the meta device]), so the reference
keeps them too. Prints one JSON line per rank."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from tierstore import StoreConfig, TierStore
from tierstore.integrations import OffloadedAdamW, offload_fsdp
from tierstore.tools.vit import PRESETS, SyntheticImages, ViT

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the tests' shared modules
from _training import _train  # noqa: E402


def build(tied):
    with torch.device("meta"):
        model = ViT(PRESETS["tiny"], tie_head=tied)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def main(nvme_path: str, tied: bool) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = SyntheticImages(PRESETS["tiny"])
    ref = build(tied)
    ref.to_empty(device="cpu")
    torch.manual_seed(0)
    first: dict[int, torch.Tensor] = {}  # a tied parameter keeps what it got where it was met first
    with torch.no_grad():
        for module in ref.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
            for p in module.parameters(recurse=False):
                if id(p) in first:
                    p.copy_(first[id(p)])
                first.setdefault(id(p), p.detach().clone())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ref_init = {n: p.to_local().clone() for n, p in ref.named_parameters()}
    ref_losses = _train(ref, data, 3, ref_opt, batch=2, rank=rank, world=world)
    model = build(tied)
    blocks_only = ViT(PRESETS["tiny"])  # the root left unsharded: its parameters would never be stepped
    for block in blocks_only.blocks:
        fully_shard(block)
    with TierStore(StoreConfig(nvme_path=nvme_path, host_budget_bytes="256KiB")) as store:
        try:
            offload_fsdp(blocks_only, store)
            root_refused = False
        except ValueError as e:
            root_refused = "apply fully_shard to the root module too" in str(e) and not store.keys()
    with TierStore(StoreConfig(nvme_path=nvme_path, host_budget_bytes="256KiB", device_budget_bytes="1MiB",
                               file_size_bytes="4MiB", block_size_bytes="64KiB")) as store:
        seen = []

        def failing_init(module):  # fails part-way: nothing may be left in the store, the model back on meta
            seen.append(module)
            if len(seen) == 6:
                raise RuntimeError("init failed")
            module.reset_parameters()

        try:
            offload_fsdp(model, store, init_fn=failing_init)
        except RuntimeError:
            pass
        undone = (len(seen) == 6 and not store.keys() and all(p.is_meta for p in model.parameters())
                  and not hasattr(model, "_tierstore_offload"))
        torch.manual_seed(0)
        off = offload_fsdp(model, store)
        in_memory = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
        still_tied = not tied or model.head.weight is model.class_embed.weight
        same_init = all(torch.equal(off.read_param(n), v) for n, v in ref_init.items())
        opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01)
        losses = _train(model, data, 3, opt, batch=2, rank=rank, world=world)
        opt.wait()
        same = all(torch.equal(off.read_param(n), p.to_local()) for n, p in ref.named_parameters())
        on_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        opt.close()
    print(json.dumps({"rank": rank, "ref": ref_losses, "ours": losses, "same_init": same_init,
                      "same_parameters": same, "still_tied": still_tied, "undone": undone, "root_refused": root_refused,
                      "shard_bytes_in_memory": in_memory, "on_meta": on_meta}),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "tied")
    sys.stdout.flush()
    os._exit(0)  # skip C++ teardown at exit, as the torchrun example does (see tierstore/tools/fsdp_train.py)
