"""Run under torchrun: the project's ViT with each block compiled in place (``block.compile()``) and sharded
with FSDP2 per block, as torchtitan compiles and shards, trained offloaded against FSDP2 alone compiled the
same way. Prints one JSON line per rank: both runs' losses, whether the offloaded shards end bit-identical to
FSDP2's, and how many graphs dynamo made by the last steps."""

import copy
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from tierstore import StoreConfig, TierStore
from tierstore.integrations import OffloadedAdamW, offload_fsdp
from tierstore.tools.vit import PRESETS, SyntheticImages, ViT

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the tests' shared modules
from _training import _train  # noqa: E402

warnings.filterwarnings("ignore")


def build(base):
    model = copy.deepcopy(base)
    for block in model.blocks:
        block.compile()
        fully_shard(block)
    return fully_shard(model)


def main(nvme_path: str, in_backward: bool) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = SyntheticImages(PRESETS["tiny"])
    torch.manual_seed(0)
    base = ViT(PRESETS["tiny"])
    ref = build(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ref_losses = _train(ref, data, 4, ref_opt, batch=2, rank=rank, world=world)
    model = build(base)
    graphs: list[int] = []
    with TierStore(StoreConfig(nvme_path=nvme_path, host_budget_bytes="512KiB")) as store:
        off = offload_fsdp(model, store)
        opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, step_in_backward=in_backward)

        def count_graphs(step: int) -> None:
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])

        losses = _train(model, data, 4, opt, batch=2, rank=rank, world=world, after_step=count_graphs)
        opt.wait()
        same = all(torch.equal(off.read_param(n), p.to_local()) for n, p in ref.named_parameters())
        opt.close()
    print(json.dumps({"rank": rank, "ref": ref_losses, "ours": losses, "same_parameters": same, "graphs": graphs}),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "in-backward")
    sys.stdout.flush()
    os._exit(0)  # skip C++ teardown at exit, as the torchrun example does (see tierstore/tools/fsdp_train.py)
