"""Wraps a model offloaded with offload_model in DistributedDataParallel and prints what was raised (a process of
its own: a gloo group leaves a descriptor open). Argument: a directory for the swap files and the group's file."""

import sys

import torch
import torch.distributed as dist
from tierstore.integrations import offload_model

import tierstore as ts

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
with ts.TierStore(nvme_path=sys.argv[1], host_budget_bytes="1MiB") as store:
    offload_model(model, store)
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/group", rank=0, world_size=1)
    try:
        torch.nn.parallel.DistributedDataParallel(model)
    except Exception as e:
        print(type(e).__name__, e)
    dist.destroy_process_group()
