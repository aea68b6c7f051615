"""A training process to kill: offloads a small model to NVMEPATH, prints "step N" after each step, forever."""

import sys

import torch
import torch.nn.functional as F

import tierstore as ts
from tierstore.integrations.offload import offload_model
from tierstore.integrations.optim import OffloadedAdamW


def main(path: str) -> None:
    store = ts.TierStore(nvme_path=path, host_budget_bytes="256KiB", file_size_bytes="1MiB",
                         block_size_bytes="64KiB")
    print("dir", store.swap_directory, flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = OffloadedAdamW(offload_model(model, store), lr=1e-3)
    step = 0
    while True:
        F.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 4, (8,))).backward()
        opt.step()
        opt.zero_grad()
        print("step", step, flush=True)
        step += 1


if __name__ == "__main__":
    main(sys.argv[1])
