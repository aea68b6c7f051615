"""Run under torchrun: fp16 autocast with loss scaling under FSDP2, offloaded against FSDP2 alone.

Prints one JSON line per rank: both runs' (loss, scale) per step and whether the
offloaded shards end bit-identical to FSDP2's. The first step overflows (scale 2**30).
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tierstore import StoreConfig, TierStore
from tierstore.integrations.fsdp import offload_fsdp
from tierstore.tools.fsdp_train import _batch, _shard
from tierstore.integrations.optim import OffloadedAdamW, OffloadedGradScaler
from tierstore.tools.vit import PRESETS, SyntheticImages, ViT

SCALER = {"init_scale": 2.0**30, "backoff_factor": 2.0**-20, "growth_interval": 2}


def train(model, opt, scaler, data, rank, world):
    out = []
    for step in range(5):
        x, y = _batch(data, step, 8, rank, world)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append([loss.item(), scaler.get_scale()])
    return out


def main(nvme_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    base, data = ViT(cfg), SyntheticImages(cfg)
    ref = _shard(copy.deepcopy(base))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ref_run = train(ref, ref_opt, torch.amp.GradScaler("cpu", **SCALER), data, rank, world)
    model = _shard(copy.deepcopy(base))
    with TierStore(StoreConfig(nvme_path=nvme_path, host_budget_bytes="1MiB", device_budget_bytes="1MiB")) as store:
        off = offload_fsdp(model, store)
        opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01)
        run = train(model, opt, OffloadedGradScaler("cpu", **SCALER), data, rank, world)
        same = all(torch.equal(off.read_param(n), p.to_local()) for n, p in ref.named_parameters())
    print(json.dumps({"rank": rank, "ref": ref_run, "ours": run, "same_parameters": same}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # skip C++ teardown at exit, as the torchrun example does (see tierstore/tools/fsdp_train.py)
